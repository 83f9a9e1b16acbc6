"""The benchmark results table in `docs/benchmarks.md`, generated from `bench/results/*.json` between two markers.

Each benchmark module says how its saved JSON reads as table rows (`table_rows(load)`); this module turns
rows into Markdown, judges each ratio against its goal, and rewrites only the block between the markers,
so the prose around the table is edited by hand and survives every regeneration.

    python -m bench table      # regenerate the table in docs/benchmarks.md from the saved results, run nothing
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import RESULTS

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}


@dataclass
class Row:
    """One line of the table: what was compared, the two sides' figures, the ratio and the goal it is held to.

    `spread` is the (lowest, highest) ratio over the benchmark's repeats; a goal inside it is noise, not a verdict.
    """

    benchmark: str
    baseline: str
    candidate: str
    ratio: float | None
    goal: str  # "<= 1.05", ">= 3"; "" for a figure reported without a goal
    spread: tuple[float, float] | None = None
    note: str = ""  # replaces the verdict where there is nothing to judge (e.g. a side never reached its target)
    unit: str = "x"  # how the ratio is printed: "x" (a ratio), "%" (a percentage)
    fmt: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return verdict(self.ratio, self.goal, self.spread) if not self.note else self.note


def verdict(ratio: float | None, goal: str, spread: tuple[float, float] | None = None) -> str:
    """'meets', 'misses', or 'within noise' when the goal lies inside the spread of the repeats.

    >>> verdict(1.02, "<= 1.05"), verdict(1.2, "<= 1.05"), verdict(1.06, "<= 1.05", (0.98, 1.10))
    ('meets', 'misses', 'within noise')
    >>> verdict(4.5, ">= 3"), verdict(None, ">= 3"), verdict(2.0, "")
    ('meets', 'not measured', 'reported')
    """
    if ratio is None:
        return "not measured"
    if not goal:
        return "reported"
    op, _, value = goal.partition(" ")
    if op not in _OPS:
        raise ValueError(f"goal {goal!r}: expected '<op> <number>' with op one of {', '.join(_OPS)}")
    if _OPS[op](ratio, float(value)):
        return "meets"
    if spread and min(spread) <= float(value) <= max(spread):
        return "within noise"
    return "misses"


def ratio_text(row: Row) -> str:
    """
    >>> ratio_text(Row("b", "x", "y", 1.2346, "<= 1.05", spread=(1.1, 1.3)))
    '**1.235** (1.10–1.30)'
    >>> ratio_text(Row("b", "x", "y", 2.5, "<= 3", unit="%"))
    '**2.5 %**'
    """
    if row.ratio is None:
        return "–"
    if row.unit == "%":
        text = f"**{row.ratio:.1f} %**"
        return text + (f" ({row.spread[0]:.1f} to {row.spread[1]:.1f} %)" if row.spread else "")
    text = f"**{row.ratio:.3f}**" if row.ratio < 10 else f"**{row.ratio:.1f}**"
    return text + (f" ({row.spread[0]:.2f}–{row.spread[1]:.2f})" if row.spread else "")


def render(rows: list[Row]) -> str:
    """The Markdown table.

    >>> print(render([Row("overhead", "plain: 10 s", "ours: 10.2 s", 1.02, "<= 1.05")]))
    | benchmark | baseline | candidate | ratio (spread) | goal | verdict |
    |---|---|---|---|---|---|
    | overhead | plain: 10 s | ours: 10.2 s | **1.020** | ≤ 1.05 | meets |
    """
    pretty = {"<=": "≤", ">=": "≥"}
    lines = ["| benchmark | baseline | candidate | ratio (spread) | goal | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        op, _, value = r.goal.partition(" ")
        goal = f"{pretty.get(op, op)} {value}{' %' if r.unit == '%' else ''}" if r.goal else "–"
        lines.append(f"| {r.benchmark} | {r.baseline} | {r.candidate} | {ratio_text(r)} | {goal} | {r.verdict} |")
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """Put `block` between the markers, keeping everything outside them.

    >>> replace_block("a\\n<!-- bench:start -->\\nold\\n<!-- bench:end -->\\nb", "new")
    'a\\n<!-- bench:start -->\\nnew\\n<!-- bench:end -->\\nb'
    >>> replace_block("no markers", "new")
    Traceback (most recent call last):
    ...
    ValueError: no '<!-- bench:start -->' ... '<!-- bench:end -->' block; add the two markers where the table goes
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START!r} ... {END!r} block; add the two markers where the table goes")
    return text[: start + len(START)] + "\n" + block + "\n" + text[end:]


def load_result(name: str, results: Path = RESULTS) -> dict | None:
    """A saved result by name, or None when that benchmark has not been run here."""
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def update_page(page: Path, rows: list[Row]) -> None:
    """Rewrite the table block of a Markdown page, `docs/benchmarks.md` (written aside and renamed, like every
    result file); a page without the markers is an error naming it, and is left as it was."""
    try:
        text = replace_block(page.read_text(), render(rows))
    except ValueError as e:
        raise ValueError(f"{page}: {e}") from None
    tmp = page.with_name(page.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(page)


def paired_ratios(result: dict, baseline: str = "baseline", candidate: str = "candidate") -> list[float]:
    """Per-round candidate/baseline ratios of a side-by-side result (the rounds ran alternately).

    >>> paired_ratios({"samples": {"baseline": [10, 20], "candidate": [11, 19]}})
    [1.1, 0.95]
    """
    s = result["samples"]
    return [c / b for b, c in zip(s[baseline], s[candidate], strict=True)]


def from_compare(
    result: dict | None,
    benchmark: str,
    baseline: str,
    candidate: str,
    goal: str,
    value: str = "{:.1f} s",
    sides: tuple[str, str] = ("baseline", "candidate"),
) -> Row:
    """A row from `bench.harness.compare`'s JSON: each side's median, the ratio and the per-round spread.

    >>> r = from_compare({"ratio": 1.1, "median": {"baseline": 10, "candidate": 11},
    ...                   "samples": {"baseline": [10, 10], "candidate": [10, 12]}}, "x", "plain", "ours", "<= 1.05")
    >>> r.candidate, r.verdict
    ('ours: 11.0 s', 'within noise')
    """
    if result is None:
        return Row(benchmark, baseline, candidate, None, goal, note="not run yet")
    b, c = sides
    ratios = paired_ratios(result, b, c)
    return Row(
        benchmark,
        f"{baseline}: {value.format(result['median'][b])}",
        f"{candidate}: {value.format(result['median'][c])}",
        result["ratio"],
        goal,
        spread=(min(ratios), max(ratios)) if len(ratios) > 1 else None,
    )
