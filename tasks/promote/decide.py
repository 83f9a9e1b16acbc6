"""The A/B decision: does the candidate beat the baseline (the champion, or the base model) by more than noise?

Candidate and baseline are scored on the same holdout prompts, so the comparison is paired: the mean
per-prompt difference with a 95% paired-bootstrap interval (scipy), plus McNemar's exact test when the
metric is binary. `decide_promotion` is a pure function; its `PromotionDecision` is logged before anything moves.
"""

from __future__ import annotations

import difflib
import math
import statistics
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel
from scipy import stats

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ConfigError, PromotionPolicy

Z_POWER_80 = 0.8416  # one-sided normal quantile for 80% power


class PromotionDecision(BaseModel):
    promote: bool
    reasons: list[str]
    stats: dict


def paired_rows(candidate: list[dict], baseline: list[dict]) -> tuple[list[dict], list[dict]]:
    """Align two evaluations on their prompt keys; refuse to compare different prompt sets.

    >>> c, b = paired_rows([{"key": "2"}, {"key": "1"}], [{"key": "1"}, {"key": "2"}])
    >>> [r["key"] for r in c] == [r["key"] for r in b]
    True
    """
    by_key = {r["key"]: r for r in baseline}
    if set(by_key) != {r["key"] for r in candidate}:
        raise ValueError("candidate and baseline were evaluated on different prompts; a paired test needs the same")
    candidate = sorted(candidate, key=lambda r: str(r["key"]))
    return candidate, [by_key[r["key"]] for r in candidate]


def paired_difference(cand: list[float], base: list[float], confidence: float, seed: int = 0) -> dict:
    """Mean of candidate - baseline per prompt, its paired-bootstrap interval, and McNemar for 0/1 data."""
    c, b = np.asarray(cand, dtype=float), np.asarray(base, dtype=float)
    diff = c - b
    out: dict = {
        "n": len(diff),
        "mean_candidate": float(c.mean()),
        "mean_baseline": float(b.mean()),
        "mean_diff": float(diff.mean()),
    }
    if np.all(diff == diff[0]):  # no spread: the bootstrap interval collapses to the point
        out["ci_low"] = out["ci_high"] = float(diff[0])
    else:
        res = stats.bootstrap(
            (c, b),
            lambda x, y: np.mean(x - y),
            paired=True,
            vectorized=False,
            confidence_level=confidence,
            method="percentile",
            rng=np.random.default_rng(seed),
            n_resamples=4999,
        )
        out["ci_low"], out["ci_high"] = float(res.confidence_interval.low), float(res.confidence_interval.high)
    sd = float(diff.std(ddof=1)) if len(diff) > 1 else 0.0
    z = stats.norm.ppf(1 - (1 - confidence) / 2)
    # The smallest true effect this holdout would detect 80% of the time (normal approximation).
    out["min_detectable_effect"] = (z + Z_POWER_80) * sd / math.sqrt(len(diff)) if len(diff) else math.inf
    if set(np.unique(np.concatenate([c, b]))) <= {0.0, 1.0}:
        wins, losses = int(((c == 1) & (b == 0)).sum()), int(((c == 0) & (b == 1)).sum())
        p = stats.binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
        out["mcnemar"] = {"candidate_only": wins, "baseline_only": losses, "p_value": float(p)}
    return out


def check_policy(policy: PromotionPolicy, columns: list[str]) -> None:
    """The policy compares and guards only columns the evaluation writes (`grpo_pipeline.tasks.evaluate.score_columns`): a
    typo would otherwise end the run at the decision, after training, with a KeyError.

    >>> check_policy(PromotionPolicy(metric="math_answr"), ["math_answer", "total", "length"])
    Traceback (most recent call last):
    ...
    grpo_pipeline.configs.schema.ConfigError: promote.metric: 'math_answr' is not a column of the evaluation (math_answer, total, length); did you mean 'math_answer'?
    """
    named = [("promote.metric", policy.metric), *((f"promote.guardrails.{k}", k) for k in policy.guardrails)]
    for field, column in named:
        if column not in columns:
            close = difflib.get_close_matches(column, columns, n=1)
            raise ConfigError(
                f"{field}: {column!r} is not a column of the evaluation ({', '.join(columns)})"
                + (f"; did you mean '{close[0]}'?" if close else "")
            )


def decide_promotion(
    candidate: list[dict],
    baseline: list[dict],
    policy: PromotionPolicy,
    rewards: RewardSet | Sequence[str] = (),
    evaluation_complete: bool = True,
) -> PromotionDecision:
    """Promote only when the interval's lower bound clears the minimum effect and no guardrail regresses.

    `candidate` and `baseline` are per-sample rows (`key`, the primary metric, each guarded column);
    every reward of `rewards` (the run's RewardSet, or its names alone) is guarded with `policy.reward_tolerance`
    unless `policy.guardrails` names it.
    """
    # reward -> its weight in the total; names alone weigh 1.0 each, as TRL's default
    weights = (
        dict(zip(rewards.names, rewards.weights, strict=True))
        if isinstance(rewards, RewardSet)
        else dict.fromkeys(rewards, 1.0)
    )
    reasons: list[str] = []
    if not evaluation_complete or not candidate:
        return PromotionDecision(promote=False, reasons=["the evaluation did not complete"], stats={})
    cand, base = paired_rows(candidate, baseline)
    primary = paired_difference([r[policy.metric] for r in cand], [r[policy.metric] for r in base], policy.confidence)
    summary = {policy.metric: primary, "guardrails": {}}
    win = primary["ci_low"] > policy.min_effect
    reasons.append(
        f"{policy.metric}: {primary['mean_candidate']:.3f} vs {primary['mean_baseline']:.3f}, difference "
        f"{primary['mean_diff']:+.3f} ({policy.confidence:.0%} CI {primary['ci_low']:+.3f} to {primary['ci_high']:+.3f}); "
        + ("lower bound clears" if win else "lower bound does not clear")
        + f" the minimum effect {policy.min_effect:+.3f}"
    )
    if primary["n"] < policy.min_samples:
        reasons.append(
            f"warning: {primary['n']} paired prompts detect only effects of {primary['min_detectable_effect']:.3f} "
            f"or more (80% power); use at least {policy.min_samples}"
        )
    guards_ok = True
    guardrails = {name: policy.reward_tolerance for name in weights} | policy.guardrails
    for column, tolerance in guardrails.items():
        c_mean = statistics.fmean(r[column] for r in cand)
        b_mean = statistics.fmean(r[column] for r in base)
        # Lengths regress upward (rambling), and so do rewards the total counts against; other rewards and rates
        # regress downward.
        if column == "length":
            regression, unit = (c_mean - b_mean) / max(b_mean, 1e-9), "relative increase"
        elif weights.get(column, 1.0) < 0:
            regression, unit = c_mean - b_mean, "rise (its weight is negative)"
        else:
            regression, unit = b_mean - c_mean, "drop"
        summary["guardrails"][column] = {
            "candidate": c_mean,
            "baseline": b_mean,
            "regression": regression,
            "tolerance": tolerance,
        }
        if regression > tolerance:
            guards_ok = False
            reasons.append(f"guardrail {column}: {unit} {regression:.3f} exceeds tolerance {tolerance:.3f}")
    return PromotionDecision(promote=win and guards_ok, reasons=reasons, stats=summary)
