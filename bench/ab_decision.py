"""The online decision's error rate and speed, on simulated live tests: the A/A false-decision rate under
continuous peeking, and the responses to a decision for three effect sizes, set against the fixed-sample test
that would need its sample size planned in advance (and may not be peeked at).

    python -m bench.ab_decision            # ~1 min; saves bench/results/ab_decision.json
    python -m bench.ab_decision --tiny     # a few simulations: does it run?

Each test: requests arrive one at a time, half to the challenger (`ab.challenger_fraction=0.5`), each scored
thumbs up or down (champion 50 % up); the decision is looked at after every scored response
(`grpo_pipeline.tasks.serve.ab.sequential_path`, the formula `grpo_pipeline.tasks.serve.ab.decide` uses), and the first look that crosses decides.
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
from scipy import stats

from bench.harness import save, stamp
from bench.table import Row
from grpo_pipeline.configs.ab import ABConfig
from grpo_pipeline.tasks.serve.ab import sequential_path

NAME = "ab_decision"
BASE = 0.5


def fixed_total(delta: float, alpha: float, power: float = 0.8) -> int:
    """Both arms' responses a fixed-sample two-sided z-test needs for `delta` at `power`."""
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return 2 * math.ceil(2 * z**2 * BASE * (1 - BASE) / delta**2)


def simulate(delta: float, runs: int, horizon: int, policy: ABConfig, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    promoted = rolled_back = 0
    stops = []
    for _ in range(runs):
        is_b = rng.random(horizon) < policy.challenger_fraction
        scores = (rng.random(horizon) < np.where(is_b, BASE + delta, BASE)).astype(float)
        theta, log_lr = sequential_path(is_b, scores, policy.alpha, policy.mixture_effect, policy.min_samples)
        crossed = np.nonzero(log_lr >= math.log(1 / policy.alpha))[0]
        if len(crossed):
            first = int(crossed[0])
            promoted += theta[first] > 0
            rolled_back += theta[first] < 0
            stops.append(first + 1)
    return {
        "delta": delta,
        "runs": runs,
        "horizon": horizon,
        "promoted": promoted / runs,
        "rolled_back": rolled_back / runs,
        "decided": len(stops) / runs,
        "median_responses": statistics.median(stops) if stops else None,
        "p90_responses": float(np.percentile(stops, 90)) if stops else None,
    }


def table_rows(load) -> list[Row]:
    r = load(NAME)
    bench = "online A/B decision, simulated thumbs up/down, peeked after every response (`bench.ab_decision`)"
    if r is None:
        return [Row(bench, "", "", None, "<= 5", unit="%", note="not run yet")]
    aa, alpha = r["aa"], r["alpha"]
    rows = [
        Row(
            f"{bench}: A/A false decisions, {aa['runs']:,} tests of {aa['horizon']:,} responses",
            f"stated error rate: alpha {alpha:.0%}",
            f"promote {aa['promoted']:.2%}, rollback {aa['rolled_back']:.2%}",
            100 * aa["decided"],
            f"<= {100 * alpha:g}",
            unit="%",
        )
    ]
    for e in r["effects"]:
        rows.append(
            Row(
                f"A/B decision, +{e['delta']:.2f} thumbs-up rate ({e['runs']} tests, promoted {e['promoted']:.0%}): "
                "responses to a decision, sequential / fixed-sample",
                f"fixed-sample test, 80 % power, planned: {e['fixed_sample_responses']:,}",
                f"sequential, median: {e['median_responses']:,.0f} (p90 {e['p90_responses']:,.0f})",
                e["median_vs_fixed"],
                "",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aa-runs", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--tiny", action="store_true")
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.aa_runs, opts.runs = 20, 10
    policy = ABConfig(challenger_fraction=0.5)
    report = {
        "name": NAME,
        "alpha": policy.alpha,
        "mixture_effect": policy.mixture_effect,
        "min_samples": policy.min_samples,
        "aa": simulate(0.0, opts.aa_runs, 20_000, policy, seed=0),
        "effects": [],
    }
    for delta in (0.05, 0.1, 0.2):
        fixed = fixed_total(delta, policy.alpha)
        result = simulate(delta, opts.runs, 8 * fixed, policy, seed=int(delta * 1000))
        result |= {
            "fixed_sample_responses": fixed,
            "median_vs_fixed": result["median_responses"] / fixed if result["median_responses"] else None,
        }
        report["effects"].append(result)
    aa = report["aa"]
    print(
        f"A/A, {aa['runs']} tests peeked after each of {aa['horizon']:,} responses: false promotion "
        f"{aa['promoted']:.2%}, false rollback {aa['rolled_back']:.2%} (alpha {policy.alpha})"
    )
    for e in report["effects"]:
        print(
            f"+{e['delta']:.2f} thumbs-up rate: promoted {e['promoted']:.0%}, median {e['median_responses']} "
            f"responses (p90 {e['p90_responses']}), fixed-sample test at 80 % power: "
            f"{e['fixed_sample_responses']} ({e['median_vs_fixed']:.2f}x)"
        )
    save(NAME + ("_tiny" if opts.tiny else ""), report | stamp())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
