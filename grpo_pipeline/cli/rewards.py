"""`grpo-pipeline rewards`: the reward registry, and one reward tried on a file of real completions before
any training is paid for.

    grpo-pipeline rewards [--json]                                  # name, what it checks, columns, arguments
    grpo-pipeline rewards check math_answer --input samples.jsonl [--json]
    grpo-pipeline rewards check remote_verifier --input s.jsonl --arg url=http://127.0.0.1:8000/score --arg timeout_s=5

`samples.jsonl` holds one `{"completion": ..., <columns>}` object a line: the completion as text or as TRL's
message list, and the columns the reward needs (`answer` for math_answer); an optional `prompt` is passed as
TRL passes prompts, an optional `completion_length` (tokens) to length rewards. Exit codes, the CLI's own
(grpo_pipeline/failure.py): 0 scored; 1 the reward failed on the file (it raised, or gave the wrong count, NaN
or inf: the message names the row); 2 an unknown reward, a bad argument, a missing column or an unreadable file.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from grpo_pipeline.configs.rewards import default_role
from grpo_pipeline.failure import EXIT_CONFIG, EXIT_FAILED
from grpo_pipeline.failure import fail as _fail  # the CLI's one way to fail
from grpo_pipeline.trainer.rewards import REWARDS, RewardError, check_columns, completion_text, describe, resolve_reward

JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON on stdout")]

app = typer.Typer(
    add_completion=False,
    invoke_without_command=True,
    help="The reward registry; `rewards check` scores a file of completions with one reward.",
)


@app.callback()
def rewards(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List the registered rewards: what each checks, the data columns it needs, its arguments."""
    if ctx.invoked_subcommand is not None:
        return
    entries = [describe(name) | {"role": default_role(name)} for name in REWARDS]
    if as_json:
        print(json.dumps(entries, indent=2, default=str))
        return
    table = Table(title="rewards (train.rewards)")
    for column in ("name", "role", "what it checks", "columns", "arguments"):
        table.add_column(column, overflow="fold")
    for e in entries:
        args = ", ".join(f"{k}={v!r}" if v != "required" else f"{k} (required)" for k, v in e["arguments"].items())
        table.add_row(e["name"], e["role"], e["statement"], ", ".join(e["columns"]) or "–", args or "–")
    Console().print(table)
    Console().print(
        "Any importable function works too: 'package.module:function' (TRL's signature); arguments: `rewards check NAME --arg k=v`, or functools.partial(reward, k=v) in your module. "
        "role: skill (does the task: what the gate judges) or shaping (format, length); `role: skill` in a "
        "train.rewards entry overrides it."
    )


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"--input {path}: no such file")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(row, dict) or "completion" not in row:
                raise ValueError(f"{path}:{number}: expected an object with a 'completion' (and the reward's columns)")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _arguments(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--arg {pair!r}: expected KEY=VALUE, e.g. --arg timeout_s=5")
        out[key.strip()] = yaml.safe_load(raw)  # numbers, booleans, lists as YAML reads them
    return out


@app.command("check")
def check(
    name: Annotated[str, typer.Argument(help="a registered reward or 'package.module:function'")],
    input: Annotated[Path, typer.Option("--input", "-i", help="JSONL: one {'completion': ..., <columns>} a line")],
    arg: Annotated[list[str] | None, typer.Option("--arg", help="a reward argument KEY=VALUE (repeatable)")] = None,
    max_completion_length: Annotated[int | None, typer.Option(help="for length rewards (overlong_penalty)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Score every row of a file with one reward, as training would; print each score and the mean."""
    try:
        rows = _read(input)
        fn = resolve_reward(name, _arguments(arg or []), max_completion_length=max_completion_length)
        columns = sorted({k for row in rows for k in row} - {"completion", "prompt", "completion_length"})
        partial = [c for c in columns if not all(c in row for row in rows)]
        if partial:
            raise ValueError(
                f"{input}: column(s) {', '.join(partial)} missing from some rows; every row needs the same columns"
            )
        check_columns([name], columns)
    except (ValueError, OSError) as exc:  # RewardError included
        _fail(as_json, str(exc), EXIT_CONFIG)
    completions = [row["completion"] for row in rows]
    inputs: dict[str, Any] = {c: [row[c] for row in rows] for c in columns}
    if all("prompt" in row for row in rows):
        inputs["prompts"] = [row["prompt"] for row in rows]
    if all("completion_length" in row for row in rows):
        inputs["completion_lengths"] = [int(row["completion_length"]) for row in rows]
    logged: dict[str, float] = defaultdict(float)
    inputs["log_metric"] = lambda key, value: logged.__setitem__(key, logged[key] + value)
    try:
        scores = fn(completions, **inputs)
    except RewardError as exc:
        _fail(as_json, str(exc), EXIT_FAILED)
    summary = {
        "status": "completed",
        "reward": name,
        "n": len(scores),
        "mean": statistics.fmean(scores),
        "min": min(scores),
        "max": max(scores),
        "metrics": dict(logged),
        "scores": scores,
    }
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"{name} on {input} ({len(rows)} rows)")
    table.add_column("row", justify="right")
    table.add_column("completion (end)", overflow="fold")
    table.add_column("score", justify="right")
    shown = 30
    for i, (completion, s) in enumerate(zip(completions, scores, strict=True)):
        if i == shown:
            table.add_row("…", f"{len(rows) - shown} more rows (--json for all)", "")
            break
        text = completion_text(completion).strip().replace("\n", " ⏎ ")
        table.add_row(str(i), text if len(text) <= 100 else "…" + text[-99:], f"{s:g}")
    out = Console()
    out.print(table)
    out.print(
        f"mean {summary['mean']:.4g} (min {summary['min']:g}, max {summary['max']:g})"
        + "".join(f"; {k} {v:g}" for k, v in logged.items())
    )
