"""The benchmark suite: run benchmarks, save `bench/results/*.json`, regenerate the results table in docs/benchmarks.md.

    python -m bench all                  # every benchmark (~18 hours on 2 CPU cores), then the table
    python -m bench lora_vs_full ...     # one or more by name, then the table
    python -m bench table                # only regenerate the table from the saved results
    python -m bench list                 # names, what each compares, rough minutes
    python -m bench all --tiny           # a smoke test: tiny models, results saved as *_tiny.json (not tabled)

Each benchmark runs in its own process (`python -m bench.<name>`), states its baseline, runs both sides in
that process or script, and saves its JSON; each module's `table_rows(load)` turns its JSON into table rows.
A benchmark that fails does not stop the others; the suite exits 1 and names it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

from bench.harness import ROOT
from bench.table import Row, load_result, update_page

PAGE = ROOT / "docs" / "benchmarks.md"  # the page whose bench:start/bench:end block holds the table


@dataclass(frozen=True)
class Bench:
    name: str
    compares: str
    minutes: float  # on 2 CPU cores, quiet machine
    tiny: tuple[str, ...] | None = ("--tiny",)  # arguments for a smoke test; None: no quick mode, skipped
    needs_gpu: bool = False


SUITE = (
    Bench("trainer_overhead", "`python -m grpo_pipeline.trainer` vs a plain TRL script", 5),
    Bench("checkpoint_overhead", "checkpoints to S3 every step vs none; restart vs cold start", 7),
    Bench("eval_throughput", "batched vs one-at-a-time evaluation", 2),
    Bench("orchestration_overhead", "the Prefect + MLflow flow vs the same stages as plain functions", 12),
    Bench("data_throughput", "the data stage vs a per-row Python chain", 6, tiny=None),
    Bench("data_guards", "the data stage with its input guards vs the reader before them", 3, tiny=None),
    Bench(
        "trial_length",
        "search trials of k steps: rank correlation of their score with the final holdout reward; trial length, rungs",
        120,
    ),
    Bench(
        "hpo_gain",
        "searched vs TRL/PEFT defaults vs hand-tuned, 40 final steps, 3 seeds; the search's cost in training runs",
        150,
    ),
    Bench("scoring_precision", "the search's sampled trial score in bf16 vs fp32: seconds per scoring, scores", 3),
    Bench("machine_limit", "GRPO step FLOP/s and tokens/s vs measured matmul peak and bandwidth", 2),
    Bench("step_profile", "one GRPO demo step by phase: generation, rewards, log-prob passes, backward, the rest", 3),
    Bench("lora_vs_full", "LoRA and QLoRA vs full-parameter GRPO on the skill: best rates, plateaus, 3 seeds", 220),
    Bench(
        "gpu_check",
        "bf16 LoRA / NF4 QLoRA on 0.5B-7B: GPU memory vs the planner (GPU only)",
        6,
        tiny=("--dry-run",),
        needs_gpu=True,
    ),
    Bench("reward_throughput", "math_answer completions/s; remote_verifier at concurrency 16 vs 1 (fixed latency)", 1),
    Bench("gsm8k_calc", "real data: GRPO on GSM8K's calculator annotations, trained vs base on the holdout", 15),
    Bench(
        "zero_signal",
        "curriculum sampler on vs off (equal steps), dynamic sampling vs off (equal train time): zero-signal groups and holdout reward",
        180,
    ),
    Bench("dynamic_cost", "the recipe's train time with dynamic sampling (fixed, carried) vs without, 5 seeds", 75),
    Bench("ab_decision", "online A/B: A/A false decisions under peeking; responses to a decision vs fixed-sample", 1),
    Bench(
        "serving",
        "router vs vLLM alone (req/s, p50/p95); adapter hot-swap; LoRA stacked vs merged per arm (vLLM CPU)",
        20,
    ),
    Bench("health_overhead", "the trainer with the health rules on vs off; the rules' own time per step", 10),
    Bench(
        "recipe_seeds",
        "the shipped recipe at 5 seeds on the demo and two untuned tasks: gain per seed, worst vs median",
        210,
    ),
    Bench("warm_start", "day 2 warm-started on new rows + replay vs from the base on all rows: reward, time", 40),
    Bench(
        "own_tasks",
        "a team's own tasks (a label, a short text, a JSON extraction, templated integers), 3 seeds: the skill's "
        "gain per seed, and the task check's verdict against it",
        75,
    ),
)


def available() -> list[Bench]:
    """The benchmarks whose module exists in this checkout (other work may add or not yet have added some)."""
    return [b for b in SUITE if importlib.util.find_spec(f"bench.{b.name}") is not None]


def _data_throughput_rows(load) -> list[Row]:
    r = load("data_throughput")
    if r is None:
        return [
            Row(
                "data stage throughput (`bench.data_throughput`)",
                "per-row Python",
                "data stage",
                None,
                "",
                note="not run yet",
            )
        ]
    m, goals = r["median"], r["goals"]
    rows = []
    for near, key, goal in ((False, "", goals["rows_per_s"]), (True, "_near", goals["rows_per_s_near_dedup"])):
        rate = m[f"arrow{key}"]
        rows.append(
            Row(
                f"data stage, {r['rows']:,} GSM8K-built rows, {'with' if near else 'without'} near-dedup (`bench.data_throughput`)",
                f"per-row Python: {m[f'baseline{key}']:,.0f} rows/s",
                f"data stage: {rate:,.0f} rows/s",
                r["ratio_near_dedup" if near else "ratio"],
                "",
                note=f"{'meets' if rate >= goal else 'misses'} its own goal (≥ {goal:,} rows/s)",
            )
        )
    return rows


# Rows for benchmark modules that do not define `table_rows` themselves.
FALLBACK_ROWS = {"data_throughput": _data_throughput_rows}


def rows(benches: list[Bench], load=load_result) -> list[Row]:
    """Every table row, in suite order, from the saved results (`load(name)` -> the JSON, or None)."""
    out: list[Row] = []
    for b in benches:
        module = importlib.import_module(f"bench.{b.name}")
        build = getattr(module, "table_rows", None) or FALLBACK_ROWS.get(b.name)
        if build is None:
            out.append(Row(b.name, "", "", None, "", note="module gives no table rows"))
            continue
        try:
            out += build(load)
        except (KeyError, TypeError, ValueError) as exc:  # a result file in another shape: say so, keep the rest
            out.append(Row(b.name, "", "", None, "", note=f"result not readable ({type(exc).__name__}: {exc})"[:120]))
    return out


def run(bench: Bench, tiny: bool, extra: list[str]) -> bool:
    """Run one benchmark in its own process; True when it exited 0."""
    args = list(bench.tiny or ()) if tiny else []
    if tiny and bench.tiny is None:
        print(f"[bench] {bench.name}: no quick mode, skipped under --tiny", flush=True)
        return True
    if bench.needs_gpu and not tiny:
        import torch

        if not torch.cuda.is_available():
            print(
                f"[bench] {bench.name}: needs a CUDA GPU, skipped here (bash bench/gpu_check.sh on a GPU machine)",
                flush=True,
            )
            return True
    started = time.monotonic()
    print(f"[bench] {bench.name}: {bench.compares} (~{bench.minutes:g} min)", flush=True)
    code = subprocess.run([sys.executable, "-m", f"bench.{bench.name}", *args, *extra], cwd=ROOT).returncode
    print(
        f"[bench] {bench.name}: {'done' if code == 0 else f'FAILED (exit {code})'} in "
        f"{time.monotonic() - started:.0f} s",
        flush=True,
    )
    return code == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", nargs="+", help="all | table | list | benchmark names")
    parser.add_argument("--tiny", action="store_true", help="smoke test on tiny models (results not tabled)")
    parser.add_argument("--skip", default="", help="comma-separated names to leave out of 'all'")
    parser.add_argument("--args", default="", help="extra arguments for a single named benchmark, e.g. '--steps 8'")
    opts = parser.parse_args(argv)
    benches = available()
    by_name = {b.name: b for b in benches}

    if opts.what == ["list"]:
        for b in benches:
            print(f"{b.name:24s} ~{b.minutes:>4g} min  {b.compares}")
        return 0
    if opts.what == ["table"]:
        chosen = []
    elif opts.what == ["all"]:
        skip = set(filter(None, opts.skip.split(",")))
        chosen = [b for b in benches if b.name not in skip]
    else:
        unknown = [w for w in opts.what if w not in by_name]
        if unknown:
            parser.error(
                f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(by_name)} (or all, table, list)"
            )
        chosen = [by_name[w] for w in opts.what]
    if opts.args and len(chosen) != 1:
        parser.error("--args goes with exactly one named benchmark")

    failed = [b.name for b in chosen if not run(b, opts.tiny, shlex.split(opts.args))]
    table = rows(benches)
    update_page(PAGE, table)
    print(f"[bench] table in {PAGE.relative_to(ROOT)} regenerated: {len(table)} rows from bench/results/")
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
