"""Measurement: what template n-grams change in the data stage. Three sources through the whole chain, with the
contamination and near-dedup checks of a git revision before template n-grams (--before) and with today's, in one
process, alternating:

- GSM8K train against its test set (the rows dropped, per reason, must stay the same) and the time per side;
- 700 multiplication word problems from eight sentence templates (`multiplication_rows`);
- 700 sentiment rows: one long fixed instruction around short varying reviews (`sentiment_rows`).

    python -m bench.template_ngrams [--before 9b07e52] [--repeats 3]

The before side is the stage of today with `tasks/data/chain.py` and `tasks/data/text.py` of --before, loaded from
git into this process (the rest of the stage is unchanged by template n-grams). Needs ../shared/data/gsm8k for the
GSM8K part.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

from bench.harness import ROOT, save, stamp

NAME = "template_ngrams"
BEFORE = "9b07e52"  # the last commit before template n-grams

# Eight fixed sentences (15-25 words) around two numbers: close together, far apart, at the start, in the middle.
TEMPLATES = (
    "A farmer plants {a} rows of corn with {b} plants in each row. How many corn plants does the farmer plant in total?",
    "There are {a} boxes in the storeroom and each box holds {b} pencils. How many pencils are in the storeroom?",
    "{a} buses drive to the museum, and every bus carries {b} students. How many students ride the buses to the museum?",
    "A baker fills {a} trays each morning. If every tray holds exactly {b} muffins, how many muffins does she bake?",
    "Maria reads {a} pages every day. She keeps reading the same number of pages each day for {b} days. How many pages?",
    "Each of the {a} shelves in the school library is full. Every shelf holds {b} books. How many books are there?",
    "A theater has {a} rows of seats and each of the rows has {b} seats. How many seats does the theater have in all?",
    "Sam saves {a} dollars each week for a new bicycle, and he does this for {b} weeks. How many dollars has he saved?",
)
INSTRUCTION = (
    "Classify the sentiment of the following movie review as positive or negative. Answer with 1 if the review is "
    "positive and 0 if it is negative. Review:"
)
_GOOD = ("wonderful", "moving", "brilliant", "funny", "gripping", "beautiful", "clever", "charming", "superb", "tender")
_BAD = ("dull", "clumsy", "boring", "silly", "tedious", "shallow", "messy", "bland", "weak", "predictable")
_NOUNS = ("plot", "acting", "script", "ending", "cast", "score", "pacing", "dialogue", "camera work", "story", "lead")
_TAILS = ("from start to finish", "overall", "at times", "in the second half", "for me", "throughout", "", "")


def multiplication_rows(n: int = 700, seed: int = 0) -> list[dict]:
    """`n` distinct word problems {"question", "answer"}: a template of TEMPLATES around two numbers in 2..99.

    >>> rows = multiplication_rows(16)
    >>> len({r["question"] for r in rows}), rows[0]["answer"] == str(eval("*".join(
    ...     w for w in rows[0]["question"].replace(",", " ").split() if w.isdigit())))
    (16, True)
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        question = TEMPLATES[len(rows) % len(TEMPLATES)].format(a=a, b=b)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": str(a * b)})
    return rows


def review(rng: random.Random) -> tuple[str, int]:
    """A short review (4-12 words) and its label: two clauses of adjective and noun, an optional tail."""
    positive = rng.random() < 0.5
    words = _GOOD if positive else _BAD
    first, second = rng.sample(_NOUNS, 2)
    text = f"the {first} is {rng.choice(words)} and the {second} is {rng.choice(words)} {rng.choice(_TAILS)}"
    return text.strip() + ".", int(positive)


def sentiment_rows(n: int = 700, seed: int = 0) -> list[dict]:
    """`n` distinct rows {"question", "answer"}: INSTRUCTION (28 words) around a short varying review.

    >>> rows = sentiment_rows(10)
    >>> len({r["question"] for r in rows}), rows[0]["question"].startswith(INSTRUCTION), rows[0]["answer"] in "01"
    (10, True, True)
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n:
        text, label = review(rng)
        question = f"{INSTRUCTION} {text}"
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": str(label)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- the before side


def load_before(rev: str) -> type:
    """`Chain` as of `rev`: chain.py of `rev` over text.py of `rev`, as modules of their own."""

    def source(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout

    modules = {}
    for name, path in (("_before_text", "tasks/data/text.py"), ("_before_chain", "tasks/data/chain.py")):
        module = types.ModuleType(name)
        module.__file__ = str(ROOT / path)
        code = source(path).replace("from grpo_pipeline.tasks.data.text import", "from _before_text import")
        sys.modules[name] = module
        exec(compile(code, f"{rev}:{path}", "exec"), module.__dict__)
        modules[name] = module
    return modules["_before_chain"].Chain


def one_run(chain_class: type, cfg, tokenizer: str | None) -> dict:
    """The whole chain with `chain_class` in place of today's Chain; the report and the kept keys per split."""
    from grpo_pipeline.tasks.data import stage

    today = stage.Chain
    stage.Chain = chain_class
    try:
        with tempfile.TemporaryDirectory() as out:
            gc.collect()
            started, cpu = time.perf_counter(), time.process_time()
            report = stage.run_chain(cfg, Path(out), tokenizer, stage.CORRECT_ANSWER)
            seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
            kept = {
                s: sorted(json.loads(line)["key"] for line in open(Path(out) / f"{s}.jsonl"))
                for s in ("train", "val", "holdout")
            }
            dropped_keys = sorted(
                (q["reason"], q["row"].get("key") or json.dumps(q["row"], sort_keys=True))
                for q in map(json.loads, open(Path(out) / "quarantine.jsonl"))
                if isinstance(q["row"], dict)
            )
    finally:
        stage.Chain = today
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "rows_read": report.rows_read,
        "kept": {s: len(k) for s, k in kept.items()},
        "dropped": report.dropped,
        "kept_keys": kept,
        "dropped_rows": dropped_keys,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE, help="git revision of the chain without template n-grams")
    parser.add_argument("--repeats", type=int, default=3, help="GSM8K timing rounds (each runs both sides)")
    args = parser.parse_args()

    from bench.data_throughput import GSM8K, tokenizer_dir
    from grpo_pipeline.configs.schema import DataConfig
    from grpo_pipeline.tasks.data.chain import Chain

    sides: dict[str, type] = {"before": load_before(args.before), "after": Chain}
    work = Path(tempfile.mkdtemp(prefix="template-ngrams-"))
    tokenizer = tokenizer_dir(work)

    def config(source: Path, **kw) -> DataConfig:
        return DataConfig(source=str(source), prompt_column="question", max_dropped_fraction=1.0, **kw)

    tasks: dict[str, Callable[[], DataConfig]] = {
        "multiplication": lambda: config(write_jsonl(work / "mult.jsonl", multiplication_rows())),
        "sentiment": lambda: config(write_jsonl(work / "sentiment.jsonl", sentiment_rows())),
    }
    report: dict = {"name": NAME, "before": args.before, "tokenizer": tokenizer, "tasks": {}}
    for name, make in tasks.items():
        cfg = make()
        report["tasks"][name] = {}
        for side, chain in sides.items():
            r = one_run(chain, cfg, tokenizer)
            report["tasks"][name][side] = {k: r[k] for k in ("rows_read", "kept", "dropped")}
            print(f"[{NAME}] {name:14s} {side:6s}: kept {r['kept']}, dropped {r['dropped']}", flush=True)

    if (GSM8K / "train.jsonl").is_file():
        cfg = config(
            GSM8K / "train.jsonl", answer_extraction="gsm8k", eval_sources=[str(GSM8K / "test.jsonl")]
        ).model_copy(update={"max_dropped_fraction": 0.2})
        one_run(sides["after"], cfg, tokenizer)  # warm: imports, the tokenizer, the page cache
        runs = []
        for i in range(args.repeats):
            for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                r = one_run(sides[side], cfg, tokenizer)
                runs.append({"side": side, **r})
                print(f"[{NAME}] gsm8k round {i + 1} {side:6s}: {r['seconds']:.2f} s, dropped {r['dropped']}")
        same_kept = len({json.dumps(r["kept_keys"]) for r in runs}) == 1
        same_dropped = len({json.dumps(r["dropped_rows"]) for r in runs}) == 1
        median = {s: statistics.median(r["seconds"] for r in runs if r["side"] == s) for s in sides}
        median_cpu = {s: statistics.median(r["cpu_seconds"] for r in runs if r["side"] == s) for s in sides}
        by_side = {r["side"]: r for r in runs}
        report["gsm8k"] = {
            "dropped": {s: by_side[s]["dropped"] for s in sides},
            "kept": {s: by_side[s]["kept"] for s in sides},
            "same_rows_kept": same_kept,
            "same_rows_dropped": same_dropped,
            "differ": sorted(
                set(map(tuple, by_side["before"]["dropped_rows"])) ^ set(map(tuple, by_side["after"]["dropped_rows"]))
            ),
            "median_seconds": median,
            "median_cpu_seconds": median_cpu,
            "ratio": median["after"] / median["before"],
            "ratio_cpu": median_cpu["after"] / median_cpu["before"],
            "runs": [{k: r[k] for k in ("side", "seconds", "cpu_seconds")} for r in runs],
        }
        g = report["gsm8k"]
        print(
            f"[{NAME}] gsm8k: before {median['before']:.2f} s, after {median['after']:.2f} s: x{g['ratio']:.3f} "
            f"(CPU x{g['ratio_cpu']:.3f}); same rows kept: {same_kept}, same rows dropped: {same_dropped}"
        )
    save(NAME, {**report, **stamp()})


if __name__ == "__main__":
    main()
