"""`grpo-pipeline`: run the pipeline, show the resolved configuration.

Exit codes (for CI): 0 completed; 1 the pipeline failed; 2 the configuration or an input is invalid
(unknown key, wrong type, missing model, unreachable or unwritable checkpoint store, no SkyPilot cloud);
3 the candidate was not promoted and --fail-on-reject was given; 4 the champion moved while the run was
deciding (another run promoted first): nothing was moved, run again.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from grpo_pipeline.config import ConfigError, load_config

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_REJECTED, EXIT_CHAMPION_MOVED = 0, 1, 2, 3, 4
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo-cpu.yaml"

app = typer.Typer(add_completion=False, no_args_is_help=True, help="GRPO fine-tuning pipeline.")
err = Console(stderr=True, soft_wrap=True)

ConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="pipeline YAML; default: configs/demo-cpu.yaml")
]
SetOpt = Annotated[
    Optional[list[str]], typer.Option("--set", help="override, e.g. --set train.grpo.max_steps=20 (repeatable)")
]


def _config_path(config: Path | None) -> Path:
    if config is not None:
        return config
    if not DEFAULT_CONFIG.is_file():
        err.print(f"[red]no --config given and the demo config {DEFAULT_CONFIG} is missing; pass --config PATH")
        raise typer.Exit(EXIT_CONFIG)
    return DEFAULT_CONFIG


def _load(config: Path | None, overrides: list[str] | None):
    path = _config_path(config)
    try:
        return path, load_config(path, overrides or [])
    except ConfigError as exc:
        err.print(f"[red]{exc}")
        raise typer.Exit(EXIT_CONFIG) from None


@app.command()
def run(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a machine-readable summary on stdout")] = False,
    fail_on_reject: Annotated[bool, typer.Option(help="exit 3 when the candidate is not promoted")] = False,
) -> None:
    """Run the pipeline (the CPU demo by default), print base and trained holdout reward and the decision."""
    path, _ = _load(config, overrides)
    # Prefect's ephemeral server records a telemetry session at start-up, which races its own SQLite
    # writer ("database is locked") on a fresh PREFECT_HOME; the pipeline needs no telemetry.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.pipeline import grpo_pipeline  # heavy imports only once the config is known to be good
    from infra.launch.skypilot import SkyPreflightError
    from tasks.model import ModelNotFound
    from tasks.registry import ChampionMoved
    from trainer.checkpoints import CheckpointStoreError

    try:
        summary = grpo_pipeline(config_path=str(path), overrides=list(overrides or []))
    except (ModelNotFound, CheckpointStoreError, SkyPreflightError) as exc:
        _fail(as_json, str(exc), EXIT_CONFIG)
    except ChampionMoved as exc:
        _fail(as_json, str(exc), EXIT_CHAMPION_MOVED)
    except Exception as exc:  # the flow's own log has the traceback
        _fail(as_json, f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    code = EXIT_REJECTED if fail_on_reject and not summary["decision"]["promote"] else EXIT_OK
    if as_json:
        print(json.dumps(summary, indent=2))
        raise typer.Exit(code)
    holdout = summary["holdout"]
    table = Table(title=f"holdout ({holdout['n']} prompts, greedy)")
    table.add_column("metric")
    table.add_column("base", justify="right")
    table.add_column("trained", justify="right")
    table.add_row("reward (sum)", f"{holdout['base_reward']:.3f}", f"{holdout['trained_reward']:.3f}")
    for name in holdout["base"]:
        table.add_row(name, f"{holdout['base'][name]:.3f}", f"{holdout['trained'][name]:.3f}")
    out = Console()
    out.print(table)
    decision, registry = summary["decision"], summary["registry"]
    out.print(("[green]promoted" if decision["promote"] else "[yellow]not promoted")
              + f"[/]: version {registry['candidate_version']} of {registry['model']}; aliases {registry['aliases']}")
    for reason in decision["reasons"]:
        out.print(f"  - {reason}")
    out.print(f"adapter: {summary['train']['adapter_dir']}   MLflow run: {summary['mlflow']['run_id']}")
    raise typer.Exit(code)


def _registry(config: Path | None, overrides: list[str] | None):
    import mlflow

    from tasks.registry import Registry

    _, cfg = _load(config, overrides)
    return Registry(mlflow.MlflowClient(cfg.mlflow_uri), cfg.tracking.registered_model)


def _registry_call(action) -> None:
    from mlflow.exceptions import MlflowException

    from tasks.registry import RegistryError

    try:
        moves = action()
    except (RegistryError, MlflowException) as exc:
        err.print(f"[red]{exc}")
        raise typer.Exit(EXIT_CONFIG) from None
    for move in moves:
        print(f"{move.alias} -> {move.version or '(removed)'}")


ReasonOpt = Annotated[str, typer.Option("--reason", help="why: recorded on the model version")]


@app.command()
def rollback(reason: ReasonOpt, config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Make the previous champion the champion again (a second rollback undoes the first)."""
    registry = _registry(config, overrides)
    _registry_call(lambda: registry.rollback(reason))


@app.command()
def promote(
    version: Annotated[str, typer.Option("--version", help="model version to make champion")],
    reason: ReasonOpt,
    force: Annotated[bool, typer.Option("--force", help="required: this skips the A/B decision")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
) -> None:
    """An operator's promotion without an A/B decision; records who and why on the version."""
    if not force:
        err.print("[red]promote skips the A/B decision; pass --force to confirm")
        raise typer.Exit(EXIT_CONFIG)
    registry = _registry(config, overrides)
    _registry_call(lambda: registry.force(version, reason))


@app.command()
def registry(config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Print which model versions the aliases point at."""
    print(json.dumps(_registry(config, overrides).aliases()))


def _fail(as_json: bool, message: str, code: int) -> None:
    if as_json:
        print(json.dumps({"status": "failed", "error": message, "exit_code": code}))
    err.print(f"[red]{message}")
    raise typer.Exit(code)


@app.command("config")
def show_config(config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Print the resolved configuration (defaults + YAML + --set) as JSON."""
    _, cfg = _load(config, overrides)
    print(cfg.model_dump_json(indent=2))


def main() -> None:  # pragma: no cover - `python -m grpo_pipeline.cli`
    sys.exit(app())


if __name__ == "__main__":
    main()
