"""`grpo-pipeline stack up|env|status|down`: the local service stack (grpo_pipeline.infra.stack) from the shell. `up`
and `down` show each service as they start or stop it, on stderr only: stdout carries the exports that
`eval "$(grpo-pipeline stack up)"` reads."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from grpo_pipeline.failure import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, err
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.infra.services import STALL_S, START_CEILING_S
from grpo_pipeline.infra.stack import DEFAULT_PORTS, DEFAULT_ROOT  # light: the service helpers, no clients
from grpo_pipeline.loading import load
from grpo_pipeline.progress import Steps, progress

if TYPE_CHECKING:
    from grpo_pipeline.infra.stack import ServeOptions, Stack, Step

app = typer.Typer(no_args_is_help=True, help="Local PostgreSQL, S3, MLflow and Prefect servers (no Docker needed).")


RootOpt = Annotated[Path, typer.Option("--dir", help="where the stack keeps its data and state")]


def _stack(root: Path, start_timeout_s: float = START_CEILING_S, **ports: int | None) -> Stack:
    """The stack recorded under `root`; an unreadable state file is an input error, named with its fix."""
    from grpo_pipeline.infra.services import ServiceError
    from grpo_pipeline.infra.stack import Stack

    try:
        return Stack(root, ports=ports, start_timeout_s=start_timeout_s)
    except ServiceError as exc:
        _fail(False, str(exc), EXIT_CONFIG)


@app.command("up")
def stack_up(
    root: RootOpt = DEFAULT_ROOT,
    s3_port: Annotated[int | None, typer.Option(help=f"S3 API port (default {DEFAULT_PORTS['s3']})")] = None,
    mlflow_port: Annotated[int | None, typer.Option(help=f"MLflow port (default {DEFAULT_PORTS['mlflow']})")] = None,
    prefect_port: Annotated[int | None, typer.Option(help=f"Prefect port (default {DEFAULT_PORTS['prefect']})")] = None,
    serve: Annotated[
        bool, typer.Option("--serve", help="also start `grpo-pipeline serve` (the router and its vLLM engine)")
    ] = False,
    serve_config: Annotated[Path | None, typer.Option(help="the pipeline config the router serves")] = None,
    serve_port: Annotated[int | None, typer.Option(help=f"router port (default {DEFAULT_PORTS['serve']})")] = None,
    start_timeout: Annotated[
        float,
        typer.Option(
            min=1,
            help=f"seconds each server may take to start while it makes progress; one whose log and CPU time stand "
            f"still for {STALL_S:.0f} s is given up sooner",
        ),
    ] = START_CEILING_S,
) -> None:
    """Start the services that are not running. Into a pipe (`eval "$(grpo-pipeline stack up)"`) it prints the
    environment exports; to a terminal only where things are, so the stack's credentials (S3 key, MLflow
    password, Prefect auth string) never land on screen or in a terminal log (`stack env` prints the exports
    for `eval`). `--serve` also starts the router once the registry has a champion (its key: GRPO_SERVE_API_KEY
    in `stack env`)."""
    from grpo_pipeline.infra.services import Refused, ServiceError
    from grpo_pipeline.infra.stack import DEFAULT_UP, exports

    stack = _stack(root, start_timeout, s3=s3_port, mlflow=mlflow_port, prefect=prefect_port, serve=serve_port)
    options = _serve_options(serve_config) if serve else None
    try:
        with progress() as step:
            stack.up(
                [*DEFAULT_UP, "serve"] if serve else DEFAULT_UP, serve=options, step=_shown(step, "starting", "started")
            )
    except Refused as exc:  # a taken port, a missing tool, no champion yet: exit 2, naming the fix
        _fail(False, f"stack up: {exc}", EXIT_CONFIG)
    except ServiceError as exc:  # a service did not start (what this `up` started is stopped): its log named
        _fail(False, f"stack up failed: {exc}", EXIT_FAILED)
    env = stack.env()
    # stdout carries only the exports, so `eval "$(...)"` works; where things are goes to stderr
    err.print(where_things_are(env, stack.bucket, root, serve), markup=False, highlight=False)
    if not sys.stdout.isatty():
        print(exports(env))


def where_things_are(env: dict[str, str], bucket: str, root: Path, serve: bool) -> str:
    """What `stack up` says on stderr: each UI and API, and how to log in. Both UIs ask for a login: the lines say
    where the credentials are, never what they are (a terminal's scrollback is no place for them). Prefect's UI
    has one password field that takes the whole auth string, user:password.

    >>> env = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000", "MLFLOW_TRACKING_USERNAME": "admin",
    ...        "PREFECT_API_URL": "http://127.0.0.1:4200/api", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000"}
    >>> print(where_things_are(env, "grpo", Path(".grpo/stack"), False))  # doctest: +NORMALIZE_WHITESPACE
    MLflow UI:  http://127.0.0.1:5000  log in as admin, password: MLFLOW_TRACKING_PASSWORD from `grpo-pipeline stack env`
    Prefect UI: http://127.0.0.1:4200  password: the whole PREFECT_API_AUTH_STRING (grpo:...) from `grpo-pipeline stack env`
    S3 API:     http://127.0.0.1:9000  (bucket 'grpo')
    Use it from a shell with:  eval "$(grpo-pipeline stack env)"
    """
    env_cmd = "grpo-pipeline stack env" if root == DEFAULT_ROOT else f"grpo-pipeline stack env --dir {root}"
    lines = [
        f"MLflow UI:  {env['MLFLOW_TRACKING_URI']}  log in as {env['MLFLOW_TRACKING_USERNAME']}, password: "
        f"MLFLOW_TRACKING_PASSWORD from `{env_cmd}`",
        f"Prefect UI: {env['PREFECT_API_URL'].removesuffix('/api')}  password: the whole PREFECT_API_AUTH_STRING "
        f"(grpo:...) from `{env_cmd}`",
        f"S3 API:     {env['AWS_ENDPOINT_URL_S3']}  (bucket '{bucket}')",
    ]
    if serve:
        lines.append(f"Router:     {env['GRPO_SERVE_URL']}  key: GRPO_SERVE_API_KEY from `{env_cmd}`")
    lines.append(f'Use it from a shell with:  eval "$({env_cmd})"')
    return "\n".join(lines)


def _serve_options(config: Path | None) -> ServeOptions:
    """The router's options, checked before anything starts: the config loads, the engine's Python exists."""
    from grpo_pipeline.infra.stack import ServeOptions
    from grpo_pipeline.tasks.serve.engine import NoEnginePython, engine_python

    path, cfg = load(config, [])
    try:
        python = engine_python(cfg.ab.serve.engine_python, Path.cwd())
    except NoEnginePython as exc:
        _fail(False, f"stack up --serve: {exc}", EXIT_CONFIG)
    # Absolute, as the router runs in the stack's folder; the config as `_load` found it (a shipped recipe's
    # name too). The Python's symlinks are kept: a venv's python links to the base interpreter, and resolving
    # it would run vLLM outside the venv that holds it.
    return ServeOptions(
        str(path.resolve()) if config else None, os.path.abspath(python), cfg.ab.serve.startup_timeout_s
    )


def _shown(step: Steps, doing: str, done: str) -> Step:
    """The stack's step for each service, by the service's title: "starting PostgreSQL ...", "PostgreSQL started"."""
    from grpo_pipeline.infra.stack import TITLES

    return lambda name: step(f"{doing} {TITLES[name]}", f"{TITLES[name]} {done}")


@app.command("env")
def stack_env(root: RootOpt = DEFAULT_ROOT) -> None:
    """Print the environment exports of the running stack: URLs and the credentials its servers ask for.
    Exit 2 when none of its services runs, so `eval "$(grpo-pipeline stack env)"` does not silently set nothing."""
    from grpo_pipeline.infra.stack import exports

    stack = _stack(root)
    if not stack.running():
        where = "" if root == DEFAULT_ROOT else f" --dir {root}"
        _fail(False, f"no stack runs under {stack.root}: start one with `grpo-pipeline stack up{where}`", EXIT_CONFIG)
    print(exports(stack.env()))


@app.command("status")
def stack_status(
    root: RootOpt = DEFAULT_ROOT,
    as_json: Annotated[bool, typer.Option("--json", help="the report as JSON (the UIs' URLs included)")] = False,
) -> None:
    """Each service's health, the UIs' addresses, and the router's own state (up, starting, restarting, stopped)
    with its restarts; exit 1 when any is not healthy."""
    report = _stack(root).status()
    print(json.dumps(report, indent=2) if as_json else status_table(report))
    raise typer.Exit(EXIT_OK if all(s["healthy"] for s in report.values()) else EXIT_FAILED)


def status_table(report: dict[str, dict]) -> str:
    """`stack status` for a person: a line per service, its state and where it is.

    >>> print(status_table({
    ...     "mlflow": {"healthy": True, "running": True, "url": "http://127.0.0.1:5000", "ui": "http://127.0.0.1:5000",
    ...                "login": "user ..."},
    ...     "serve": {"healthy": False, "running": True, "url": "http://127.0.0.1:8000", "state": "restarting",
    ...               "restarts": 1, "engine": "up", "engine_restarts": 0},
    ... }))
    MLflow         healthy       UI http://127.0.0.1:5000  log in: user ...
    the router     restarting    http://127.0.0.1:8000, restarted 1 time by supervisord, engine up (0 engine restarts)
    """
    from grpo_pipeline.infra.stack import TITLES

    lines = []
    for name, s in report.items():
        if name == "serve":
            state = s["state"]
            where = f"{s['url']}, restarted {s['restarts'] if s['restarts'] is not None else '?'} time" + (
                "s" if s["restarts"] != 1 else ""
            )
            where += " by supervisord"
            if s.get("engine"):
                where += f", engine {s['engine']} ({s['engine_restarts']} engine restarts)"
            if s.get("reason"):
                where += f": {s['reason']}"
        else:
            state = "healthy" if s["healthy"] else ("not answering" if s["running"] else "stopped")
            where = f"UI {s['ui']}  log in: {s['login']}" if s.get("ui") else (s["url"] or "")
            if name == "postgres" and s["url"]:
                where = "Unix socket"
        lines.append(f"{TITLES[name]:<14} {state:<13} {where}")
    return "\n".join(lines)


@app.command("down")
def stack_down(root: RootOpt = DEFAULT_ROOT) -> None:
    """Stop the services (Prefect and MLflow first, PostgreSQL last); the data stays."""
    with progress() as step:
        stopped = _stack(root).down(step=_shown(step, "stopping", "stopped"))
    if not stopped:
        err.print("nothing was running", highlight=False)
