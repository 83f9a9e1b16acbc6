"""Fewer wasted steps, two mechanisms against groups with no reward variance, on the demo and on
`configs/gsm8k-calc-cpu.yaml`:

- the curriculum sampler (`train.curriculum`): arms `on` vs `off` at equal steps, and so equal wall time (it adds
  no generation: a benched prompt's slot goes to another prompt, the step costs the same);
- DAPO-style dynamic sampling (`train.dynamic_sampling`, oversample 2, curriculum off): arm `dynamic` at the
  recipe's steps, and arm `off_equal_time`: no dynamic sampling, no curriculum, run for the steps that `off`'s
  measured time per step buys in `dynamic`'s train time. Dynamic sampling makes each step dearer (it generates
  twice the groups), so equal steps would flatter it; giving the plain trainer the same train time, spent on
  more steps (more prompts, more updates) rather than cutting `dynamic` short, keeps the dynamic arm at the
  recipe as shipped and asks the question a user has: for the same time, which adapter is better? Train time
  (the trainer's `train_runtime_s`), not wall time, sets the budget: evaluation and the flow's other stages cost
  both arms the same. The trainer's figure includes its model load (seconds, the same in both arms), so at the
  recipes' 32-40 steps the step count is a few percent generous to `off_equal_time`; with --tiny's 2 steps it
  is mostly load, and the count only shows the chain runs.

For each recipe, two variants: `shipped` (the recipe as it is: each prompt is drawn about once, so the
curriculum cannot act and both of its arms should agree; per-step resampling can still help there) and
`recurring` (a small training set, so prompts come round 2-3 times in the same steps: where the curriculum
acts). Reported per arm: the fraction of zero-signal groups (TRL's `frac_reward_zero_std`, mean over steps:
with dynamic sampling, over every generated group) and, for `dynamic`, over the groups trained on
(`dynamic_sampling/trained_zero_std`); the steps where every group had zero variance; the holdout reward of
the trained adapter (`math_answer` / the demo's summed reward, greedy, the pipeline's own evaluation); wall
time and train time.

    python -m bench.zero_signal                          # all 16 runs, ~3 h on a quiet 2-core machine
    python -m bench.zero_signal --arms off dynamic off_equal_time --variants shipped   # dynamic sampling alone
    python -m bench.zero_signal --recipes demo --variants recurring
    python -m bench.zero_signal --recipes demo --variants shipped --arms off dynamic --seeds 1 2   # more seeds
    python -m bench.zero_signal --tiny                   # 2 steps per run: does the chain run?

`--seeds` (default: the recipes' own seed, 0) sets `train.grpo.seed`: the LoRA init, the order prompts are drawn
in and the sampling, not the data split, so every seed scores on the same holdout. One seed's holdout can move by
more than an arm's effect; the table has a row per seed and, where two or more seeds finished, their mean.

Resumable: each finished run is kept in .grpo/bench-zero_signal/runs.json (by recipe, variant and arm) and
skipped when the script is run again (pass --fresh to measure all again); arms run alternately
(on, off, dynamic, off_equal_time per pair) so a machine's changing load falls on all of them; `off_equal_time`
needs `off` and `dynamic` of its pair finished (kept or run now). GSM8K's rows come from `bench.gsm8k_calc`'s
prepared slice (../shared/data/gsm8k; skipped with a note when it is absent).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from bench.harness import ROOT, add_threads_option, keep_runs, load_runs, pipeline_run, save, torch_threads
from bench.table import Row

NAME = "zero_signal"
WORK = ROOT / ".grpo" / f"bench-{NAME}"
RECIPES = ("demo", "gsm8k")
VARIANTS = ("shipped", "recurring")
ARMS = ("on", "off", "dynamic", "off_equal_time")
DEFAULT_SEED = 0  # train.grpo.seed in both recipes
RECURRING_ROWS = 32  # distinct training prompts in the `recurring` variant: 2 prompts a step -> a pass per 16 steps


def recurring_subset(source: Path, out: Path, rows: int, seed: int = 0) -> Path:
    """`rows` distinct questions of a prepared JSONL (one occurrence each), written to `out`.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "t.jsonl").write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\\n" for q in "aabcd"))
    >>> picked = [json.loads(line)["question"] for line in recurring_subset(d / "t.jsonl", d / "s.jsonl", 3).read_text().splitlines()]
    >>> len(picked), len(set(picked)), set(picked) <= set("abcd")
    (3, 3, True)
    """
    seen: dict[str, dict] = {}
    for line in source.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            seen.setdefault(row["question"], row)
    chosen = sorted(random.Random(seed).sample(sorted(seen), min(rows, len(seen))))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(seen[q]) + "\n" for q in chosen))
    return out


def overrides(
    recipe: str, variant: str, arm: str, tiny: bool, steps: int | None = None, seed: int = DEFAULT_SEED
) -> list[str]:
    """The `--set` overrides of one run (the gsm8k recipe's data paths are `bench.gsm8k_calc.run_pipeline`'s);
    `steps`: the `off_equal_time` arm's step count (`equal_time_steps`); a `seed` other than the recipes' own.

    >>> overrides("demo", "recurring", "off", False)
    ['train.curriculum.enabled=false', 'data.demo.n_train=32']
    >>> overrides("demo", "shipped", "dynamic", False)
    ['train.curriculum.enabled=false', 'train.dynamic_sampling.enabled=true']
    >>> overrides("demo", "shipped", "off_equal_time", False, steps=61)
    ['train.curriculum.enabled=false', 'train.grpo.max_steps=61']
    >>> overrides("demo", "shipped", "off", False, seed=2)
    ['train.curriculum.enabled=false', 'train.grpo.seed=2']
    """
    sets = [f"train.curriculum.enabled={'true' if arm == 'on' else 'false'}"]
    if arm == "dynamic":
        sets.append("train.dynamic_sampling.enabled=true")
    if recipe == "demo" and variant == "recurring":
        sets.append(f"data.demo.n_train={RECURRING_ROWS}")
    if tiny:
        sets += ["train.grpo.max_steps=2", "promote.min_samples=1"]
        sets.append("data.demo.n_holdout=16" if recipe == "demo" else "data.holdout_share=0.01")
    if arm == "off_equal_time":
        if steps is None:
            raise ValueError("the off_equal_time arm needs its step count")
        sets.append(f"train.grpo.max_steps={steps}")  # after --tiny's: the last --set wins
    if seed != DEFAULT_SEED:
        sets.append(f"train.grpo.seed={seed}")
    return sets


def run_key(recipe: str, variant: str, arm: str, seed: int, tiny: bool) -> str:
    """A run's key in runs.json; the recipes' own seed keeps the key runs of earlier versions were kept under.

    >>> run_key("demo", "shipped", "off", 0, False), run_key("demo", "shipped", "off", 2, True)
    ('demo/shipped/off', 'demo/shipped/off@seed2/tiny')
    """
    return f"{recipe}/{variant}/{arm}{'' if seed == DEFAULT_SEED else f'@seed{seed}'}{'/tiny' if tiny else ''}"


def pair_key(key: str) -> tuple[str, str]:
    """(pair, arm) of a run key without its `/tiny` tail: runs of one seed make one pair.

    >>> pair_key("demo/shipped/dynamic"), pair_key("demo/shipped/dynamic@seed2")
    (('demo/shipped', 'dynamic'), ('demo/shipped seed 2', 'dynamic'))
    """
    recipe, variant, arm = key.split("/")[:3]
    arm, _, seed = arm.partition("@seed")
    return f"{recipe}/{variant}{f' seed {seed}' if seed else ''}", arm


def equal_time_steps(off: dict, dynamic: dict) -> int:
    """Steps of the plain trainer that fill `dynamic`'s train time, at `off`'s measured time per step.

    >>> equal_time_steps({"steps": 40, "train_runtime_s": 800.0}, {"steps": 40, "train_runtime_s": 1300.0})
    65
    """
    per_step = off["train_runtime_s"] / off["steps"]
    return max(1, round(dynamic["train_runtime_s"] / per_step))


def measure(summary: dict, seconds: float) -> dict:
    """One run's figures from the pipeline's `--json` summary."""
    decision = summary.get("decision") or {}
    stats = decision.get("stats") or {}
    metric = next((k for k in stats if k != "guardrails"), None)
    train = summary["train"]
    zero = train.get("zero_signal") or {}
    return {
        "zero_fraction": zero.get("mean_fraction"),
        "wasted_steps": zero.get("wasted_steps"),
        "logged_steps": zero.get("logged_steps"),
        "skipped_draws": zero.get("skipped_draws"),
        "trained_zero_fraction": zero.get("trained_fraction"),  # dynamic sampling: flat groups among those trained
        "trained_wasted_steps": zero.get("trained_wasted_steps"),
        "holdout_metric": metric,
        "holdout_reward": stats[metric]["mean_candidate"] if metric else None,
        "base_reward": stats[metric]["mean_baseline"] if metric else None,
        "steps": train["global_step"],
        # with a validation split the published adapter is the best validation step's, maybe not the last one's
        "best_step": train.get("best_step"),
        "best_val_reward": train.get("best_val_reward"),
        "health": [f"{e['rule']}@{e['step']}: {e.get('taken') or e['action']}" for e in train.get("health") or []],
        "train_runtime_s": round(train["train_runtime_s"], 1),
        "wall_s": round(seconds, 1),
        "load_1min": os.getloadavg()[0],
    }


def table_rows(load) -> list[Row]:
    r = load(NAME)
    bench = "fewer wasted steps: curriculum sampler off vs on, equal steps (`bench.zero_signal`)"
    if r is None:
        return [Row(bench, "off", "on", None, "", note="not run yet")]
    rows = []
    for key, pair in sorted(r["pairs"].items()):
        off, on = pair.get("off"), pair.get("on")
        if not (off and on) or off["zero_fraction"] is None or on["zero_fraction"] is None:
            continue
        ratio = on["zero_fraction"] / off["zero_fraction"] if off["zero_fraction"] else None
        rows.append(
            Row(
                f"{bench}, {key}: zero-signal fraction",
                f"off: {off['zero_fraction']:.3f} ({off['wasted_steps']} wasted steps)",
                f"on: {on['zero_fraction']:.3f} ({on['wasted_steps']} wasted steps)",
                ratio,
                "<= 1",
                note=(
                    f"holdout {off['holdout_reward']:.3f} -> {on['holdout_reward']:.3f}; wall {off['wall_s'] / 60:.1f} vs "
                    f"{on['wall_s'] / 60:.1f} min"
                )
                if off["holdout_reward"] is not None and on["holdout_reward"] is not None
                else "",
            )
        )
    dynamic_bench = (
        "fewer wasted steps: dynamic sampling (oversample 2) vs plain, equal train time (`bench.zero_signal`)"
    )
    for key, pair in sorted(r["pairs"].items()):
        off, dyn, equal = pair.get("off"), pair.get("dynamic"), pair.get("off_equal_time")
        if not (off and dyn) or off["zero_fraction"] is None or dyn["trained_zero_fraction"] is None:
            continue
        ratio = dyn["trained_zero_fraction"] / off["zero_fraction"] if off["zero_fraction"] else None
        holdout = (
            f"holdout at equal train time {equal['holdout_reward']:.3f} ({equal['steps']} steps) -> "
            f"{dyn['holdout_reward']:.3f} ({dyn['steps']} steps); "
            if equal and equal["holdout_reward"] is not None and dyn["holdout_reward"] is not None
            else ""
        )
        rows.append(
            Row(
                f"{dynamic_bench}, {key}: zero-signal fraction of trained groups",
                f"off: {off['zero_fraction']:.3f} ({off['wasted_steps']} wasted steps)",
                f"dynamic: {dyn['trained_zero_fraction']:.3f} trained, {dyn['zero_fraction']:.3f} generated "
                f"({dyn['trained_wasted_steps']} wasted steps)",
                ratio,
                "<= 1",
                note=f"{holdout}{_published(off, dyn)}train {off['train_runtime_s'] / 60:.1f} vs "
                f"{dyn['train_runtime_s'] / 60:.1f} min",
            )
        )
    rows += _seed_means(r["pairs"], dynamic_bench)
    return rows or [Row(bench, "off", "on", None, "", note="no pair finished")]


def _published(off: dict, dyn: dict) -> str:
    """Which step's adapter each arm published (the best validation reward's), when the runs recorded it."""
    if "best_step" not in off or "best_step" not in dyn:
        return ""
    return f"published steps {off['best_step'] or off['steps']} vs {dyn['best_step'] or dyn['steps']}; "


def _seed_means(pairs: dict, bench: str) -> list[Row]:
    """Per recipe and variant with two or more seeds where `off` and `dynamic` both finished: their mean holdout
    rewards (the ratio dynamic / off) and the spread of the per-seed ratios.

    >>> pairs = {"d/s": {"off": {"holdout_reward": 1.0}, "dynamic": {"holdout_reward": 0.5}},
    ...          "d/s seed 1": {"off": {"holdout_reward": 1.0}, "dynamic": {"holdout_reward": 1.5}}}
    >>> [(r.ratio, r.spread, r.verdict) for r in _seed_means(pairs, "b")]
    [(1.0, (0.5, 1.5), 'seeds disagree')]
    """
    by_base: dict[str, list[tuple[float, float]]] = {}
    for key, pair in sorted(pairs.items()):
        off, dyn = pair.get("off"), pair.get("dynamic")
        if off and dyn and off["holdout_reward"] is not None and dyn["holdout_reward"] is not None:
            by_base.setdefault(key.split(" seed ")[0], []).append((off["holdout_reward"], dyn["holdout_reward"]))
    rows = []
    for base, seeds in by_base.items():
        if len(seeds) < 2:
            continue
        off_mean = statistics.fmean(o for o, _ in seeds)
        dyn_mean = statistics.fmean(d for _, d in seeds)
        per_seed = [d / o for o, d in seeds if o]
        rows.append(
            Row(
                f"{bench}, {base}: holdout reward at the recipe's steps, mean of {len(seeds)} seeds",
                f"off: {off_mean:.3f}",
                f"dynamic: {dyn_mean:.3f}",
                dyn_mean / off_mean if off_mean else None,
                ">= 1",
                spread=(min(per_seed), max(per_seed)) if per_seed else None,
                # a mean above 1 while some seed lost is not a gain the table may call met
                note="seeds disagree" if per_seed and min(per_seed) < 1 < max(per_seed) else "",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    from bench.gsm8k_calc import GSM8K, OUT, prepare, run_pipeline

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[DEFAULT_SEED], help="train.grpo.seed of each pair (default: 0)"
    )
    parser.add_argument("--tiny", action="store_true", help="2 steps per run: the chain, not the figures")
    parser.add_argument("--fresh", action="store_true", help="forget finished runs and measure all again")
    parser.add_argument("--gsm8k", type=Path, default=GSM8K)
    add_threads_option(parser)
    opts = parser.parse_args(argv)

    gsm8k = None
    recipes = list(opts.recipes)
    if "gsm8k" in recipes:
        try:
            paths = prepare(opts.gsm8k, OUT)
            subset = recurring_subset(paths["train"], WORK / "gsm8k-recurring.jsonl", RECURRING_ROWS)
            gsm8k = {"train": paths["train"], "test": paths["test"], "recurring": subset}
        except FileNotFoundError as exc:
            print(f"[{NAME}] gsm8k skipped: {exc}", flush=True)
            recipes.remove("gsm8k")
    threads = torch_threads(opts.threads)
    runs = load_runs(WORK / "runs.json", opts.fresh)
    for recipe, variant, seed in itertools.product(recipes, opts.variants, opts.seeds):
        for arm in [a for a in ARMS if a in opts.arms]:  # alternating arms within each pair
            key = run_key(recipe, variant, arm, seed, opts.tiny)
            if key in runs:
                print(f"[{NAME}] {key}: kept from an earlier run", flush=True)
                continue
            steps = None
            if arm == "off_equal_time":
                off = runs.get(run_key(recipe, variant, "off", seed, opts.tiny))
                dyn = runs.get(run_key(recipe, variant, "dynamic", seed, opts.tiny))
                if not (off and dyn):
                    print(f"[{NAME}] {key}: skipped, it needs the off and dynamic arms of its pair", flush=True)
                    continue
                steps = equal_time_steps(off, dyn)
            sets = overrides(recipe, variant, arm, opts.tiny, steps, seed)
            work = WORK / key.replace("/", "-").replace("@", "-")
            started = time.monotonic()
            if recipe == "gsm8k":  # configs/gsm8k-calc-cpu.yaml on the prepared rows (or their subset)
                data = {"train": gsm8k["recurring" if variant == "recurring" else "train"], "test": gsm8k["test"]}
                summary, seconds = run_pipeline(data, work, sets, threads)
            else:
                summary, seconds = pipeline_run(work, sets, threads)
            runs[key] = measure(summary, seconds) | {"overrides": sets, "threads": threads}
            keep_runs(WORK / "runs.json", runs)
            print(f"[{NAME}] {key}: {json.dumps(runs[key])} ({(time.monotonic() - started) / 60:.1f} min)", flush=True)
    pairs: dict[str, dict] = {}
    for key, figures in runs.items():
        if key.endswith("/tiny") == opts.tiny:
            pair, arm = pair_key(key)
            pairs.setdefault(pair, {})[arm] = figures
    report = {
        "name": NAME,
        "tiny": opts.tiny,
        "pairs": pairs,
        "machine": {"cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    save(f"{NAME}_tiny" if opts.tiny else NAME, report)
    for row in table_rows(lambda _name: report):
        print(f"[{NAME}] {row.benchmark}: {row.baseline} | {row.candidate} | {row.note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
