"""`grpo-pipeline task check`: can GRPO learn this task? Before any training is paid for, the base model is sampled as
training will sample it on a few validation prompts and scored with the skill reward: its accuracy, the share of
prompts whose group holds both a right and a wrong answer (the only ones GRPO learns from), the answers' lengths
against the cap, a format reading, the throughput and the training's time; then a verdict (`grpo_pipeline.tasks.check`).

    grpo-pipeline task check [--config configs/demo-cpu.yaml] [--set check.prompts=32] [--prompts 32] [--json]

Exit codes: 0 for every verdict (the check is a report; a run refuses `too_hard` itself, `check.on_too_hard`); 2 bad
input (the configuration, a missing model, the data stage's refusal with its report, as `grpo-pipeline data`); 1 a
fault of the check.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.failure import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.loading import ConfigOpt, SetOpt, load

if TYPE_CHECKING:
    from grpo_pipeline.tasks.check import TaskCheck

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="A team's own task: `task check` says whether GRPO can learn it, before training.",
)


@app.command("check")
def check_cmd(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    prompts: Annotated[
        int | None, typer.Option("--prompts", min=1, help="validation prompts to sample (check.prompts)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the TaskCheck as JSON on stdout")] = False,
) -> None:
    """Say whether GRPO can learn the task: the base's sampled accuracy, its mixed groups, and a verdict."""
    extra = [*(overrides or []), *([f"check.prompts={prompts}"] if prompts else [])]
    _, cfg = load(config, extra, as_json)
    # heavy imports only once the config is known to be good
    from grpo_pipeline.tasks.check import cache_dir, run_check
    from grpo_pipeline.tasks.data.shape import task_rewards
    from grpo_pipeline.tasks.data.sources import check_local_sources
    from grpo_pipeline.tasks.data.stage import DataQualityError, build_dataset, resolve_tokenizer
    from grpo_pipeline.tasks.job import check_rewards
    from grpo_pipeline.tasks.model import ModelNotFound, check_model_paths, resolve_base_model

    failure = None
    try:
        check_local_sources(cfg.data)
        cfg = task_rewards(cfg)  # `auto`: the skill reward the answers need, as the run chooses it
        rewards = cfg.train.reward_set()
        check_model_paths(cfg.model)
        check_rewards(rewards, cfg.evaluate)
        # the dataset version as `grpo-pipeline data` builds it (or finds it), the base as a run resolves it
        tokenizer = resolve_tokenizer(cfg.data, cfg.model, cfg.data_dir)
        version = build_dataset(cfg.data, cfg.data_dir / "datasets", tokenizer, rewards)
        model_path = resolve_base_model(cfg.model, cfg.data_dir / "models")
        print(
            f"task check: sampling {cfg.check.prompts} prompts of {version.fingerprint[:16]} on {model_path}",
            file=sys.stderr,
            flush=True,
        )
        check = run_check(version, model_path, cfg.model, rewards, cfg.train, cfg.check, cache_dir(cfg.data_dir))
    except DataQualityError as exc:  # bad input: the report still says why
        failure = (str(exc), EXIT_CONFIG, {"report": exc.report.model_dump(mode="json")})
        if not as_json:
            from grpo_pipeline.cli.data import _print_data_report

            _print_data_report(exc.report, None)
    except (ConfigError, ModelNotFound) as exc:
        failure = (str(exc), EXIT_CONFIG, {})
    except Exception as exc:  # a fault of the check, not of the input: the traceback too
        traceback.print_exc()
        failure = (f"task check: {type(exc).__name__}: {exc}", EXIT_FAILED, {})
    if failure is not None:
        message, code, extra_fields = failure
        _fail(as_json, message, code, **extra_fields)
    if as_json:
        print(json.dumps({"status": "completed", **check.model_dump(mode="json")}, indent=2))
        raise typer.Exit(EXIT_OK)
    print_check(check, Console())
    raise typer.Exit(EXIT_OK)


def print_check(check: TaskCheck, out: Console) -> None:
    """The measured figures as a table, then the verdict line and its fixes."""
    from grpo_pipeline.tasks.job import format_duration

    cap = check.max_completion_length
    table = Table(
        title=f"task check: {check.prompts} prompts x {check.num_generations} samples, temperature "
        f"{check.temperature:g}, at most {cap} tokens{' (cached)' if check.cached else ''}"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("", overflow="fold")
    quarantined = ", ".join(f"{reason} {n}" for reason, n in check.quarantined.items()) or "none"
    splits = ", ".join(f"{split} {n}" for split, n in check.splits.items())
    table.add_row("rows kept", str(check.rows_kept), f"{splits}; quarantined: {quarantined}")
    table.add_row(
        "prompts sampled", str(check.prompts), f"{check.prompts_from_val} val, {check.prompts_from_train} train"
    )
    table.add_row("skill reward", check.skill, "right: it scores above 0")
    low, high = check.accuracy_ci
    table.add_row("accuracy", f"{check.accuracy:.3f}", f"95 % [{low:.3f}, {high:.3f}], by prompt")
    low, high = check.mixed_ci
    table.add_row(
        "mixed groups",
        f"{check.mixed_fraction:.3f}",
        f"95 % [{low:.3f}, {high:.3f}]; {check.mixed_prompts} mixed, {check.all_right_prompts} all right, "
        f"{check.all_wrong_prompts} all wrong",
    )
    lengths = (
        f"median {check.right_length_median:g}, max {check.right_length_max}"
        if check.right_length_median is not None
        else "no right answer"
    )
    table.add_row("right answers' length", lengths, f"tokens, against max_completion_length {cap}")
    table.add_row("cut at the cap", f"{check.cut_share:.3f}", "of the samples")
    table.add_row(
        "format",
        "-" if check.format_share is None else f"{check.format_share:.3f}",
        f"of {check.wrong_samples} wrong samples hold the reference answer",
    )
    table.add_row(
        "sampling",
        f"{check.tokens_per_second:.1f} tok/s",
        f"{check.samples_per_second:.2f} samples/s; {check.generation_seconds:.1f} s, load {check.load_seconds:.1f} s",
    )
    estimate = check.estimate
    table.add_row(
        "training estimate",
        format_duration(estimate.seconds),
        f"{estimate.steps} steps of {estimate.step_seconds:.1f} s, on this machine",
    )
    out.print(table)
    if check.note:
        out.print(f"  note: {check.note}", highlight=False)
    out.print(f"  estimate: {estimate.how}", highlight=False)
    colour = "green" if check.verdict == "learnable" else "yellow"
    out.print(Text.assemble((check.verdict, colour), f": {check.reason}"), highlight=False)
    for fix in check.fixes:
        out.print(f"  - {fix}", highlight=False)
