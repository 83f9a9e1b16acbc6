"""`grpo-pipeline run` and `grpo-pipeline hpo`: the pipeline flow, or the search alone, on a configuration loaded and
preflighted before any flow run exists (a refused input leaves no failed flow run behind), with the summary as
tables or, with --json, as the RunSummary CI reads."""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.failure import EXIT_CHAMPION_MOVED, EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_REJECTED
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.loading import ConfigOpt, SetOpt, load

if TYPE_CHECKING:  # for annotations only: importing them here would load the training stack
    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.tasks.plan import Plan
    from grpo_pipeline.tasks.summary import RunSummary


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


def _preflight_or_exit(cfg: PipelineConfig, as_json: bool) -> tuple[PipelineConfig, Plan | None]:
    """The flows' own first checks, run before a flow run exists: a refused input leaves no Failed run on
    the Prefect server (whose notification would fire) and no engine traceback before the one useful line.
    Returns the configuration with its task's skill reward resolved (`auto`: chosen from the source's answers,
    said on stderr) and what the checks return (the plan the budget was priced with), for the flow, which does not
    check again."""
    from grpo_pipeline.flows.preflight import preflight
    from grpo_pipeline.tasks.data.shape import task_rewards

    try:
        cfg = task_rewards(cfg)
        for entry in cfg.train.rewards:
            if entry.chosen_by:
                print(f"skill reward: {entry.name} ({entry.chosen_by})", file=sys.stderr)
        return cfg, preflight(cfg)
    except _input_errors() as exc:
        _fail(as_json, str(exc), EXIT_CONFIG)
    except Exception as exc:  # a fault of a check, not of the input: the traceback too, and still the JSON
        traceback.print_exc()
        _fail(as_json, f"preflight: {type(exc).__name__}: {exc}", EXIT_FAILED)


def run(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a machine-readable summary on stdout")] = False,
    fail_on_reject: Annotated[bool, typer.Option(help="exit 3 when the candidate is not promoted")] = False,
) -> None:
    """Run the pipeline (the CPU demo by default), print base and trained holdout reward and the decision."""
    path, cfg = load(config, overrides, as_json)
    _ephemeral_prefect_defaults()
    cfg, priced = _preflight_or_exit(cfg, as_json)
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
    cfg, _ = _preflight_or_exit(cfg, as_json)
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
