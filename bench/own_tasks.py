"""A team's own task, end to end: does the shipped recipe teach tasks whose answers are not bare integers, and does
`grpo-pipeline task check` say beforehand which ones it will?

The tasks are the files under `examples/` (a team's JSONL and its config, as a user copies them), one per answer
shape, written by the generators below (`write_examples` keeps the files and the generators equal):

- `sentiment`: a label: "Is the review positive or negative?", reviews with negations and "but" (skill `label`);
- `odd-word`: a short text answer: "Which word does not belong: frost, boat, car, train?" -> "frost" (skill
  `exact_match`: 80 distinct answers, not a label set);
- `extract-json`: a JSON extraction: name, age and city out of a sentence (skill `json_fields`);
- `word-problems`: an integer from templated prompts: multiplication word problems written from eight sentence
  templates (skill `correct_answer`), which the contamination check once took for leakage.

Each config names no skill reward (`auto`): the run chooses it from the answers, as it does for a team. Per task:
`grpo-pipeline task check --json` once (its verdict), then `grpo-pipeline run --json` at 3 seeds, two runs side by
side on one torch thread each; per seed the skill's holdout accuracy base -> trained with the paired 95 % interval
of its gain, the length, and the gate's decision. The goals: **the skill's gain has its interval above zero on every
seed of every task**, and **the task check's verdict agrees with what training did** (`learnable` where every seed
gained, `too_hard` or `already_solved` where none did; anything else is a miss of the check).

    python -m bench.own_tasks                       # 4 tasks x 3 seeds (about an hour on 2 cores)
    python -m bench.own_tasks --tasks sentiment     # one task
    python -m bench.own_tasks --tiny                # a tiny random model, 2 steps: the chain runs
    python -m bench.own_tasks --write-examples      # rewrite examples/*/rows.jsonl from the generators

Resumable as `bench.recipe_seeds` is: each finished run (and each task's check) is kept in the work folder at once
with the fingerprint of the examples and the code; a folder of another fingerprint is refused (exit 2).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.harness import (
    ROOT,
    MixedWorkFolder,
    add_work_options,
    keep_runs,
    open_work,
    pipeline_run,
    prune_weights,
    save,
)
from bench.harness import fingerprint as harness_fingerprint
from bench.recipe_seeds import CODE as RECIPE_CODE
from bench.recipe_seeds import Task, measure, summarize, tiny_sets
from bench.table import Row

NAME = "own_tasks"
WORK = ROOT / ".grpo" / f"bench-{NAME}"
EXAMPLES = ROOT / "examples"
SEEDS = (0, 1, 2)
DATA_SEED = 0
CODE = (*RECIPE_CODE, "bench/own_tasks.py", "examples")
SIDE_BY_SIDE = 2  # runs at once, one torch thread each: two cores


# ----------------------------------------------------------------------------------------------- the tasks' rows

POSITIVE = ("wonderful", "delicious", "friendly", "excellent", "lovely", "great", "superb", "charming", "cozy", "fresh")
NEGATIVE = ("terrible", "awful", "rude", "bland", "dirty", "horrible", "cold", "slow", "noisy", "stale")
THINGS = ("food", "service", "room", "staff", "coffee", "music", "view", "bed", "pasta", "breakfast", "price", "bar")


def sentiment_rows(n: int, seed: int = DATA_SEED) -> list[dict]:
    """n distinct short reviews and their label: plain ("the food was lovely and the staff was kind"), negated
    ("the coffee was not fresh") and turned by "but" (the part after it decides); half of them positive.

    >>> rows = sentiment_rows(800)
    >>> rows[0], len({r["review"] for r in rows}) == 800
    ({'review': 'The view was not noisy.', 'answer': 'positive'}, True)
    >>> sum(r["answer"] == "positive" for r in rows)
    400
    """
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        positive = len(rows) % 2 == 0
        kind = rng.choice(("plain", "negated", "but"))
        a, b = rng.sample(THINGS, 2)
        good, bad = rng.choice(POSITIVE), rng.choice(NEGATIVE)
        if kind == "plain":
            words = rng.sample(POSITIVE if positive else NEGATIVE, 2)
            review = f"The {a} was {words[0]} and the {b} was {words[1]}."
        elif kind == "negated":
            review = f"The {a} was not {bad if positive else good}."
        else:
            first, last = (bad, good) if positive else (good, bad)
            review = f"The {a} was {first}, but the {b} was {last}."
        if review not in seen:
            seen.add(review)
            rows.append({"review": review, "answer": "positive" if positive else "negative"})
    return rows


CATEGORIES = {
    "fruit": ("apple", "banana", "cherry", "grape", "mango", "peach", "pear", "plum", "lemon", "orange"),
    "animal": ("dog", "cat", "horse", "lion", "tiger", "rabbit", "mouse", "bear", "wolf", "fox"),
    "color": ("red", "blue", "green", "yellow", "purple", "pink", "brown", "black", "white", "gray"),
    "vehicle": ("car", "bus", "truck", "bicycle", "train", "plane", "boat", "taxi", "tractor", "scooter"),
    "instrument": ("piano", "guitar", "violin", "drum", "flute", "trumpet", "harp", "cello", "banjo", "organ"),
    "clothing": ("shirt", "hat", "sock", "coat", "scarf", "glove", "boot", "dress", "jacket", "skirt"),
    "furniture": ("chair", "table", "sofa", "bed", "desk", "shelf", "stool", "bench", "cabinet", "dresser"),
    "weather": ("rain", "snow", "wind", "fog", "hail", "storm", "thunder", "sleet", "frost", "drizzle"),
}


def odd_word_rows(n: int, seed: int = DATA_SEED) -> list[dict]:
    """n distinct lists of four words, three of one kind (fruit, animals, colours, ...) and one of another, and the
    one that does not belong: a short text answer, the word itself. The odd one sits at each place equally often.

    >>> rows = odd_word_rows(800)
    >>> rows[0], len({r["words"] for r in rows})
    ({'words': 'frost, boat, car, train', 'answer': 'frost'}, 800)
    >>> [sum(r["words"].split(", ").index(r["answer"]) == i for r in rows) for i in range(4)]
    [200, 200, 200, 200]
    """
    rng, rows, seen = random.Random(seed), [], set()
    kinds = sorted(CATEGORIES)
    while len(rows) < n:
        same, other = rng.sample(kinds, 2)
        words = rng.sample(CATEGORIES[same], 3)
        odd = rng.choice(CATEGORIES[other])
        words.insert(len(rows) % 4, odd)
        listed = ", ".join(words)
        if listed not in seen:
            seen.add(listed)
            rows.append({"words": listed, "answer": odd})
    return rows


NAMES = ("Maria", "Omar", "Chen", "Lucia", "Kofi", "Anna", "Ravi", "Sofia", "Jonas", "Amira", "Pedro", "Yuki")
NAMES += ("Elena", "Tom", "Nadia", "Ivan", "Grace", "Luis", "Hana", "Felix")
CITIES = ("Lyon", "Porto", "Oslo", "Cairo", "Lima", "Seoul", "Dublin", "Nairobi", "Kyoto", "Boston", "Milan", "Quito")
CITIES += ("Prague", "Denver", "Hanoi", "Accra", "Bern", "Perth", "Riga", "Tunis")
PEOPLE = (
    "{name} is {age} years old and lives in {city}.",
    "{name}, aged {age}, works in {city}.",
    "Born {age} years ago, {name} now calls {city} home.",
    "In {city}, {name} celebrated turning {age}.",
    "{name} moved to {city} at the age of {age}.",
    "At {age}, {name} opened a bakery in {city}.",
)


def person_rows(n: int, seed: int = DATA_SEED) -> list[dict]:
    """n distinct sentences about a person and the JSON object of their name, age (a number) and city.

    >>> rows = person_rows(600)
    >>> rows[0]
    {'text': 'Born 71 years ago, Elena now calls Porto home.', 'answer': {'name': 'Elena', 'age': 71, 'city': 'Porto'}}
    >>> len({r["text"] for r in rows})
    600
    """
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        person = {"name": rng.choice(NAMES), "age": rng.randint(18, 90), "city": rng.choice(CITIES)}
        text = rng.choice(PEOPLE).format(**person)
        if text not in seen:
            seen.add(text)
            rows.append({"text": text, "answer": person})
    return rows


PRODUCTS = (
    "A baker fills {a} boxes with {b} muffins each. How many muffins does the baker pack in all?",
    "There are {a} rows of chairs in the hall and {b} chairs in each row. How many chairs are in the hall?",
    "A farmer plants {a} rows of trees with {b} trees in every row. How many trees does the farmer plant?",
    "Each of the {a} classes at the school has {b} students. How many students are there at the school?",
    "A shop sells {a} packs of pencils and each pack holds {b} pencils. How many pencils does the shop sell?",
    "Sam reads {b} pages every day for {a} days. How many pages does Sam read in those days altogether?",
    "A parking garage has {a} levels with {b} cars parked on each level. How many cars are parked there?",
    "A train has {a} cars and each car carries {b} passengers. How many passengers are on the train now?",
)


def word_problem_rows(n: int, seed: int = DATA_SEED) -> list[dict]:
    """n distinct multiplication word problems, a x b with a in 2-9 and b in 2-20, written from eight templates (a
    fixed sentence of 15-20 words around the two numbers), in turn.

    >>> rows = word_problem_rows(700)
    >>> rows[1], len({r["question"] for r in rows})
    ({'question': 'There are 2 rows of chairs in the hall and 10 chairs in each row. How many chairs are in the hall?', 'answer': 20}, 700)
    """
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        a, b = rng.randint(2, 9), rng.randint(2, 20)
        question = PRODUCTS[len(rows) % len(PRODUCTS)].format(a=a, b=b)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": a * b})
    return rows


@dataclass(frozen=True)
class Example:
    """A task as `examples/<name>/` holds it: its rows (generated here) and its config, which names the file."""

    name: str
    what: str
    rows: int
    generate: object  # (n) -> rows
    # the format reported beside the skill (paid by nothing): a reward scored on the holdout's replies; None: the
    # reply's length alone (a label or a word has no form of its own to report)
    format: str | None = None

    @property
    def folder(self) -> Path:
        return EXAMPLES / self.name

    @property
    def config(self) -> Path:
        return self.folder / "config.yaml"


TASKS = {
    e.name: e
    for e in (
        Example("sentiment", "a label: positive or negative (label)", 1000, sentiment_rows),
        Example("odd-word", "a short text: the word that does not belong (exact_match)", 800, odd_word_rows),
        Example("extract-json", "a JSON extraction: name, age, city (json_fields)", 900, person_rows, "json_schema"),
        Example(
            "word-problems",
            "an integer from 8 prompt templates (correct_answer)",
            800,
            word_problem_rows,
            "number_only",
        ),
    )
}


def example_lines(example: Example) -> str:
    """The rows of an example's `rows.jsonl`, as the generator writes them."""
    return "".join(json.dumps(r) + "\n" for r in example.generate(example.rows))  # type: ignore[operator]


def write_examples() -> list[Path]:
    """Rewrite every example's rows.jsonl from its generator; the configs are written by hand."""
    written = []
    for example in TASKS.values():
        path = example.folder / "rows.jsonl"
        path.write_text(example_lines(example))
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------------- the runs


def task_check(example: Example, work: Path, sets: list[str]) -> dict:
    """`grpo-pipeline task check --json` on an example's config: its verdict and measurements."""
    cmd = [sys.executable, "-m", "grpo_pipeline.cli", "task", "check", "--json", "--config", str(example.config)]
    cmd += [arg for s in [f"data_dir={work / f'{example.name}-check'}", *sets] for arg in ("--set", s)]
    (work / f"{example.name}-check").mkdir(parents=True, exist_ok=True)
    models = ROOT / ".grpo" / "models"
    if models.is_dir() and not (work / f"{example.name}-check" / "models").exists():
        (work / f"{example.name}-check" / "models").symlink_to(models.resolve())
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"task check of {example.name} exited {proc.returncode}: {proc.stdout[-2000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def agreement(verdict: str, gained: list[bool]) -> bool | None:
    """Whether the check's verdict agrees with what training did: `learnable` where every seed's skill gained beyond
    noise, `too_hard` or `already_solved` where none did; `format_first` says the reward cannot read the answers,
    so it agrees with no gain. None: seeds split (some gained, some not), which no verdict predicts.

    >>> agreement("learnable", [True, True, True]), agreement("too_hard", [True, False, True])
    (True, None)
    >>> agreement("too_hard", [True, True, True]), agreement("already_solved", [False, False, False])
    (False, True)
    """
    if all(gained):
        return verdict == "learnable"
    if not any(gained):
        return verdict != "learnable"
    return None


def format_figures(run_dir: Path, reward: str) -> dict:
    """The format reward's holdout mean, base -> trained, with its gain's paired interval, scored on the replies the
    run logged (its evaluate stages' per-prompt tables in its own MLflow store): a format no training reward pays is
    not in those tables' columns, so it is scored here from the completions.

    >>> format_figures(Path("/nonexistent"), "number_only")
    Traceback (most recent call last):
    ...
    FileNotFoundError: /nonexistent/mlflow.db: the run's MLflow store is gone
    """
    import tempfile

    from mlflow import MlflowClient

    from bench.recipe_seeds import evaluation_rows, reward_figures
    from grpo_pipeline.trainer.rewards import resolve_reward

    store = run_dir / "mlflow.db"
    if not store.is_file():
        raise FileNotFoundError(f"{store}: the run's MLflow store is gone")
    uri = f"sqlite:///{store}"
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (stage,) = client.search_runs(experiments, "attributes.run_name = 'evaluate-base'", max_results=1)
    summary = {
        "mlflow": {
            "tracking_uri": uri,
            "run_id": stage.data.tags["mlflow.parentRunId"],
            "experiment_id": stage.info.experiment_id,
        }
    }
    with tempfile.TemporaryDirectory() as dst:
        base, trained = evaluation_rows(summary, Path(dst))
    if reward not in base[0]:
        score = resolve_reward(reward)
        for rows in (base, trained):
            for row, value in zip(rows, score([r["completion"] for r in rows]), strict=True):
                row[reward] = value
    return {"reward": reward, **reward_figures(base, trained, reward)}


def length_figures(summary: dict) -> dict:
    holdout = summary.get("holdout") or {}
    return {
        "length_base": (holdout.get("base") or {}).get("mean_length"),
        "length_trained": (holdout.get("trained") or {}).get("mean_length"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--tiny", action="store_true", help="a tiny random model, 2 steps: the chain, not the gain")
    parser.add_argument("--write-examples", action="store_true", help="rewrite examples/*/rows.jsonl and stop")
    parser.add_argument(
        "--adopt",
        action="store_true",
        help="keep the runs of a work folder made by another code version (each run's record names its own), "
        "for a fix that changes no figure; the report lists every code version it holds",
    )
    add_work_options(parser, WORK)
    opts = parser.parse_args(argv)
    if opts.write_examples:
        for path in write_examples():
            print(f"[{NAME}] wrote {path.relative_to(ROOT)}")
        return 0
    work = opts.work / "tiny" if opts.tiny else opts.work
    code = harness_fingerprint(json.dumps({"tiny": opts.tiny}), CODE, ROOT)
    try:
        state = open_work(work, code, opts.fresh)
    except MixedWorkFolder as exc:
        if not opts.adopt:
            print(f"[{NAME}] {exc}", file=sys.stderr)
            return 2
        kept = json.loads((work / "runs.json").read_text())
        for record in kept["runs"].values():
            record.setdefault("code", kept["fingerprint"])
        print(f"[{NAME}] adopting {len(kept['runs'])} runs of code {kept['fingerprint'][:12]} (now {code[:12]})")
        state = {**kept, "fingerprint": code}
    # the check ran once above (`grpo-pipeline task check`); every run trains whatever it said: what training
    # then did is what the verdict is judged against
    checking = tiny_sets(work) + ["check.prompts=4"] if opts.tiny else []
    extra = [*checking, "check.enabled=false"]
    lock = threading.Lock()

    def keep(key: str, record: dict) -> None:
        with lock:
            state["runs"][key] = {"code": code} | record  # an adopted run keeps its own
            keep_runs(work / "runs.json", state)

    for name in opts.tasks:  # the checks first: each is minutes of sampling, and says what to expect
        if f"{name}/check" not in state["runs"]:
            started = time.monotonic()
            found = task_check(TASKS[name], work, checking)
            keep(f"{name}/check", found | {"wall_s": round(time.monotonic() - started, 1)})
            print(f"[{NAME}] {name}: task check says {found.get('verdict')} ({found.get('reason')})", flush=True)

    def one(name: str, seed: int) -> None:
        example = TASKS[name]
        started = time.monotonic()
        summary, seconds = pipeline_run(
            work / f"{name}-{seed}", [*extra, f"train.grpo.seed={seed}"], 1, config=example.config
        )
        skill = (summary.get("holdout") or {}).get("skill")
        figures = measure(summary, seconds, Task(name, example.what, SEEDS, skill, None))
        if example.format:
            figures["format"] = format_figures(work / f"{name}-{seed}", example.format)
        keep(f"{name}/{seed}", figures | length_figures(summary) | {"skill_choice": summary.get("skill_choice")})
        prune_weights(work / f"{name}-{seed}")
        print(f"[{NAME}] {name}/{seed}: {json.dumps(state['runs'][f'{name}/{seed}'])[:400]}", flush=True)
        print(f"[{NAME}] {name}/{seed}: {(time.monotonic() - started) / 60:.1f} min", flush=True)

    pending = [(n, s) for n in opts.tasks for s in opts.seeds if f"{n}/{s}" not in state["runs"]]
    failed = []
    with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:  # a failed run is named at the end; the others go on
        for (n, s), future in [((n, s), pool.submit(one, n, s)) for n, s in pending]:
            try:
                future.result()
            except SystemExit as exc:
                failed.append(f"{n}/{s}: {str(exc)[-300:]}")
    for key, record in state["runs"].items():  # runs kept before their format was measured: from their tables
        name, _, seed = key.partition("/")
        if seed != "check" and name in TASKS and TASKS[name].format and not record.get("format"):
            keep(key, record | {"format": format_figures(work / f"{name}-{seed}", TASKS[name].format)})
    codes = sorted({r.get("code", state["fingerprint"]) for r in state["runs"].values()})
    report = {"name": NAME, "tiny": opts.tiny, "fingerprint": state["fingerprint"], "codes": codes, "tasks": {}}
    for name in TASKS:
        by_seed = {
            int(k.split("/")[1]): v for k, v in state["runs"].items() if k.startswith(f"{name}/") and "check" not in k
        }
        if not by_seed:
            continue
        check = state["runs"].get(f"{name}/check") or {}
        summary = summarize(by_seed, name)
        gained = [by_seed[s]["skill"]["ci_low"] > 0 for s in sorted(by_seed)]
        report["tasks"][name] = summary | {
            "check": {k: check.get(k) for k in ("verdict", "reason", "accuracy", "mixed_fraction", "wall_s")},
            "check_agrees": agreement(check.get("verdict", ""), gained),
        }
    tasks = report["tasks"]
    short = {
        n: f"ran {len(t['seeds'])} of {len(SEEDS)} seeds" for n, t in tasks.items() if len(t["seeds"]) < len(SEEDS)
    }
    short |= {n: "not run" for n in TASKS if n not in tasks}

    def judged(ok: bool) -> bool | None:  # a miss is a miss; a pass over fewer runs than planned is not judged
        return False if not ok else None if short else True

    report["goals"] = {
        "skill_gain_every_seed_of_every_task": judged(all(t["goals"]["skill_gain_every_seed"] for t in tasks.values())),
        "check_agrees_on_every_task": judged(all(t["check_agrees"] for t in tasks.values())),
        "short": short,
    }
    save(f"{NAME}_tiny" if opts.tiny else NAME, report | {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    for row in table_rows(lambda _name: report):
        print(f"[{NAME}] {row.benchmark}: {row.baseline} | {row.candidate} | {row.note}", flush=True)
    print(f"[{NAME}] goals: {json.dumps(report['goals'])}", flush=True)
    for failure in failed:
        print(f"[{NAME}] failed: {failure}", file=sys.stderr)
    return 1 if failed else 0


def table_rows(load) -> list[Row]:
    """Per task, its skill's accuracy base -> trained over the seeds with each seed's interval, the length, and the
    task check's verdict beside it."""
    r = load(NAME)
    bench = "a team's own task, holdout base -> trained (`bench.own_tasks`)"
    if r is None:
        return [Row(bench, "base", "trained", None, "", note="not run yet")]
    rows = []
    for name, t in r["tasks"].items():
        skill = t["skill"]
        per = ", ".join(
            f"seed {seed} {skill['trained'][seed] - skill['base']:+.3f} ({low:+.3f} to {high:+.3f})"
            for seed, (low, high) in skill["gain_ci"].items()
        )
        lengths = ", ".join(
            f"{run.get('length_base', 0) or 0:.1f} -> {run.get('length_trained', 0) or 0:.1f}"
            for run in t["per_seed"].values()
        )
        check = t["check"]
        fmt = t.get("format")
        shape = (
            f"; format ({fmt['reward']}) {fmt['base']:.3f} -> " + ", ".join(f"{v:.3f}" for v in fmt["trained"].values())
            if fmt
            else ""
        )
        rows.append(
            Row(
                f"{bench}, {name}: {TASKS[name].what if name in TASKS else name}, {len(t['seeds'])} seeds: "
                f"accuracy ({skill['reward']})",
                f"base: {skill['base']:.3f}",
                "trained: " + ", ".join(f"{v:.3f}" for v in skill["trained"].values()),
                skill["mean_gain"],
                "",
                note=f"gain (95% CI) {per}; above 0 on {skill['seeds_above_zero']}/{skill['seeds']} seeds{shape}; "
                f"length (tokens) {lengths}; task check: {check.get('verdict')} (agrees: {t['check_agrees']})"
                + (f"; {t['minutes']['mean']:.1f} min a run" if t.get("minutes") else ""),
                unit="",
            )
        )
    return rows or [Row(bench, "base", "trained", None, "", note="no task finished")]


if __name__ == "__main__":
    sys.exit(main())
