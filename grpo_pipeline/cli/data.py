"""`grpo-pipeline data`: build the dataset version (load, validate, dedup, split, decontaminate) and print its report;
a refused dataset still shows the report that says why."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.failure import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.loading import ConfigOpt, SetOpt, load

if TYPE_CHECKING:
    from grpo_pipeline.tasks.data.stage import DataReport, DatasetVersion


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
    from grpo_pipeline.tasks.data.shape import task_rewards
    from grpo_pipeline.tasks.data.sources import check_local_sources
    from grpo_pipeline.tasks.data.stage import DataQualityError, build_dataset, resolve_tokenizer

    failure = None
    try:
        check_local_sources(cfg.data)
        cfg = task_rewards(cfg)  # `auto`: the skill reward the answers need judges them
        tok = resolve_tokenizer(
            cfg.data, cfg.model, cfg.data_dir, tokenizer
        )  # the token bounds apply, or the stage refuses
        version = build_dataset(cfg.data, out or cfg.data_dir / "datasets", tok, cfg.train.reward_set())
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
