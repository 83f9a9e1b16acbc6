"""`grpo-pipeline deploy`: the command over grpo_pipeline.flows.deploy (its options, its one way of failing); stdout
carries the JSON of what the Prefect server holds, and so a failure's object too."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from grpo_pipeline.configs.files import recipe
from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.failure import EXIT_CONFIG, EXIT_FAILED, err, options_error
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.loading import load_path
from grpo_pipeline.progress import progress


def deploy_cmd(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="pipeline YAML the deployments run; default: prefect.yaml's")
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="override for the runs and the deploy section (repeatable)")
    ] = None,
    schedule_hour: Annotated[
        int | None, typer.Option(help="hour of the daily run, 0-23 (default: deploy.schedule_hour, 3)")
    ] = None,
    timezone: Annotated[
        str | None, typer.Option(help="IANA time zone of the daily run (default: deploy.timezone, UTC)")
    ] = None,
    pool: Annotated[
        str | None, typer.Option("--pool", help="work pool (default: deploy.work_pool, grpo-process)")
    ] = None,
    image: Annotated[str | None, typer.Option(help="image for a Docker or Kubernetes pool")] = None,
    notify_block: Annotated[str | None, typer.Option(help="notification block 'type/name' told of failed runs")] = None,
) -> None:
    """Register the daily-retrain, manual, ci and ab-decide/hourly deployments on the Prefect server
    (PREFECT_API_URL); print what the server holds as JSON (a failure: the failure object, as with --json elsewhere)."""
    from grpo_pipeline.flows.deploy import DeployError, deploy, settings_for

    as_json = True  # stdout carries the JSON summary, so it carries the failure object too
    overrides = list(overrides or [])
    path = recipe(config) if config else None
    cfg = load_path(path, overrides, as_json)
    try:
        settings = settings_for(
            cfg, schedule_hour=schedule_hour, timezone=timezone, work_pool=pool, image=image, notify_block=notify_block
        )
    except ValidationError as exc:
        _fail(as_json, options_error(exc, DEPLOY_FLAGS), EXIT_CONFIG)
    try:
        with progress() as step:  # on stderr: stdout carries the JSON
            summary = deploy(cfg, settings, path, overrides, step)
    except ConfigError as exc:  # no server, no such notification block
        _fail(as_json, str(exc), EXIT_CONFIG)
    except DeployError as exc:
        _fail(as_json, str(exc), EXIT_FAILED)
    except Exception as exc:  # a fault talking to Prefect, not of the input: the traceback too
        traceback.print_exc()
        _fail(as_json, f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    if not settings.notify_block:
        err.print("no notify block: failed runs notify no one (see README, Operations, to add one)", highlight=False)
    print(json.dumps(summary, indent=2))
    err.print(f"start a worker to run them:  prefect worker start --pool {settings.work_pool}", highlight=False)


DEPLOY_FLAGS = {
    "schedule_hour": "--schedule-hour",
    "timezone": "--timezone",
    "work_pool": "--pool",
    "image": "--image",
    "notify_block": "--notify-block",
}  # deploy section field -> its option
