"""The README and docs/: the README stays a front page (at most 200 lines, the two set-up commands, the three
kinds of user, a link to every page), every relative link and anchor in them resolves (by GitHub's anchor rules), every path of the checkout
they name exists, the architecture page's layer table names every module, and the README's recipe figures are the
saved benchmark's."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = (
    "architecture",
    "data",
    "training",
    "planning",
    "operations",
    "reliability",
    "benchmarks",
    "security",
    "serving",
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (a `](` inside code is not a link)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text (a link's label, not its target; no emphasis or code
    marks), lower case, every character but letters, digits, spaces, hyphens and underscores dropped, each space
    a hyphen.

    >>> _slug("The demo's step"), _slug("`grpo-pipeline serve`: the router"), _slug("A [link](x.md) & more")
    ('the-demos-step', 'grpo-pipeline-serve-the-router', 'a-link--more')
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[*`]|(?<!\w)_|_(?!\w)", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every anchor GitHub makes on the page: one per heading, a repeated one numbered (`x`, `x-1`, `x-2`, ...),
    and each explicit `<a id="...">` / `<a name="...">`."""
    seen: dict[str, int] = {}
    anchors = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", _prose(path)))
    for heading in re.findall(r"^#{1,6} (.+?)#*$", _prose(path), flags=re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n## Usage\ntext\n```\n# not a heading\n```\n## Usage\n### `run` -h, --help\n")
    assert _anchors(page) == {"title", "usage", "usage-1", "run--h---help"}


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "README.md is at most 200 lines; move detail into docs/"
    commands = [line.split("#")[0].strip() for line in text.splitlines()]
    assert "make demo" in commands and "make test" in commands, "the two set-up commands, as commands"
    for user in ("A schedule", "A person", "CI"):
        assert f"**{user}" in text, f"the README addresses {user!r}"
    for page in PAGES:
        assert f"(docs/{page}.md" in text, f"the README links docs/{page}.md"


def test_make_test_is_what_ci_runs():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(), flags=re.M)


EVERY_PAGE = sorted({README, *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / f"{p}.md" for p in PAGES)})


@pytest.mark.parametrize("path", EVERY_PAGE, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(path):
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    for target in LINK.findall(_prose(path)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.relative_to(ROOT)} links {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(dest), f"{path.relative_to(ROOT)} links {target}: no such heading"


def test_the_data_page_states_the_readers_rules_as_the_code_has_them():
    """docs/data.md names every reason a JSON line is refused for, with the bounds the reader really uses."""
    from grpo_pipeline.tasks.data import sources as data_io
    from grpo_pipeline.tasks.data.stage import REASONS

    text = " ".join((ROOT / "docs" / "data.md").read_text().split())
    for reason in ("line_too_long", "invalid_utf8", "bad_json", "too_deep", "nul_character"):
        assert reason in REASONS and f"`{reason}`" in text, reason
    assert f"`MAX_LINE_BYTES` ({data_io.MAX_LINE_BYTES >> 20} MiB)" in text
    assert f"`MAX_DEPTH` ({data_io.MAX_DEPTH})" in text
    assert f"at most {data_io.PREVIEW_CHARS:,} characters" in text
    for rule in ("byte order mark", "key given twice", "raw NUL byte"):
        assert rule in text, rule


def test_the_reliability_page_states_the_checkpoint_fallback_as_the_code_has_it():
    from grpo_pipeline.trainer.checkpoints import CORRUPT, REASON_FILE, ResumePoint

    text = " ".join((ROOT / "docs" / "reliability.md").read_text().split())
    assert f"`<root>/{CORRUPT}/checkpoint-<step>-<UTC time>/` with a `{REASON_FILE}`" in text
    assert "`resume_fallback`" in text and "`choose_resume`" in text
    fresh = ResumePoint(skipped=[{"step": 4, "reason": "r", "moved_to": None}]).reason
    assert f"`{fresh.split(';')[0]}" in text  # the words the job says when nothing verifies


# the repository's top folders: a backticked name that starts with one is a path in the checkout
TOP = ("configs/", "trainer/", "tasks/", "infra/", "flows/", "grpo_pipeline/", "bench/", "sky/", "docs/", "tests/")


def _exists(name: str) -> bool:
    """A path the docs name, with what may follow it: `#anchor`, `:function`, `::test`, or a `.attribute` after a
    module's path (`trainer/loading.keep_adapter_fp32`); a `<placeholder>` matches any name; `grpo_pipeline/x` is the package's x when the CLI has none."""
    path = re.sub(r"<[^>]+>", "*", re.split(r"#|::|:(?=\w)", name)[0])  # configs/accelerate/<strategy>.yaml
    tries = [path, path.removeprefix("grpo_pipeline/")]
    tries += [f"{t.split('.')[0]}.py" for t in tries if "." in t.rpartition("/")[2]]
    return any(list(ROOT.glob(t)) if "*" in t else (ROOT / t).exists() for t in tries)


@pytest.mark.parametrize("path", [README, *(ROOT / "docs" / f"{p}.md" for p in PAGES)], ids=lambda p: p.name)
def test_every_path_in_the_checkout_the_docs_name_exists(path):
    names = {n for n in re.findall(r"`([^`\s]+)`", path.read_text()) if n.startswith(TOP)}
    assert names  # the check reads the page's paths
    missing = sorted(n for n in names if not _exists(n))
    assert missing == [], f"{path.name} names paths that are not in the checkout: {missing}"


def test_the_architecture_table_names_every_module_of_its_layer():
    """Each layer's row names each module and package in its folder, and each module of those packages."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| \d\. [\w ]+ \| `(\w+)/` \| (.*) \|[^|]*\|$", text, re.M)
    assert len(rows) == 6
    unnamed = []
    for folder, cell in rows:
        named = set(re.findall(r"`([^`(]+)`", cell))
        for entry in sorted((ROOT / folder).iterdir()):
            if entry.name.startswith("_") or not (entry.suffix == ".py" or (entry / "__init__.py").is_file()):
                continue
            ways = {entry.name, entry.stem, f"{entry.name}/", f"{folder}/{entry.name}", f"{folder}/{entry.name}/"}
            if not ways & named and not any(n.startswith(f"{folder}/{entry.name}/") for n in named):
                unnamed.append(f"{folder}/{entry.name}")
            if entry.is_dir():
                for module in sorted(entry.glob("[!_]*.py")):
                    if not {module.stem, module.name, f"{folder}/{entry.name}/{module.name}"} & named:
                        unnamed.append(f"{folder}/{entry.name}/{module.name}")
    assert unnamed == [], f"docs/architecture.md's layer table does not name: {unnamed}"


def test_the_readmes_recipe_figures_are_the_saved_benchmarks():
    """The README's "what it gives" paragraph quotes bench.recipe_seeds' saved result (bench/results/
    recipe_seeds.json), the skill (accuracy) apart from the format, not figures from memory: rerun the benchmark
    and this names each figure the README still has to follow (it once said 1.217 beside a JSON example of 1.25)."""
    import json

    saved = json.loads((ROOT / "bench" / "results" / "recipe_seeds.json").read_text())["tasks"]
    text = " ".join(README.read_text().split())  # the paragraph's line breaks fall anywhere

    def pct(x: float) -> str:
        return f"{100 * x:.1f}"

    def skill(task: str, seed: int) -> dict:
        return saved[task]["per_seed"][str(seed)]["skill"]

    demo = saved["demo"]
    seeds = [demo["per_seed"][str(seed)] for seed in demo["seeds"]]
    (base,) = {pct(s["skill"]["base"]) for s in seeds}  # one holdout, one base model: one base accuracy
    trained = [pct(s["skill"]["trained"]) for s in seeds]

    def listed(task: str) -> str:  # "19.2 % -> 40.4, 41.2 and 4.3 %": every seed of an untuned task
        trained = [pct(skill(task, seed)["trained"]).removesuffix(".0") for seed in saved[task]["seeds"]]
        return f"{pct(skill(task, saved[task]['seeds'][0])['base']).removesuffix('.0')} % -> " + (
            f"{', '.join(trained[:-1])} and {trained[-1]} %"
        )

    untuned = ("subtract", "compare", "gsm8k", "sequence")
    figures = [
        f"accuracy {base} % -> {', '.join(trained[:-1])} and {trained[-1]} %",
        f"(+{min(s['skill']['ci_low'] for s in seeds):.3f} at worst)",
        f"correct_answer {seeds[0]['skill']['base']:.3f} {seeds[0]['skill']['trained']:.3f}",
        *(listed(task) for task in untuned),
    ]
    runs = [run for task in untuned for run in saved[task]["per_seed"].values()]
    gained = sum(run["skill"]["ci_low"] > 0 for run in runs)
    figures.append(f"The skill gained beyond noise in {gained} of those {len(runs)} runs")
    assert all(s["skill"]["ci_low"] > 0 for s in seeds) and "each seed's gain with its 95 % interval above zero" in text
    assert [figure for figure in figures if figure not in " ".join(text.split())] == []
    walls = [s["wall_s"] / 60 for s in seeds]
    took = re.search(r"the seeds above took ([\d.]+)-([\d.]+) min", text)
    assert took, "the README says how long the seeds' runs took"
    assert [float(x) for x in took.groups()] == pytest.approx([min(walls), max(walls)], abs=0.05 + 1e-9)  # 1 decimal


def test_the_benchmarks_page_quotes_the_demo_recipes_accuracy_and_format_from_the_saved_search_benchmark():
    """docs/benchmarks.md gives the demo recipe at three seeds on the AVX512-BF16 kind, total, accuracy
    (`correct_answer`) and format (`number_only`) apart, as `bench.hpo_gain`'s hand-tuned arm saved them."""
    import json

    runs = json.loads((ROOT / "bench" / "results" / "hpo_gain.json").read_text())["runs"]
    hand = [runs[f"hand/{seed}"] for seed in (0, 1, 2)]
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())

    def listed(values: list[str]) -> str:
        return ", ".join(values[:-1]) + f" and {values[-1]}"

    def percent(x: float) -> str:
        return f"{100 * x:.1f}".removesuffix(".0") + " %"

    total = listed([f"{r['holdout_reward']:.3f}" for r in hand])
    accuracy = listed([f"{100 * r['per_reward']['correct_answer']:.1f} %" for r in hand])
    fmt = listed([percent(r["per_reward"]["number_only"]) for r in hand])
    assert f"total {total}; accuracy {accuracy}; format {fmt}" in text


def test_the_readmes_own_task_figures_are_the_saved_benchmark():
    """The README's "your own task" paragraph quotes bench.own_tasks' saved result (bench/results/own_tasks.json):
    each example task's accuracy, base -> every seed's trained, and the task check's verdict on it."""
    import json

    saved = json.loads((ROOT / "bench" / "results" / "own_tasks.json").read_text())["tasks"]
    text = " ".join(README.read_text().split())

    def pct(x: float) -> str:
        return f"{100 * x:.1f}".removesuffix(".0")

    for name, task in saved.items():
        trained = [pct(task["skill"]["trained"][seed]) for seed in sorted(task["skill"]["trained"])]
        figure = f"{pct(task['skill']['base'])} % -> {', '.join(trained[:-1])} and {trained[-1]} %"
        assert figure in text, f"the README's {name} figures are not the saved ones ({figure})"
    verdicts = {task["check"]["verdict"] for task in saved.values()}
    assert verdicts == {"learnable"} and "the task check called each `learnable`" in text
