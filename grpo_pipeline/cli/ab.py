"""`grpo-pipeline ab`: the live A/B between the registry's `champion` and `challenger`, read from the request log.

    grpo-pipeline ab status [--json]     # per-arm requests, errors, feedback; the estimate and its interval
    grpo-pipeline ab decide [--json]     # the online decision; promote / rollback move the aliases

The log is `$GRPO_AB_LOG_URL` (SQLAlchemy URL: PostgreSQL when the stack runs), else SQLite under data_dir.
`decide` calls `grpo_pipeline.tasks.serve.ab.decide` on the requests the current champion and challenger versions answered, and
for promote or rollback moves the aliases under the registry lock, after checking they did not move since.
Exit codes: 0 decided or shown (whatever the action: `continue` is a normal answer); 1 an unexpected failure;
2 bad configuration, the log store or the registry unreachable, the aliases moved meanwhile, or (`decide`) no
registry yet. Before the first run neither creates the registry, and `status` creates no request log either: it
shows no champion and no requests, and says why on stderr (exit 0, as `registry` does where nothing ran).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from grpo_pipeline.failure import EXIT_CONFIG, err
from grpo_pipeline.failure import fail as _fail  # the CLI's one way to fail
from grpo_pipeline.loading import ConfigOpt, load
from grpo_pipeline.registry_store import absent_file, missing, mlflow_warnings_only

if TYPE_CHECKING:
    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.tasks.promote.registry import Registry
    from grpo_pipeline.tasks.serve.ab_log import RequestLog

JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override, e.g. --set ab.alpha=0.01 (repeatable)")]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="The live A/B: `ab status` shows it, `ab decide` decides it (sequential test, guardrails).",
)


def _config(config: Path | None, overrides: list[str] | None, as_json: bool) -> PipelineConfig:
    """The configuration, or the failure naming the file or the --set to blame (exit 2)."""
    _, cfg = load(config, overrides, as_json)
    mlflow_warnings_only()
    return cfg


def _log(cfg: PipelineConfig, as_json: bool) -> RequestLog:
    """The request log, or the failure naming its store (exit 2)."""
    from grpo_pipeline.tasks.serve.ab_log import LogStoreError, RequestLog, log_url

    try:
        return RequestLog.open(log_url(cfg.data_dir))
    except LogStoreError as exc:
        _fail(as_json, str(exc), EXIT_CONFIG)


def _registry(cfg: PipelineConfig, as_json: bool) -> tuple[Registry, str | None, str | None]:
    """(registry, champion version, challenger version), or the failure naming the registry (exit 2)."""
    from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION, Registry, RegistryServiceError
    from grpo_pipeline.tasks.promote.registry_client import open_client

    registry = Registry(open_client(cfg.mlflow_uri), cfg.tracking.registered_model)
    unreachable: tuple[type[BaseException], ...] = (RegistryServiceError, *registry.errors)
    try:
        aliases = registry.aliases()
    except unreachable as exc:
        _fail(
            as_json,
            f"the registry {cfg.tracking.registered_model} at {cfg.mlflow_uri} did not answer: {exc}",
            EXIT_CONFIG,
        )
    return registry, aliases[CHAMPION], aliases[CHALLENGER]


def _print(obj: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj, default=str))
        return
    for key, value in obj.items():
        print(f"{key}: {json.dumps(value, default=str) if isinstance(value, (dict, list)) else value}")


@app.command()
def status(config: ConfigOpt = None, overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Per-arm counts of the whole log, and for the running test (the current champion and challenger
    versions) the estimate of the difference and its always-valid interval."""
    from grpo_pipeline.tasks.serve.ab import decide
    from grpo_pipeline.tasks.serve.ab_log import log_url
    from grpo_pipeline.tasks.serve.ab_spool import pending, spool_path

    cfg = _config(config, overrides, as_json)
    # A read creates no store: where the request log's SQLite file does not exist yet, nothing was served
    if (never := absent_file(log_url(cfg.data_dir))) is not None:
        err.print(
            f"no A/B yet: no request log at {never} (`grpo-pipeline serve` writes it as it answers)",
            markup=False,
            highlight=False,
        )
    log = None if never is not None else _log(cfg, as_json)
    if nothing := missing(cfg.mlflow_uri):  # nor a registry: it finds no champion and says why
        err.print(nothing, markup=False, highlight=False)
        champion = challenger = None
    else:
        _, champion, challenger = _registry(cfg, as_json)
    # "unlogged": requests a router answered while the store was unreachable, waiting in its local file;
    # "engine_restarts": the routers' restarts of a dead or hung engine (their 503s are in no arm's counts)
    out = {
        "status": "ok",
        "champion": champion,
        "challenger": challenger,
        "challenger_fraction": cfg.ab.challenger_fraction,
        "log": log.counts() if log is not None else {},
        "unlogged": pending(spool_path(cfg.data_dir)),
        "engine_restarts": log.restarts() if log is not None else {"count": 0, "last": None},
    }
    if log is not None and champion and challenger:
        a, b, hours = log.samples(champion, challenger)
        decision = decide(a, b, cfg.ab, hours)
        out |= {
            "arms": {k: v.model_dump() for k, v in decision.arms.items()},
            "test": decision.test.model_dump(),
            "elapsed_h": hours,
        }
    if log is not None:
        log.close()
    _print(out, as_json)


@app.command("decide")
def decide_cmd(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="decide, move no alias")] = False,
) -> None:
    """Decide the running test; promote or rollback move the aliases (under the registry lock). The same two
    steps as the hourly `ab-decide` flow (grpo_pipeline.tasks.serve.ab_apply)."""
    from grpo_pipeline.tasks.promote.registry import RegistryError, RegistryServiceError
    from grpo_pipeline.tasks.serve.ab import AliasesMoved
    from grpo_pipeline.tasks.serve.ab_apply import decide_round, settle_round

    cfg = _config(config, overrides, as_json)
    if nothing := missing(cfg.mlflow_uri):  # no champion or challenger to decide between, and none to create
        _fail(as_json, nothing, EXIT_CONFIG)
    log = _log(cfg, as_json)
    registry, _, _ = _registry(cfg, as_json)
    try:
        found = decide_round(cfg.ab, log, registry, cfg.promote.mode == "canary")
    finally:
        log.close()
    if not dry_run:
        try:
            found = settle_round(registry, found)
        except (AliasesMoved, RegistryError, RegistryServiceError) as exc:
            _fail(as_json, str(exc), EXIT_CONFIG, decision=found.decided()[0].model_dump(mode="json"))
    _print(found.as_json(), as_json)
