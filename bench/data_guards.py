"""Benchmark: what the data stage's input guards cost. The whole chain (read, validate, dedup, tokens, split,
decontaminate, write) on the same 100,000-row corpus, with the JSON Lines reader and row rules from before the
guards and with today's, in one process, alternating, several rounds.

Before: Arrow's JSON reader parsed each 4 MiB block whole, falling back to per-line orjson when a block failed
(it crashed on deep nesting and let a row's neighbours decide its fate). After: every line judged alone by
orjson with the length, BOM, depth and NUL rules (`grpo_pipeline.tasks.data.sources.judge_line`). The before side is the code
of the commit named by --before, loaded from git into this process. Goal: after / before <= 1.05 in time.

    python -m bench.data_guards [--rows 100000] [--repeats 3] [--before 52691f2]

The corpus is bench.data_throughput's (GSM8K rewritten into variants, with duplicates, leaks and broken
lines; needs ../shared/data/gsm8k). Near-dedup is off, so the chain's cost is mostly the part the guards touch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from bench.harness import ROOT, save, stamp
from bench.table import Row

NAME = "data_guards"
BEFORE = "52691f2"  # the last commit before the guards (tasks/data_io.py, tasks/data.py)  # move_imports: keep
# that commit's reader and chain, where they were before tasks/data/ grouped them, and how the chain imported the reader
BEFORE_FILES = (("_before_data_io", "tasks/data_io.py"), ("_before_data", "tasks/data.py"))  # move_imports: keep
BEFORE_IMPORT = "from grpo_pipeline.tasks.data_io import"  # move_imports: keep


def load_before(rev: str) -> types.ModuleType:
    """The data stage as of `rev`, with its reader module of `rev` beneath it, as modules of their own (at `rev`:
    tasks/data.py and tasks/data_io.py, the paths before tasks/data/ grouped them)."""  # move_imports: keep

    def source(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout

    modules = {}
    for name, path in BEFORE_FILES:
        module = types.ModuleType(name)
        module.__file__ = str(ROOT / path)  # the data key hashes code files next to it: the same on both sides
        code = source(path).replace(BEFORE_IMPORT, "from _before_data_io import")
        sys.modules[name] = module
        exec(compile(code, f"{rev}:{path}", "exec"), module.__dict__)
        modules[name] = module
    return modules["_before_data"]


def one_run(run_chain, cfg, tokenizer: str, rewards) -> dict:
    """One whole chain; `rewards` as that side's `run_chain` takes them (the before side: the names alone)."""
    with tempfile.TemporaryDirectory() as out:
        gc.collect()
        started, cpu = time.perf_counter(), time.process_time()
        report = run_chain(cfg, Path(out), tokenizer, rewards)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
        kept = {s: sum(1 for _ in open(Path(out) / f"{s}.jsonl")) for s in ("train", "val", "holdout")}
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "rows_read": report.rows_read,
        "kept": kept,
        "dropped": report.dropped,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default=BEFORE, help="git revision of the code without the guards")
    args = parser.parse_args()

    from bench.data_throughput import GSM8K, build_corpus, tokenizer_dir
    from grpo_pipeline.configs.schema import DataConfig
    from grpo_pipeline.tasks.data.stage import CORRECT_ANSWER
    from grpo_pipeline.tasks.data.stage import run_chain as after

    if not (GSM8K / "train.jsonl").is_file():
        sys.exit(f"GSM8K is not at {GSM8K}; this benchmark needs it")
    before = load_before(args.before).run_chain
    work = Path(tempfile.mkdtemp(prefix="data-guards-"))
    tokenizer = tokenizer_dir(work)
    corpus = work / "corpus.jsonl"
    build_corpus(corpus, args.rows)
    cfg = DataConfig(
        source=str(corpus),
        prompt_column="question",
        answer_extraction="gsm8k",
        eval_sources=[str(GSM8K / "test.jsonl")],
        near_dup_threshold=None,
        max_dropped_fraction=1.0,
    )
    rewards = {"before": ["correct_answer"], "after": CORRECT_ANSWER}
    one_run(after, cfg, tokenizer, rewards["after"])  # warm: imports, the tokenizer, the page cache
    runs = []
    for i in range(args.repeats):
        for side, chain in (
            (("before", before), ("after", after)) if i % 2 == 0 else (("after", after), ("before", before))
        ):
            r = {"side": side, **one_run(chain, cfg, tokenizer, rewards[side])}
            runs.append(r)
            print(
                f"[{NAME}] round {i + 1}/{args.repeats} {side:6s}: {r['seconds']:.2f} s "
                f"({r['cpu_seconds']:.2f} CPU-s, load {r['load_average']:.1f}), kept {sum(r['kept'].values())}",
                flush=True,
            )

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["side"] == side)

    same = len({json.dumps([r["kept"], r["rows_read"]], sort_keys=True) for r in runs}) == 1
    report = {
        "name": NAME,
        "metric": "seconds through the whole chain (no near-dedup), after the guards / before",
        "rows": args.rows,
        "before": args.before,
        "tokenizer": tokenizer,
        "median_seconds": {s: median(s, "seconds") for s in ("before", "after")},
        "median_cpu_seconds": {s: median(s, "cpu_seconds") for s in ("before", "after")},
        "ratio": median("after", "seconds") / median("before", "seconds"),
        "ratio_cpu": median("after", "cpu_seconds") / median("before", "cpu_seconds"),
        "goal": "ratio <= 1.05",
        "same_rows_kept": same,
        "dropped": {r["side"]: r["dropped"] for r in runs},
        "runs": runs,
        **stamp(),
    }
    save(NAME, report)
    m = report["median_seconds"]
    print(
        f"[{NAME}] {args.rows:,} rows: before {m['before']:.2f} s, after {m['after']:.2f} s: x{report['ratio']:.3f} "
        f"(CPU x{report['ratio_cpu']:.3f}); same rows kept: {same}"
    )


def table_rows(load) -> list[Row]:
    """One row: after / before in wall time, the spread of the rounds' own ratios (each round ran both sides)."""
    r = load(NAME)
    if r is None:
        return [
            Row(
                "data stage input guards (`bench.data_guards`)",
                "reader before the guards",
                "with the guards",
                None,
                "<= 1.05",
                note="not run yet",
            )
        ]
    rounds: dict[int, dict[str, float]] = {}
    for i, run in enumerate(r["runs"]):  # in order, two per round
        rounds.setdefault(i // 2, {})[run["side"]] = run["seconds"]
    ratios = [sides["after"] / sides["before"] for sides in rounds.values() if len(sides) == 2]
    m = r["median_seconds"]
    return [
        Row(
            f"data stage input guards, {r['rows']:,} GSM8K-built rows, without near-dedup (`bench.data_guards`)",
            f"reader before the guards ({r['before']}): {m['before']:.2f} s",
            f"with the guards: {m['after']:.2f} s (CPU ×{r['ratio_cpu']:.3f})",
            r["ratio"],
            "<= 1.05",
            spread=(min(ratios), max(ratios)) if len(ratios) > 1 else None,
        )
    ]


if __name__ == "__main__":
    main()
