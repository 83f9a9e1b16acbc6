"""What dynamic sampling costs the shipped recipe, and whether the carried groups keep what it buys: the demo recipe
(`configs/demo-cpu.yaml`) in three arms that differ only in `train.dynamic_sampling`, over the same seeds:

- `off`: no dynamic sampling (the baseline of the cost: each step generates the groups it trains on);
- `fixed`: dynamic sampling as the recipe ships it: each step generates `oversample` (2) times its groups and
  drops the spare mixed ones;
- `carried`: `carry=true adaptive=true`: the spare mixed groups trained on at the next step, the extra groups
  following the measured share of mixed groups (`grpo_pipeline.trainer.dynamic_sampling`).

Reported: each arm's train time (the trainer's `train_runtime_s`: the same model load in every arm, no evaluation)
against `off`'s on the same seed, the goal being `carried` at most 1.15x; the holdout's skill (`correct_answer`) per
seed and `carried` against `fixed` paired by seed (mean difference and its 95 % t-interval over seeds): the carried
groups must not lose accuracy. Runs go two side by side at one thread each, arms interleaved by seed, so the load
falls on every arm alike; each finished run is kept (`.grpo/bench-dynamic_cost/runs.json`) and skipped when the
benchmark runs again; a work folder of another recipe or code version is refused (exit 2).

    python -m bench.dynamic_cost                       # 3 arms x 5 seeds, about 75 min on 2 quiet cores
    python -m bench.dynamic_cost --seeds 0 1 --arms fixed carried
    python -m bench.dynamic_cost --tiny                # 2 steps a run: does the chain run?
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness import ROOT, MixedWorkFolder, fingerprint, keep_runs, open_work, pipeline_run, prune_weights, save
from bench.table import Row

NAME = "dynamic_cost"
WORK = ROOT / ".grpo" / f"bench-{NAME}"
RECIPE = ROOT / "configs" / "demo-cpu.yaml"
SKILL = "correct_answer"
ARMS = {
    "off": ["train.dynamic_sampling.enabled=false"],
    "fixed": [],
    "carried": ["train.dynamic_sampling.carry=true", "train.dynamic_sampling.adaptive=true"],
}
GOAL = 1.15  # carried's train time against off's, at most
CODE = ("trainer", "configs/sampling.py", "bench/dynamic_cost.py")
TINY = ["train.grpo.max_steps=2", "promote.min_samples=1", "data.demo.n_holdout=16"]


def schedule(arms: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """The runs in the order they start: seed by seed, the arms of a seed together.

    >>> schedule(["off", "carried"], [0, 1])
    [('off', 0), ('carried', 0), ('off', 1), ('carried', 1)]
    """
    return [(arm, seed) for seed in seeds for arm in arms]


def paired(runs: dict, arm: str, against: str, field: str) -> dict | None:
    """`arm` against `against` on `field`, seed by seed where both ran: the per-seed ratios (train time) and
    differences (skill), the mean ratio, and the mean difference with its 95 % t-interval (None under 2 seeds).

    >>> runs = {"off/0": {"t": 10.0}, "carried/0": {"t": 11.0}, "off/1": {"t": 10.0}, "carried/1": {"t": 12.0}}
    >>> r = paired(runs, "carried", "off", "t")
    >>> r["seeds"], r["ratios"], round(r["mean_ratio"], 2), r["mean_diff"]
    ([0, 1], [1.1, 1.2], 1.15, 1.5)
    >>> paired(runs, "fixed", "off", "t") is None
    True
    """
    from scipy import stats

    seeds = sorted(
        int(k.split("/")[1]) for k in runs if k.startswith(f"{arm}/") and f"{against}/{k.split('/')[1]}" in runs
    )
    if not seeds:
        return None
    a = [runs[f"{arm}/{s}"][field] for s in seeds]
    b = [runs[f"{against}/{s}"][field] for s in seeds]
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    out = {
        "seeds": seeds,
        "ratios": [round(x / y, 3) for x, y in zip(a, b, strict=True)],
        "mean_ratio": statistics.mean(x / y for x, y in zip(a, b, strict=True)),
        "mean_diff": statistics.mean(diffs),
        "ci": None,
    }
    if len(seeds) > 1:  # the t interval over seeds, as scipy computes it
        ci = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
        out["ci"] = [float(ci.low), float(ci.high)]
    return out


def measure(summary: dict, seconds: float) -> dict:
    """One run's figures from the pipeline's `--json` summary."""
    train = summary["train"]
    zero = train.get("zero_signal") or {}
    return {
        "skill": summary["holdout"]["trained"][SKILL],
        "base_skill": summary["holdout"]["base"][SKILL],
        "steps": train["global_step"],
        "train_runtime_s": round(train["train_runtime_s"], 1),
        "trained_zero_fraction": zero.get("trained_fraction"),
        "wall_s": round(seconds, 1),
        "timings": summary.get("timings") or {},  # the run's wall seconds by stage
    }


def report(runs: dict) -> dict:
    arms = {arm: sorted(int(k.split("/")[1]) for k in runs if k.split("/")[0] == arm) for arm in ARMS}
    return {
        "arms": {
            arm: {
                "seeds": seeds,
                "skill": [runs[f"{arm}/{s}"]["skill"] for s in seeds],
                "train_runtime_s": [runs[f"{arm}/{s}"]["train_runtime_s"] for s in seeds],
            }
            for arm, seeds in arms.items()
            if seeds
        },
        "time_vs_off": {arm: paired(runs, arm, "off", "train_runtime_s") for arm in ("fixed", "carried")},
        "skill_carried_vs_fixed": paired(runs, "carried", "fixed", "skill"),
        "goal_time_ratio": GOAL,
    }


def _seeds(seeds: list[int]) -> str:
    """
    >>> _seeds([0]), _seeds([0, 1])
    ('1 seed', '2 seeds')
    """
    return f"{len(seeds)} seed{'' if len(seeds) == 1 else 's'}"


def table_rows(load) -> list[Row]:
    r = load(NAME)
    bench = "dynamic sampling's cost: train time against no dynamic sampling, paired by seed (`bench.dynamic_cost`)"
    if r is None:
        return [Row(bench, "off", "carried", None, f"<= {GOAL}", note="not run yet")]
    rows = []
    for arm in ("fixed", "carried"):
        t = r["time_vs_off"].get(arm)
        if t:
            rows.append(
                Row(
                    f"{bench}: {arm}",
                    "no dynamic sampling",
                    f"{arm}, {_seeds(t['seeds'])}",
                    t["mean_ratio"],
                    f"<= {GOAL}" if arm == "carried" else "",
                    spread=(min(t["ratios"]), max(t["ratios"])) if len(t["ratios"]) > 1 else None,
                )
            )
    s = r.get("skill_carried_vs_fixed")
    if s:
        ci = f", 95 % interval {s['ci'][0]:+.3f} to {s['ci'][1]:+.3f}" if s["ci"] else ""
        rows.append(
            Row(
                "the carried groups' holdout skill against the fixed budget's, paired by seed (`bench.dynamic_cost`)",
                "fixed",
                "carried",
                None,
                "",
                note=f"mean difference {s['mean_diff']:+.3f} over {_seeds(s['seeds'])}{ci}",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--side-by-side", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--tiny", action="store_true", help="2 steps a run: the chain, not the figures")
    parser.add_argument("--fresh", action="store_true", help="forget the kept runs and measure all again")
    parser.add_argument("--work", type=Path, default=WORK)
    opts = parser.parse_args(argv)
    work = opts.work / "tiny" if opts.tiny else opts.work
    try:
        state = open_work(work, fingerprint(RECIPE.read_text() + str(opts.tiny), CODE), opts.fresh)
    except MixedWorkFolder as exc:
        print(f"[{NAME}] {exc}", file=sys.stderr)
        return 2

    lock = threading.Lock()  # the two side-by-side runs' threads share the kept state

    def one(arm: str, seed: int) -> None:
        key = f"{arm}/{seed}"
        if key in state["runs"]:
            print(f"[{NAME}] {key}: kept from an earlier run", flush=True)
            return
        sets = [*ARMS[arm], f"train.grpo.seed={seed}", *(TINY if opts.tiny else [])]
        summary, seconds = pipeline_run(work / f"{arm}-{seed}", sets, threads=1, config=RECIPE)
        with lock:
            state["runs"][key] = measure(summary, seconds) | {"overrides": sets}
            keep_runs(work / "runs.json", state)
        prune_weights(work / f"{arm}-{seed}")
        print(f"[{NAME}] {key}: {json.dumps(state['runs'][key])}", flush=True)

    with ThreadPoolExecutor(opts.side_by_side) as pool:
        for future in [pool.submit(one, arm, seed) for arm, seed in schedule(opts.arms, opts.seeds)]:
            future.result()
    result = report(state["runs"]) | {"tiny": opts.tiny, "fingerprint": state["fingerprint"]}
    save(f"{NAME}_tiny" if opts.tiny else NAME, result | {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    for row in table_rows(lambda _name: result):
        print(f"[{NAME}] {row.benchmark}: {row.ratio} {row.note}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
