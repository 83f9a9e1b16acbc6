"""`grpo-pipeline`: run the pipeline, show the resolved configuration.

Exit codes (for CI): 0 completed; 1 the pipeline failed; 2 the configuration or an input is invalid
(unknown key, wrong type, missing model, unreachable or unwritable checkpoint store, no SkyPilot cloud);
3 the candidate was not promoted and --fail-on-reject was given; 4 the champion moved while the run was
deciding (another run promoted first): nothing was moved, run again.

Every command (`stack`, `deploy` and `rewards` included) fails the same way (`_fail`, grpo_pipeline/failure.py):
one paragraph on stderr that names the field or resource, what was found and the fix, and with --json (and
from `deploy`, whose stdout is JSON) the failure object {"status": "failed", "error", "exit_code"} as the last
line of stdout. `run` and `hpo` run the preflight checks before the flow starts, so a refused input leaves no
failed flow run behind; `stack up` checks its ports before it starts anything.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from grpo_pipeline.configs.files import recipe
from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.failure import (
    EXIT_CHAMPION_MOVED,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REJECTED,
    Commands,
    err,
    options_error,
)
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.loading import load, load_path
from grpo_pipeline.registry_store import missing, quiet_mlflow

if TYPE_CHECKING:  # the stages' types, for annotations only: importing them here would load the training stack
    from collections.abc import Callable, Iterator

    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.infra.stack import ServeOptions, Stack, Step
    from grpo_pipeline.tasks.data.stage import DataReport, DatasetVersion
    from grpo_pipeline.tasks.plan import Plan
    from grpo_pipeline.tasks.promote.registry import AliasMove, Registry
    from grpo_pipeline.tasks.summary import RunSummary

app = typer.Typer(
    cls=Commands,
    add_completion=False,
    no_args_is_help=True,
    help="GRPO fine-tuning pipeline.",
    context_settings={"help_option_names": ["-h", "--help"]},  # the sub-commands' contexts inherit it
)


def _print_version(asked: bool) -> None:
    if asked:
        print(f"grpo-pipeline {importlib.metadata.version('grpo-pipeline')}")  # the installed distribution's
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    # only the options above: every command is a sub-command
    ...


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="pipeline YAML; default: configs/demo-cpu.yaml")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="override, e.g. --set train.grpo.max_steps=20 (repeatable)")
]


def _ephemeral_prefect_defaults() -> None:
    """Settings for Prefect's ephemeral server (no PREFECT_API_URL), where the user has not chosen them.
    It records a telemetry session at start-up, which races its own SQLite writer ("database is locked") on a
    fresh PREFECT_HOME; the pipeline needs no telemetry. And it must answer within 20 s by default, which a
    busy 2-core machine misses (the server imports and migrates its database first): the run then dies with
    "Timed out while attempting to connect to ephemeral Prefect API server" before any work."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def _input_errors() -> tuple[type[BaseException], ...]:
    """What bad configuration or input raises, wherever it is caught: exit 2. Imported only when needed."""
    from grpo_pipeline.infra.launch.skypilot import SkyPreflightError
    from grpo_pipeline.tasks.model import ModelNotFound
    from grpo_pipeline.trainer.checkpoints import CheckpointStoreError

    return ConfigError, ModelNotFound, CheckpointStoreError, SkyPreflightError  # budget, quantization: ConfigError


def _preflight_or_exit(cfg: PipelineConfig, as_json: bool) -> Plan | None:
    """The flows' own first checks, run before a flow run exists: a refused input leaves no Failed run on
    the Prefect server (whose notification would fire) and no engine traceback before the one useful line.
    Returns what they return (the plan the budget was priced with), for the flow, which does not check again."""
    from grpo_pipeline.flows.preflight import preflight

    try:
        return preflight(cfg)
    except _input_errors() as exc:
        _fail(as_json, str(exc), EXIT_CONFIG)
    except Exception as exc:  # a fault of a check, not of the input: the traceback too, and still the JSON
        traceback.print_exc()
        _fail(as_json, f"preflight: {type(exc).__name__}: {exc}", EXIT_FAILED)


@app.command()
def run(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a machine-readable summary on stdout")] = False,
    fail_on_reject: Annotated[bool, typer.Option(help="exit 3 when the candidate is not promoted")] = False,
) -> None:
    """Run the pipeline (the CPU demo by default), print base and trained holdout reward and the decision."""
    path, cfg = load(config, overrides, as_json)
    _ephemeral_prefect_defaults()
    priced = _preflight_or_exit(cfg, as_json)
    # heavy imports only once the config is known to be good
    from grpo_pipeline.flows.pipeline import checked_pipeline
    from grpo_pipeline.tasks.promote.registry import ChampionMoved

    try:
        summary = checked_pipeline(cfg, priced, str(path), list(overrides or []))  # loaded and checked once, here
    except _input_errors() as exc:  # found during the run (e.g. the data stage's quality bound)
        _fail(as_json, str(exc), EXIT_CONFIG)
    except ChampionMoved as exc:
        _fail(as_json, str(exc), EXIT_CHAMPION_MOVED)
    except Exception as exc:  # the flow's own log has the traceback
        _fail(as_json, f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    # a skipped run (data.skip_unchanged: nothing new since the champion) rejected nothing: exit 0
    code = EXIT_REJECTED if fail_on_reject and summary.decision and not summary.decision.promote else EXIT_OK
    if as_json:
        print(summary.model_dump_json(indent=2))
        raise typer.Exit(code)
    if summary.status == "skipped":
        Console().print(f"[yellow]skipped[/]: {summary.skipped_reason}")
        raise typer.Exit(code)
    _print_summary(summary)
    raise typer.Exit(code)


def _print_summary(summary: RunSummary) -> None:
    """The holdout table (base, the champion when there was one, the candidate), the decision, the serving
    check, and the aliases as a table."""
    from grpo_pipeline.tasks.report import verdict

    holdout, decision, registry = summary.holdout, summary.decision, summary.registry
    assert holdout and decision and registry, "a completed run (not skipped) evaluated, decided and registered"
    columns: dict[str, tuple[float | None, dict[str, float]]] = {"base": (holdout.base_reward, holdout.base)}
    if holdout.champion is not None:
        columns[f"champion (v{registry.decided_against})"] = (holdout.champion_reward, holdout.champion)
    columns["candidate"] = (holdout.trained_reward, holdout.trained)
    table = Table(title=f"holdout ({holdout.n} prompts, greedy)")
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    table.add_row("reward (sum)", *(f"{total:.3f}" for total, _ in columns.values()))
    for name in holdout.trained:
        table.add_row(name, *(f"{values[name]:.3f}" for _, values in columns.values()))
    out = Console()
    out.print(table)
    out.print(
        ("[green]" if decision.promote else "[yellow]")
        + verdict(decision, registry)
        + f"[/]: version {registry.candidate_version} of {registry.model}"
    )
    for reason in decision.reasons:
        out.print(f"  - {reason}")
    check = registry.serving_check
    out.print(
        ("[green]served" if check.passed else "[red]serving check failed")
        + f"[/]: {check.reason()} in {check.seconds:.0f} s"
    )
    moved = {(m.model, m.alias): m.before for m in registry.moves}
    aliases = Table(title="aliases")
    for column in ("model", "alias", "version", "before this run"):
        aliases.add_column(column)
    models = [(registry.model, registry.aliases)]
    if registry.merged_model and registry.merged_aliases is not None:
        models.append((registry.merged_model, registry.merged_aliases))
    for model, pointers in models:
        for alias, version in pointers.items():
            aliases.add_row(model, alias, version or "-", moved.get((model, alias), version) or "-")
    out.print(aliases)
    out.print(
        f'load: mlflow.pyfunc.load_model("models:/{registry.model}/{registry.candidate_version}")'
        f"   base: {registry.base_model}   MLflow run: {summary.mlflow.run_id}"
    )


def _registry(cfg: PipelineConfig) -> Registry:
    """The registry the configuration names; against an MLflow server, through plain REST calls (a lookup
    answers without importing MLflow or the training stack)."""
    from grpo_pipeline.tasks.promote.registry import Registry, open_client

    quiet_mlflow()
    return Registry(open_client(cfg.mlflow_uri), cfg.tracking.registered_model)


def _existing_registry(config: Path | None, overrides: list[str] | None) -> Registry:
    """The registry for a command that moves aliases: refused (exit 2) where none exists yet, not created."""
    _, cfg = load(config, overrides)
    if nothing := missing(cfg.mlflow_uri):
        _fail(False, nothing, EXIT_CONFIG)
    return _registry(cfg)


def _registry_call(registry: Registry, action: Callable[[], list[AliasMove]]) -> None:
    """Run an alias-moving command; print every alias it moved (on both registered models), with what each
    pointed at before."""
    from grpo_pipeline.tasks.promote.registry import RegistryError, RegistryServiceError

    refused: tuple[type[BaseException], ...] = (RegistryError, RegistryServiceError, *registry.errors)
    try:
        moves = action()
    except refused as exc:  # an unreachable server: at once, by URL
        _fail(False, str(exc), EXIT_CONFIG)
    for move in moves:
        print(move.describe())
    if not moves:
        print("no alias moved")


ReasonOpt = Annotated[str, typer.Option("--reason", help="why: recorded on the model version")]


@app.command()
def rollback(reason: ReasonOpt, config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Make the previous champion the champion again (a second rollback undoes the first)."""
    registry = _existing_registry(config, overrides)
    _registry_call(registry, lambda: registry.rollback(reason))


@app.command()
def promote(
    version: Annotated[str, typer.Option("--version", help="model version to make champion")],
    reason: ReasonOpt,
    force: Annotated[bool, typer.Option("--force", help="required: this skips the A/B decision")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
) -> None:
    """An operator's promotion without an A/B decision: the version becomes champion, the champion it replaces
    previous-champion; nothing else moves. Records who and why (forced_by, forced_reason) beside the version's
    own decision tag."""
    if not force:
        _fail(False, "promote skips the A/B decision; pass --force to confirm", EXIT_CONFIG)
    registry = _existing_registry(config, overrides)
    _registry_call(registry, lambda: registry.force(version, reason))


@app.command()
def registry(config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Print which model versions the aliases point at, as JSON. Where no registry exists yet (the embedded
    default before the first run), every alias is null, stderr says so, and nothing is created: exit 0."""
    _, cfg = load(config, overrides)
    if nothing := missing(cfg.mlflow_uri):
        from grpo_pipeline.tasks.promote.registry import ALIASES

        err.print(nothing, markup=False, highlight=False)
        print(json.dumps(dict.fromkeys(ALIASES)))
        return
    registry = _registry(cfg)
    try:
        print(json.dumps(registry.aliases()))
    except registry.errors as exc:  # e.g. the server does not answer
        _fail(False, str(exc), EXIT_CONFIG)


@app.command()
def hpo(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    trials: Annotated[int | None, typer.Option("--trials", min=1, help="the study's budget (hpo.trials)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")] = False,
) -> None:
    """Search hyperparameters alone (no training): print the best as --set overrides for `run`."""
    extra = [*(overrides or []), "hpo.enabled=true", *([f"hpo.trials={trials}"] if trials else [])]
    path, cfg = load(config, extra, as_json)
    _ephemeral_prefect_defaults()
    _preflight_or_exit(cfg, as_json)
    from grpo_pipeline.flows.hpo import checked_hpo
    from grpo_pipeline.tasks.hpo import HPOFailed

    try:
        result = checked_hpo(cfg, str(path), extra)  # loaded and checked once, here
    except _input_errors() as exc:
        _fail(as_json, str(exc), EXIT_CONFIG)
    except HPOFailed as exc:
        _fail(as_json, str(exc), EXIT_FAILED)
    except Exception as exc:  # the flow's own log has the traceback
        _fail(as_json, f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    if as_json:
        print(json.dumps({"status": "completed", **result}, indent=2))
        raise typer.Exit(EXIT_OK)
    table = Table(title=f"study {result['study_name']} ({result['storage']})")
    for column in ("trial", "state", "value", "parameters"):
        table.add_column(column)
    for t in result["trials"]:
        value = "" if t["value"] is None else f"{t['value']:.4f}"
        table.add_row(
            str(t["number"]), t["state"], value, json.dumps(t["params"]) + (f"  {t['reason']}" if t["reason"] else "")
        )
    out = Console()
    out.print(table)
    out.print(f"best: trial {result['best_trial']}, validation reward {result['best_value']:.4f}")
    out.print("train with: grpo-pipeline run " + " ".join(f"--set {a}" for a in result["set"]))
    raise typer.Exit(EXIT_OK)


from grpo_pipeline.tasks import plan as planner  # noqa: E402 - pure Python (no torch, transformers or Prefect): its fields are the options

WORK = planner.Workload.model_fields  # each workload option below is a Workload field: its default, its help
PLAN_FLAGS: dict[str, str] = {}  # Workload field -> the option that sets it, to name it in an error


def _work(field: str, *flags: str) -> Any:  # typer.Option() is typed as returning Any
    PLAN_FLAGS[field] = flags[0] if flags else f"--{field.replace('_', '-')}"
    return typer.Option(*flags, help=WORK[field].description)


def _budget_usd(value: float | None) -> float | None:
    """--budget, refused by the parser (exit 2, and with --json the failure object) before any planning: a
    negative budget, or NaN, refuses every plan, and would reach the refusal's message with nothing to price."""
    if value is not None and not value >= 0:
        raise typer.BadParameter(
            f"{value:g} USD is not a budget; give the most a run may cost, 0 or more, or leave --budget out for no limit"
        )
    return value


@app.command("plan")
def plan_cmd(
    model: Annotated[
        str | None,
        typer.Option(
            help="known id (qwen2.5-7b, meta-llama/Llama-3.1-70B, ...), config.json or model dir; default: the --config's model.base"
        ),
    ] = None,
    quantization: Annotated[str, _work("quantization", "--quant", "--quantization")] = WORK["quantization"].default,
    double_quant: Annotated[bool, _work("double_quant")] = WORK["double_quant"].default,
    lora_rank: Annotated[int, _work("lora_rank")] = WORK["lora_rank"].default,
    lora_targets: Annotated[str, _work("lora_targets", "--targets", "--lora-targets")] = WORK["lora_targets"].default,
    optimizer: Annotated[str, _work("optimizer")] = WORK["optimizer"].default,
    dtype: Annotated[str, _work("dtype")] = WORK["dtype"].default,
    effective_batch: Annotated[int, _work("effective_batch", "--batch", "--effective-batch")] = WORK[
        "effective_batch"
    ].default,
    num_generations: Annotated[int, _work("num_generations")] = WORK["num_generations"].default,
    prompt_tokens: Annotated[int, _work("prompt_tokens")] = WORK["prompt_tokens"].default,
    completion_tokens: Annotated[int, _work("completion_tokens")] = WORK["completion_tokens"].default,
    max_steps: Annotated[int, _work("max_steps", "--steps", "--max-steps")] = WORK["max_steps"].default,
    beta: Annotated[float, _work("beta")] = WORK["beta"].default,
    vllm: Annotated[bool, _work("vllm")] = WORK["vllm"].default,
    gradient_checkpointing: Annotated[str, _work("gradient_checkpointing")] = WORK["gradient_checkpointing"].default,
    gpus: Annotated[
        str | None, typer.Option(help="allowed GPU types, comma-separated; default: the whole catalog")
    ] = None,
    spot: Annotated[bool, typer.Option("--spot/--on-demand")] = True,
    budget: Annotated[
        float | None,
        typer.Option(help="refuse (exit 2) when the estimate is above this many USD", callback=_budget_usd),
    ] = None,
    catalog: Annotated[Path | None, typer.Option(help="YAML merged over configs/gpus.yaml")] = None,
    mfu: Annotated[float, typer.Option(help="assumed model FLOPs utilisation")] = planner.Assumptions.model_fields[
        "mfu"
    ].default,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
) -> None:
    """GPU memory, GPU choice, batch settings, time and cost of a GRPO run, offline and without torch."""
    work_options = {k: v for k, v in locals().items() if k in WORK and k != "model"}
    try:
        if model is None:
            _, cfg = load(config, overrides, as_json)
            result = planner.plan_run(cfg.model, cfg.train, cfg.plan)
            budget = cfg.plan.budget_usd if budget is None else budget
        else:
            name, model_config = planner.load_model_config(model)
            work = planner.Workload(model=name, **work_options)
            result = planner.make_plan(
                model_config,
                work,
                planner.load_catalog(catalog),
                spot=spot,
                allowed=gpus.split(",") if gpus else None,
                assumptions=planner.Assumptions(mfu=mfu),
            )
    except ValidationError as exc:  # a workload option out of range or not one of its choices
        _fail(as_json, options_error(exc, PLAN_FLAGS), EXIT_CONFIG)
    except (ConfigError, ValueError) as exc:  # PlanError included
        _fail(as_json, str(exc), EXIT_CONFIG)
    try:
        planner.check_budget(result, budget)
    except planner.BudgetExceeded as exc:
        # with --json the refusal is the last line, carrying the plan that was refused; else the tables first
        if not as_json:
            for table in planner.plan_tables(result):
                Console().print(table)
        _fail(as_json, str(exc), EXIT_CONFIG, plan=result.report())
    if as_json:
        print(json.dumps(result.report(), indent=2))
    else:
        for table in planner.plan_tables(result):
            Console().print(table)


@app.command("data")
def data_cmd(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    out: Annotated[Path | None, typer.Option(help="where versions go; default: <data_dir>/datasets")] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="tokenizer dir for the token bounds; default: model.base's, resolved as a run resolves it"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON on stdout")] = False,
) -> None:
    """Build the dataset version (load, validate, dedup, split, decontaminate) and print its report."""
    _, cfg = load(config, overrides, as_json)
    from grpo_pipeline.tasks.data.sources import check_local_sources
    from grpo_pipeline.tasks.data.stage import DataQualityError, build_dataset, resolve_tokenizer

    failure = None
    try:
        check_local_sources(cfg.data)
        tok = resolve_tokenizer(
            cfg.data, cfg.model, cfg.data_dir, tokenizer
        )  # the token bounds apply, or the stage refuses
        version = build_dataset(
            cfg.data, out or cfg.data_dir / "datasets", tok, cfg.train.rewards, cfg.train.reward_args
        )
    except DataQualityError as exc:  # bad input: the report still says why
        failure = (str(exc), EXIT_CONFIG, {"report": exc.report.model_dump(mode="json")})
        if not as_json:
            _print_data_report(exc.report, None)
    except ConfigError as exc:
        failure = (str(exc), EXIT_CONFIG, {})
    except Exception as exc:  # a fault of the stage, not of the input: the traceback too
        traceback.print_exc()
        failure = (f"{type(exc).__name__}: {exc}", EXIT_FAILED, {})
    if failure is not None:
        message, code, extra = failure
        _fail(as_json, message, code, **extra)
    if as_json:
        print(json.dumps({"status": "completed", **version.model_dump(mode="json")}, indent=2))
        raise typer.Exit(EXIT_OK)
    _print_data_report(version.report, version)


def _print_data_report(report: DataReport, version: DatasetVersion | None) -> None:
    out = Console()
    table = Table(title=f"data: {report.source} ({report.rows_read} rows read, {report.seconds:.1f} s)")
    table.add_column("rows")
    table.add_column("count", justify="right")
    for split, n in report.splits.items():
        table.add_row(f"kept: {split}", str(n))
    for reason, n in report.dropped.items():
        table.add_row(f"dropped: {reason}", str(n))
    table.add_row("dropped fraction", f"{report.dropped_fraction:.2%} (max {report.max_dropped_fraction:.0%})")
    out.print(table)
    for check, how in report.checks.items():
        out.print(f"  {check}: {how}")
    if version is not None:
        out.print(
            f"fingerprint {version.fingerprint}; splits in {Path(version.splits['train']).parent}; "
            f"quarantine {version.quarantine}"
        )


@app.command("config")
def show_config(config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Print the resolved configuration (defaults + YAML + --set) as JSON."""
    _, cfg = load(config, overrides)
    print(cfg.model_dump_json(indent=2))


@app.command("deploy")
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
        summary = deploy(cfg, settings, path, overrides)
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

from grpo_pipeline.infra.stack import DEFAULT_PORTS, DEFAULT_ROOT  # noqa: E402 - light: the service helpers, no clients

stack_cli = typer.Typer(
    no_args_is_help=True, help="Local PostgreSQL, S3, MLflow and Prefect servers (no Docker needed)."
)
RootOpt = Annotated[Path, typer.Option("--dir", help="where the stack keeps its data and state")]


def _stack(root: Path, **ports: int | None) -> Stack:
    """The stack recorded under `root`; an unreadable state file is an input error, named with its fix."""
    from grpo_pipeline.infra.services import ServiceError
    from grpo_pipeline.infra.stack import Stack

    try:
        return Stack(root, ports=ports)
    except ServiceError as exc:
        _fail(False, str(exc), EXIT_CONFIG)


@stack_cli.command("up")
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
) -> None:
    """Start the services that are not running. Into a pipe (`eval "$(grpo-pipeline stack up)"`) it prints the
    environment exports; to a terminal only where things are, so the stack's credentials (S3 key, MLflow
    password, Prefect auth string) never land on screen or in a terminal log (`stack env` prints the exports
    for `eval`). `--serve` also starts the router once the registry has a champion (its key: GRPO_SERVE_API_KEY
    in `stack env`)."""
    from grpo_pipeline.infra.services import Refused, ServiceError
    from grpo_pipeline.infra.stack import DEFAULT_UP, exports

    stack = _stack(root, s3=s3_port, mlflow=mlflow_port, prefect=prefect_port, serve=serve_port)
    options = _serve_options(serve_config) if serve else None
    try:
        with _progress("starting", "started") as step:
            stack.up([*DEFAULT_UP, "serve"] if serve else DEFAULT_UP, serve=options, step=step)
    except Refused as exc:  # a taken port, a missing tool, no champion yet: exit 2, naming the fix
        _fail(False, f"stack up: {exc}", EXIT_CONFIG)
    except ServiceError as exc:  # a service did not start (what this `up` started is stopped): its log named
        _fail(False, f"stack up failed: {exc}", EXIT_FAILED)
    env = stack.env()
    # stdout carries only the exports, so `eval "$(...)"` works; where things are goes to stderr
    # Both UIs ask for a login: say where it is, not what it is.
    err.print(
        f"MLflow UI:  {env['MLFLOW_TRACKING_URI']} (user {env['MLFLOW_TRACKING_USERNAME']}, password: "
        "MLFLOW_TRACKING_PASSWORD in `stack env`)\n"
        f"Prefect UI: {env['PREFECT_API_URL'].removesuffix('/api')} (asks for PREFECT_API_AUTH_STRING from "
        "`stack env`)\n"
        f"S3 API:     {env['AWS_ENDPOINT_URL_S3']} (bucket '{stack.bucket}')\n"
        + (f"Router:     {env['GRPO_SERVE_URL']} (key: GRPO_SERVE_API_KEY in `stack env`)\n" if serve else "")
        + f'Use it from a shell with:  eval "$(grpo-pipeline stack env --dir {root})"',
        markup=False,
        highlight=False,
    )
    if not sys.stdout.isatty():
        print(exports(env))


def _serve_options(config: Path | None) -> ServeOptions:
    """The router's options, checked before anything starts: the config loads, the engine's Python exists."""
    from grpo_pipeline.infra.stack import ServeOptions
    from grpo_pipeline.tasks.serve.engine import default_python

    path, cfg = load(config, [])
    python = cfg.ab.serve.engine_python or str(default_python(Path.cwd()))
    if not Path(python).is_file():
        _fail(
            False,
            f"stack up --serve: no engine Python at {python}: run `make serve-env` (vLLM's CPU build in .venv-serve) "
            "or set ab.serve.engine_python",
            EXIT_CONFIG,
        )
    # Absolute, as the router runs in the stack's folder; the config as `_load` found it (a shipped recipe's
    # name too). The Python's symlinks are kept: a venv's python links to the base interpreter, and resolving
    # it would run vLLM outside the venv that holds it.
    return ServeOptions(
        str(path.resolve()) if config else None, os.path.abspath(python), cfg.ab.serve.startup_timeout_s
    )


@contextmanager
def _progress(doing: str, done: str) -> Iterator[Step]:
    """What `stack up|down` show while they work (a minute cold), on stderr only: stdout carries the exports that
    `eval "$(grpo-pipeline stack up)"` reads. A spinner naming the service being started or stopped (on a
    terminal), and a line for each one done with its time (a CI log too)."""
    from grpo_pipeline.infra.stack import TITLES

    with err.status("", spinner="dots") as status:

        @contextmanager
        def step(name: str) -> Iterator[None]:
            status.update(f"{doing} {TITLES[name]} ...")
            began = time.monotonic()
            yield
            err.print(f"{TITLES[name]} {done} ({time.monotonic() - began:.0f} s)", highlight=False)

        yield step


@stack_cli.command("env")
def stack_env(root: RootOpt = DEFAULT_ROOT) -> None:
    """Print the environment exports of the running stack: URLs and the credentials its servers ask for.
    Exit 2 when none of its services runs, so `eval "$(grpo-pipeline stack env)"` does not silently set nothing."""
    from grpo_pipeline.infra.stack import exports

    stack = _stack(root)
    if not stack.running():
        where = "" if root == DEFAULT_ROOT else f" --dir {root}"
        _fail(False, f"no stack runs under {stack.root}: start one with `grpo-pipeline stack up{where}`", EXIT_CONFIG)
    print(exports(stack.env()))


@stack_cli.command("status")
def stack_status(root: RootOpt = DEFAULT_ROOT) -> None:
    """Each service's health as JSON; exit 1 when any is not healthy."""
    report = _stack(root).status()
    print(json.dumps(report, indent=2))
    raise typer.Exit(EXIT_OK if all(s["healthy"] for s in report.values()) else EXIT_FAILED)


@stack_cli.command("down")
def stack_down(root: RootOpt = DEFAULT_ROOT) -> None:
    """Stop the services (Prefect and MLflow first, PostgreSQL last); the data stays."""
    with _progress("stopping", "stopped") as step:
        stopped = _stack(root).down(step=step)
    if not stopped:
        err.print("nothing was running", highlight=False)


@app.command()
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
    Exit 2: no API key off loopback, the log store or the registry unreachable, no champion; 1: the engine
    did not start (its log's tail is shown)."""
    import logging
    import os

    from grpo_pipeline.tasks.serve.ab_log import LogStoreError, RequestLog, log_url
    from grpo_pipeline.tasks.serve.adapters import AdapterError
    from grpo_pipeline.tasks.serve.engine import EngineError
    from grpo_pipeline.tasks.serve.router import ServeSetupError, api_key_policy
    from grpo_pipeline.tasks.serve.router import serve as run_router

    _, cfg = load(config, overrides)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a server's log, not a terminal
    try:
        api_key = api_key_policy(dict(os.environ), host)
        request_log = RequestLog.open(log_url(cfg.data_dir))
    except (ValueError, LogStoreError) as exc:
        _fail(False, str(exc), EXIT_CONFIG)
    try:
        run_router(cfg, host, port, api_key, request_log)
    except (ServeSetupError, AdapterError) as exc:
        _fail(False, str(exc), EXIT_CONFIG)
    except EngineError as exc:
        _fail(False, str(exc), EXIT_FAILED)
    finally:
        request_log.close()


from grpo_pipeline.ab_cli import app as ab_cli  # noqa: E402 - light: its commands import what they use
from grpo_pipeline.rewards_cli import app as rewards_cli  # noqa: E402 - light: typer and the reward registry

app.add_typer(stack_cli, name="stack")
app.add_typer(rewards_cli, name="rewards")
app.add_typer(ab_cli, name="ab")


def main() -> None:  # pragma: no cover - `python -m grpo_pipeline.cli`
    sys.exit(app())


if __name__ == "__main__":
    main()
