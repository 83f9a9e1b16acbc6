"""Who started this flow run, and whether it may have what it asks for (the trigger policy, configs/policy.py).

A flow run created from a deployment (the UI's form, the API, a schedule, the `ci` deployment) is bound by the
deployment's policy; a direct call of the flow (`grpo-pipeline run` and `hpo` on the worker's shell) is an
operator's and keeps full power. Which one this is comes from the flow run's own record (its `deployment_id`,
set by the server when the run was created from a deployment), never from `prefect.runtime.deployment`, which
an environment variable can mock. The policy comes from what the server holds for the deployment (its own
`config_path` and deploy-time parameters), never from the run's parameters, which the trigger chose.

A refusal (this policy's, or an invalid config or input the flow finds before any work) is logged once, plainly,
by `refusals_logged_plainly`: it is the user's to fix, not a crash.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict

from grpo_pipeline.configs.files import recipe
from grpo_pipeline.configs.policy import check_trigger, refusal_message
from grpo_pipeline.configs.schema import ConfigError, PipelineConfig, load_config


class Deployment(BaseModel):
    """A deployment as the server holds it: its name and its own parameters (set by `grpo-pipeline deploy`)."""

    model_config = ConfigDict(frozen=True)

    name: str
    parameters: dict[str, Any]


def _read_deployment(deployment_id: UUID) -> Deployment:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployment_id)
        flow = client.read_flow(deployment.flow_id)
    return Deployment(name=f"{flow.name}/{deployment.name}", parameters=dict(deployment.parameters or {}))


def started_by() -> Deployment | None:
    """The deployment this flow run was created from, or None when the flow was called directly (an operator)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = context.flow_run if context else None
    if run is None or run.deployment_id is None:
        return None
    return _read_deployment(run.deployment_id)


def run_config(config_path: str | None) -> str | None:
    """The config file a run names, found as the CLI finds `--config` (`grpo_pipeline.configs.files.recipe`): a path
    that exists in the folder the run works in, else a shipped recipe's `configs/NAME` in the installed package, so a
    deployment's `deploy.trigger.recipes` may name shipped recipes on a worker that has no checkout.

    >>> run_config("configs/demo-cpu.yaml").endswith("demo-cpu.yaml"), run_config("mine.yaml"), run_config(None)
    (True, 'mine.yaml', None)
    """
    return None if config_path is None else str(recipe(Path(config_path)))


def checked_config(
    config_path: str | None, overrides: list[str], as_overrides: typing.Callable[[dict[str, Any]], list[str]]
) -> PipelineConfig:
    """The configuration a flow run uses: its trigger checked against its deployment's policy (`enforce`), then the
    file it names (`run_config`) loaded with the overrides; ConfigError, before any work, for either."""
    return load_config(run_config(config_path), enforce(config_path, overrides, as_overrides))


def enforce(
    config_path: str | None,
    overrides: list[str],
    as_overrides: typing.Callable[[dict[str, Any]], list[str]],
    root: Path | None = None,
) -> list[str]:
    """The overrides the run uses; ConfigError, before any work, when a triggered run sets what its deployment does
    not allow.

    `overrides` are the run's, with its other form fields already turned into overrides (`as_overrides` does the
    same to the deployment's own parameters, so both compare alike). An operator's pass unchanged. A triggered
    run gets the deployment's own overrides first, then what it added: a trigger adds to what the deployment pins
    (allowed fields only) and cannot drop it.
    """
    deployment = started_by()
    if deployment is None:
        return overrides
    own_config = deployment.parameters.get("config_path")
    own_overrides = as_overrides(deployment.parameters)
    # The deployment's own configuration holds the policy; it passed the same checks when it was deployed. Its
    # recipes and the run's pick compare as the files the run would load (a shipped recipe's name included).
    policy = load_config(own_config, own_overrides).deploy.trigger
    policy = policy.model_copy(update={"recipes": [run_config(r) for r in policy.recipes]})
    refusals = check_trigger(
        policy,
        own_config,
        own_overrides,
        run_config(config_path),
        overrides,
        root or Path.cwd(),
        config_file=own_config or "the deployment's config",
    )
    if refusals:
        raise ConfigError(refusal_message(refusals, deployment.name))
    return [*own_overrides, *(item for item in overrides if item not in own_overrides)]


LOGGED = "grpo_logged_plainly"  # set on a ConfigError whose message the flow run's log holds already
# What the engine's last line of a refused run says instead of repeating the refusal as a Python repr
FINISHED_REFUSED = "Finished in state Failed: refused before any work, for the reason logged above"


class _LoggedRefusals(logging.Filter):
    """Keeps a refusal to one plain record in the flow run's log. Prefect's engine logs the exception that ends a
    flow run twice, each with its traceback ("Encountered exception during execution", and "Engine execution
    exited with unexpected exception" on a worker): dropped. Its last line, "Finished in state Failed('...')",
    repeats the whole message as a repr (its line breaks as literal `\\n`): said once, plainly, instead."""

    def __init__(self) -> None:
        super().__init__()
        self.refused_runs: set[str] = set()  # flow run ids whose refusal was logged

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if getattr(exc, LOGGED, False):
            return False
        if str(getattr(record, "flow_run_id", "")) in self.refused_runs and str(record.msg).startswith(
            "Finished in state Failed"
        ):
            record.msg, record.args = FINISHED_REFUSED, ()
        return True


@contextmanager
def refusals_logged_plainly() -> Iterator[None]:
    """Inside a flow run: a ConfigError raised here is logged once, as its message alone, and raised on, so the run
    still fails with it as its state message (what a failure notification sends) and its process still exits 1;
    Prefect's own records of it, with their tracebacks, are dropped, and its closing "Finished in state" line
    does not repeat it. Outside a flow run (the flow's function called directly, as tests do) it is raised
    untouched."""
    from prefect.context import FlowRunContext
    from prefect.logging import get_run_logger

    try:
        yield
    except ConfigError as exc:
        context = FlowRunContext.get()
        if context is not None:
            get_run_logger().error(str(exc))
            setattr(exc, LOGGED, True)
            runs = logging.getLogger("prefect.flow_runs")  # the engine's logger of flow runs
            plain = next((f for f in runs.filters if isinstance(f, _LoggedRefusals)), None)
            if plain is None:
                plain = _LoggedRefusals()
                runs.addFilter(plain)
            if context.flow_run is not None:
                plain.refused_runs.add(str(context.flow_run.id))
        raise
