"""`grpo-pipeline serve`: the registry's champion and challenger behind one OpenAI-compatible endpoint
(grpo_pipeline.tasks.serve.router), with the command's checks and exit codes."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.failure import EXIT_CONFIG, EXIT_FAILED
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.loading import ConfigOpt, SetOpt, load


def serve(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    host: Annotated[
        str, typer.Option("--host", help="address to listen on; not loopback: GRPO_SERVE_API_KEY is required")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="port to listen on")] = 8000,
) -> None:
    """Serve the registry's champion and challenger behind one OpenAI-compatible endpoint (/v1/chat/completions,
    /v1/completions, /v1/models, /v1/feedback): one vLLM engine, the live A/B split, every request logged.
    Exit 2: no registry yet, no engine Python (`make serve-env`), no API key off loopback, the log store or the
    registry unreachable, no champion; 1: the engine did not start (its log's tail is shown)."""
    from grpo_pipeline.registry_store import missing, mlflow_warnings_only
    from grpo_pipeline.tasks.serve.ab_log import LogStoreError, RequestLog, log_url
    from grpo_pipeline.tasks.serve.adapters import AdapterError
    from grpo_pipeline.tasks.serve.engine import EngineError, NoEnginePython, engine_python
    from grpo_pipeline.tasks.serve.router import ServeSetupError, api_key_policy
    from grpo_pipeline.tasks.serve.router import serve as run_router

    _, cfg = load(config, overrides)
    from grpo_pipeline.tasks.data.shape import task_rewards

    try:
        cfg = task_rewards(cfg)  # `auto`: the skill reward the task's answers chose, which scores `reference` feedback
    except ConfigError as exc:
        _fail(False, str(exc), EXIT_CONFIG)
    # What needs no download, before anything is opened: in a folder where nothing ran, MLflow would create an
    # empty store there (and say so at INFO) and the request log its file, for a serve that cannot start.
    if nothing := missing(cfg.mlflow_uri):
        _fail(False, nothing, EXIT_CONFIG)
    mlflow_warnings_only()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a server's log, not a terminal
    try:
        python = engine_python(cfg.ab.serve.engine_python, Path.cwd())
        api_key = api_key_policy(dict(os.environ), host)
        request_log = RequestLog.open(log_url(cfg.data_dir))
    except (NoEnginePython, ValueError, LogStoreError) as exc:
        _fail(False, str(exc), EXIT_CONFIG)
    try:
        run_router(cfg, host, port, api_key, request_log, python)
    except (ServeSetupError, AdapterError) as exc:
        _fail(False, str(exc), EXIT_CONFIG)
    except EngineError as exc:
        _fail(False, str(exc), EXIT_FAILED)
    finally:
        request_log.close()
