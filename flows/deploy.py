"""`grpo-pipeline deploy`: register the deployments of prefect.yaml on the Prefect server PREFECT_API_URL names.

    grpo-pipeline deploy                                     # as prefect.yaml says: daily at 03:00 UTC
    grpo-pipeline deploy --config my.yaml --schedule-hour 2 --timezone Europe/Berlin \
        --notify-block slack-webhook/grpo-alerts

Steps: check the configuration, the server and the notification block (every refusal before any work); create
the work pool when missing (a process pool); apply the schedule, configuration and pool to prefect.yaml (`render`, a
pure function) and hand the result to Prefect's own `prefect deploy --all`, run in the folder `deploy` is started
from; then point a failure automation at the notification block. The schedule, pool and block come from the
config's `deploy` section, and the options override it. The command itself (its options, its one way of failing)
is in grpo_pipeline/cli/deploy.py.

Where the runs find things: the flows by module path (prefect.yaml's entrypoints), from the installed package; a
process worker works in the folder deployed from (prefect.yaml's pull step), where the config's relative paths
resolve as they do for `grpo-pipeline run` started there; each deployment's `config_path` is written so that it
resolves from that folder (relative inside it, absolute outside it: a shipped recipe of a `pip install` lies in
site-packages).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

from grpo_pipeline.configs.files import packaged, recipe, recipes
from grpo_pipeline.configs.schema import ConfigError, DeployConfig, PipelineConfig

PREFECT_YAML = packaged("prefect.yaml", "flows")
FLOW_NAME = "grpo-pipeline"
# prefect.yaml's entrypoints: module paths, which Prefect imports from the installed package whatever folder it runs
# in (a file path, flows/pipeline.py, exists only in a checkout, and only relative to its root)
PIPELINE_ENTRYPOINT = "grpo_pipeline.flows.pipeline.grpo_pipeline"
AB_ENTRYPOINT = "grpo_pipeline.flows.ab.ab_decide"
DAILY, MANUAL, CI = "daily-retrain", "manual", "ci"
AB_FLOW, AB_HOURLY = "ab-decide", "hourly"  # flows/ab.py: the live A/B's decision, on its own schedule
IMAGE_WORKDIR = "/opt/grpo"  # where infra/docker/Dockerfile puts the project
AUTOMATION = "grpo-pipeline-failed"
FAILED_EVENTS = {"prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.TimedOut"}


class DeployError(RuntimeError):
    """Registration failed; the message says where and what to fix."""


def project_path(path: Path | str, root: Path) -> str:
    """The path a worker working in `root` resolves: relative inside `root`, absolute outside it.

    >>> project_path("/srv/team/configs/daily.yaml", Path("/srv/team"))
    'configs/daily.yaml'
    >>> project_path("/etc/grpo/daily.yaml", Path("/srv/team"))
    '/etc/grpo/daily.yaml'
    """
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(resolved)


def render(
    spec: dict[str, Any],
    deploy: DeployConfig,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    pool_type: str = "process",
    budget_usd: float | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """prefect.yaml with the daily schedule, the configuration and the work pool applied.

    Every field of the UI's run form gets a value (an empty `overrides` list; the config's budget, when it
    sets one), so none opens as "Property is type None"; the daily description says its hour and time zone.
    `workdir`: the folder a process worker runs the flows in (`deploy` passes the current one); prefect.yaml's own
    config paths (`configs/NAME`, found as `recipe` finds it: in the current folder, else the shipped recipe) are
    rewritten to resolve from there. An image's runs work in its copy of the project, where they resolve as written.

    >>> spec = yaml.safe_load(PREFECT_YAML.read_text())
    >>> out = render(spec, DeployConfig(schedule_hour=2, timezone="Europe/Berlin"), "my.yaml", ["train.lora.r=8"], budget_usd=40.0)
    >>> daily = next(d for d in out["deployments"] if d["name"] == DAILY)
    >>> daily["schedules"][0]["cron"], daily["schedules"][0]["timezone"], daily["parameters"]
    ('0 2 * * *', 'Europe/Berlin', {'config_path': 'my.yaml', 'overrides': ['train.lora.r=8'], 'budget_usd': 40.0})
    >>> daily["description"].startswith("Daily at 02:00 Europe/Berlin.")
    True
    >>> shipped = render(spec, DeployConfig(), workdir=Path("/srv/team"))["deployments"][0]["parameters"]["config_path"]
    >>> shipped == str(packaged("daily-cpu.yaml"))  # outside the folder the runs work in: absolute
    True
    """
    spec = copy.deepcopy(spec)
    for deployment in spec["deployments"]:
        pool = dict(deployment.get("work_pool") or {})  # YAML anchors share one dict: copy before changing
        pool["name"] = deploy.work_pool
        params = dict(deployment.get("parameters") or {})
        if config_path is not None:
            params["config_path"] = config_path
        elif workdir is not None and pool_type == "process" and params.get("config_path"):
            params["config_path"] = project_path(recipe(Path(params["config_path"])), workdir)
        params["overrides"] = [*params.get("overrides", []), *(overrides or [])]
        if budget_usd is not None and deployment["entrypoint"] == PIPELINE_ENTRYPOINT:  # ab_decide trains nothing
            params.setdefault("budget_usd", budget_usd)
        deployment["parameters"] = params
        if deployment["name"] == DAILY:
            (schedule,) = deployment["schedules"]
            deployment["schedules"] = [
                {**schedule, "cron": f"0 {deploy.schedule_hour} * * *", "timezone": deploy.timezone}
            ]
            # the UI lists a schedule by its cron; the description says when that is, and where
            deployment["description"] = f"Daily at {deploy.schedule_hour:02d}:00 {deploy.timezone}. " + deployment.get(
                "description", ""
            )
        if pool_type != "process":
            if not deploy.image:
                raise ConfigError(
                    f"work pool {deploy.work_pool!r} is a {pool_type} pool: give the image its runs "
                    "use (--image, built from infra/docker/Dockerfile)"
                )
            pool["job_variables"] = {**(pool.get("job_variables") or {}), "image": deploy.image}
        deployment["work_pool"] = pool
    if pool_type != "process":  # the image holds the code; the deploying machine's path means nothing there
        spec["pull"] = [{"prefect.deployments.steps.set_working_directory": {"directory": IMAGE_WORKDIR}}]
    return spec


def check_recipes(names: list[str]) -> None:
    """ConfigError, before anything is registered, when a recipe a trigger may pick (`deploy.trigger.recipes`) is
    no file where the runs work (this folder) nor a shipped recipe (`configs/NAME`, found in the installed package
    as a run finds it: `grpo_pipeline.flows.trigger.run_config`): a run that picked it could never start.

    >>> check_recipes(["configs/demo-cpu.yaml"])
    >>> check_recipes(["configs/nope.yaml"])
    Traceback (most recent call last):
    ...
    grpo_pipeline.configs.schema.ConfigError: deploy.trigger.recipes: configs/nope.yaml is no file in ...
    """
    lost = [name for name in names if not recipe(Path(name)).is_file()]
    if lost:
        shipped = ", ".join(f"configs/{p.name}" for p in recipes())
        raise ConfigError(
            f"deploy.trigger.recipes: {', '.join(lost)} is no file in {Path.cwd()} (where the runs work) nor a "
            f"shipped recipe ({shipped}); fix: give a path that exists there (or an absolute one), or a shipped "
            "recipe's name, and deploy again (nothing was registered)"
        )


def check_server() -> str:
    """The Prefect API URL, once it answers; Prefect's ephemeral mode would register into a throwaway database."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError(
            "PREFECT_API_URL is not set: start a server (`grpo-pipeline stack up`, then "
            '`eval "$(grpo-pipeline stack env)"`, or docker compose up) or point it at yours'
        )

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=10) as response:
            response.read()
    except OSError as exc:
        raise ConfigError(
            f"the Prefect server at PREFECT_API_URL={url} does not answer ({getattr(exc, 'reason', exc)}); "
            "start it (`grpo-pipeline stack up`, or docker compose up) or point PREFECT_API_URL at "
            "a server that runs"
        ) from None
    return url


# Job variables a flow run may override that decide what the worker executes: a process pool's `command` is the
# shell command it runs, `env` can set PYTHONPATH or LD_PRELOAD, `working_dir` picks the code it imports. Anyone
# who may create a flow run (the UI's Custom run, the API, a CI key) could set them, past the trigger policy.
EXECUTING_VARIABLES = ("command", "env", "working_dir")


def locked_template(template: dict[str, Any]) -> dict[str, Any]:
    """A process pool's base job template without the variables that choose what runs: they are fixed to the
    worker's defaults, and the schema refuses any variable it does not list (Prefect checks a flow run's
    job variables against it when the run is created).

    >>> from prefect.workers.process import ProcessWorker
    >>> locked = locked_template(ProcessWorker.get_default_base_job_template())
    >>> sorted(locked["variables"]["properties"]), locked["variables"]["additionalProperties"]
    (['labels', 'name', 'stream_output'], False)
    >>> "{{ command }}" in str(locked["job_configuration"])
    False
    """
    variables = {
        **template["variables"],
        "additionalProperties": False,
        "properties": {k: v for k, v in template["variables"]["properties"].items() if k not in EXECUTING_VARIABLES},
    }
    job = {k: v for k, v in template["job_configuration"].items() if k not in EXECUTING_VARIABLES}
    return {**template, "variables": variables, "job_configuration": job}


def open_variables(template: dict[str, Any]) -> list[str]:
    """Which of the executing variables a pool's template lets a flow run set.

    >>> from prefect.workers.process import ProcessWorker
    >>> open_variables(ProcessWorker.get_default_base_job_template())
    ['command', 'env', 'working_dir']
    """
    exposed = template.get("variables", {}).get("properties", {})
    return [name for name in EXECUTING_VARIABLES if name in exposed]


def ensure_work_pool(name: str) -> tuple[str, list[str]]:
    """The pool's type and the executing variables its runs may still set; a missing pool is created as a
    process pool whose template fixes them (`locked_template`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
            return pool.type, open_variables(pool.base_job_template)
        except ObjectNotFound:
            client.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type="process",
                    base_job_template=locked_template(ProcessWorker.get_default_base_job_template()),
                )
            )
            return "process", []


def register(spec: dict[str, Any], workdir: Path) -> str:
    """Run Prefect's `prefect deploy --all` on the rendered file, in `workdir` (prefect.yaml's build step records it
    as the folder a process worker runs the flows in); returns its output."""
    with tempfile.TemporaryDirectory(prefix="grpo-deploy-") as folder:
        rendered = Path(folder) / "prefect.yaml"
        rendered.write_text(yaml.safe_dump(spec, sort_keys=False))
        proc = subprocess.run(
            # this interpreter's Prefect, by module: an environment's console scripts may lie elsewhere
            [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(rendered)],
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        )
    if proc.returncode != 0:
        raise DeployError(f"`prefect deploy` failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def deployments_summary() -> dict[str, dict]:
    """What the server now holds for each deployment: id, schedule, concurrency, pool, parameters."""
    from prefect.client.orchestration import get_client

    out = {}
    with get_client(sync_client=True) as client:
        for flow_name, name in ((FLOW_NAME, DAILY), (FLOW_NAME, MANUAL), (FLOW_NAME, CI), (AB_FLOW, AB_HOURLY)):
            d = client.read_deployment_by_name(f"{flow_name}/{name}")
            options = d.concurrency_options
            out[name if flow_name == FLOW_NAME else f"{flow_name}/{name}"] = {
                "id": str(d.id),
                "work_pool": d.work_pool_name,
                "schedules": [
                    {
                        "cron": getattr(s.schedule, "cron", None),
                        "timezone": getattr(s.schedule, "timezone", None),
                        "active": s.active,
                    }
                    for s in d.schedules
                ],
                "concurrency_limit": d.global_concurrency_limit.limit if d.global_concurrency_limit else None,
                "collision_strategy": options.collision_strategy.value if options else None,
                "parameters": d.parameters,
            }
    return out


def notification_block(block: str) -> UUID:
    """The id of the notification block `block` ('block-type-slug/name', e.g. 'slack-webhook/grpo-alerts') on the
    server; ConfigError when it is malformed or missing. Read before anything is registered."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    slug, sep, name = block.partition("/")
    if not sep or not slug or not name:
        raise ConfigError(f"notify block {block!r}: expected 'block-type-slug/name', e.g. 'slack-webhook/grpo-alerts'")
    with get_client(sync_client=True) as client:
        try:
            return client.read_block_document_by_name(name=name, block_type_slug=slug).id
        except ObjectNotFound:
            raise ConfigError(
                f"no notification block {block!r} on the Prefect server: create it in the UI "
                f"(Blocks) or with `prefect block create {slug}`, then deploy again (nothing was registered)"
            ) from None


def ensure_failure_automation(block: str, block_id: UUID) -> str:
    """An automation that sends the notification block a message when a pipeline run fails or crashes.

    `block` is 'block-type-slug/name' (e.g. 'slack-webhook/grpo-alerts'), created beforehand in the UI or
    with `prefect block create`: its URL or token is a secret and stays in the block; `block_id` is what
    `notification_block` found for it. Re-running replaces the automation, so `deploy` can be repeated.
    """
    from prefect.automations import Automation, EventTrigger, Posture
    from prefect.events.actions import SendNotification

    try:
        Automation.read(name=AUTOMATION).delete()  # type: ignore[attr-defined]  # sync_compatible: a coroutine only in async code
    except ValueError:  # none yet
        pass
    automation = Automation(
        name=AUTOMATION,
        description=f"Tell {block} when a {FLOW_NAME} or {AB_FLOW} flow run fails, crashes or times out.",
        trigger=EventTrigger(
            expect=FAILED_EVENTS,
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": [FLOW_NAME, AB_FLOW]},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            SendNotification(
                block_document_id=block_id,
                subject="GRPO pipeline: {{ flow_run.name }} {{ flow_run.state.name }}",
                body=(
                    "Flow run {{ flow_run.name }} ({{ deployment.name }}) ended {{ flow_run.state.name }}: "
                    "{{ flow_run.state.message }}\n{{ flow_run|ui_url }}"
                ),
            )
        ],
    ).create()
    return str(automation.id)  # type: ignore[union-attr]  # sync_compatible, as above


def settings_for(cfg: PipelineConfig, **options: Any) -> DeployConfig:
    """The config's `deploy` section with the options that were given (not None) over it; a bad value raises
    pydantic's ValidationError, which names the field."""
    given = {k: v for k, v in options.items() if v is not None}
    return DeployConfig.model_validate(cfg.deploy.model_dump() | given)


def _unshown(doing: str, done: str) -> AbstractContextManager[None]:
    return nullcontext()


def deploy(
    cfg: PipelineConfig,
    settings: DeployConfig,
    config_path: Path | None,
    overrides: list[str],
    step: Callable[[str, str], AbstractContextManager[None]] = _unshown,
) -> dict[str, Any]:
    """Register the daily-retrain, manual, ci and ab-decide/hourly deployments on the Prefect server PREFECT_API_URL names, and
    the failure automation when `settings.notify_block` is set; returns what the server now holds.

    Raises ConfigError for what the user fixes (no server, no such notification block, an image pool without an
    image), before anything is created or registered, and DeployError when Prefect's own `prefect deploy` fails.
    The runs of a process pool work in the current folder (`render`). `step(doing, done)` wraps each step (the
    command's progress lines: `grpo_pipeline.progress`)."""
    workdir = Path.cwd()
    check_recipes(cfg.deploy.trigger.recipes)
    with step("asking the Prefect server", "Prefect server answered"):
        server = check_server()
        block_id = notification_block(settings.notify_block) if settings.notify_block else None
    with step(f"work pool {settings.work_pool}", f"work pool {settings.work_pool} ready"):
        pool_type, open_to_runs = ensure_work_pool(settings.work_pool)
    spec = render(
        yaml.safe_load(PREFECT_YAML.read_text()),
        settings,
        project_path(config_path, workdir) if config_path else None,
        overrides,
        pool_type,
        budget_usd=cfg.plan.budget_usd,
        workdir=workdir,
    )
    with step(f"registering the deployments on {server} (prefect deploy)", "deployments registered"):
        register(spec, workdir)
    summary: dict[str, Any] = {
        "deployments": deployments_summary(),
        "work_pool": {
            "name": settings.work_pool,
            "type": pool_type,
            # a pool made elsewhere may let a run choose what executes
            "run_may_set": open_to_runs,
        },
        # what a run started through them may set (docs/security.md)
        "trigger_policy": cfg.deploy.trigger.model_dump(),
    }
    if settings.notify_block and block_id is not None:
        with step(f"failure automation to {settings.notify_block}", "failure automation set"):
            automation = ensure_failure_automation(settings.notify_block, block_id)
        summary["failure_automation"] = {"id": automation, "block": settings.notify_block}
    return summary
