"""The A/B decision: does the candidate beat the baseline (the champion, or the base model) by more than noise?

Candidate and baseline are scored on the same holdout prompts, so the comparison is paired: the mean
per-prompt difference with a 95% paired-bootstrap interval (scipy), plus McNemar's exact test when the
metric is binary. `decide_promotion` is a pure function; its `PromotionDecision` is logged before anything moves.
"""

from __future__ import annotations

import difflib
import math
import statistics

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


def compared(policy: PromotionPolicy, rewards: RewardSet) -> str:
    """The column the gate compares: `promote.metric`, or the skill reward when it is unset.

    >>> rs = RewardSet(names=("correct_answer", "number_only"))
    >>> compared(PromotionPolicy(), rs), compared(PromotionPolicy(metric="total"), rs)
    ('correct_answer', 'total')
    """
    return policy.metric or rewards.skill


def check_policy(policy: PromotionPolicy, columns: list[str], rewards: RewardSet) -> None:
    """The policy compares and guards only columns the evaluation writes (`grpo_pipeline.tasks.evaluate.score_columns`): a
    typo would otherwise end the run at the decision, after training, with a KeyError.

    >>> rs = RewardSet(names=("math_answer",))
    >>> check_policy(PromotionPolicy(metric="math_answr"), ["math_answer", "total", "length"], rs)
    Traceback (most recent call last):
    ...
    grpo_pipeline.configs.schema.ConfigError: promote.metric: 'math_answr' is not a column of the evaluation (math_answer, total, length); did you mean 'math_answer'?
    """
    named = [
        ("promote.metric", compared(policy, rewards)),
        *((f"promote.guardrails.{k}", k) for k in policy.guardrails),
    ]
    for field, column in named:
        if column not in columns:
            close = difflib.get_close_matches(column, columns, n=1)
            raise ConfigError(
                f"{field}: {column!r} is not a column of the evaluation ({', '.join(columns)})"
                + (f"; did you mean '{close[0]}'?" if close else "")
            )


def shaping_metric_warning(policy: PromotionPolicy, rewards: RewardSet) -> str | None:
    """A gate that compares a shaping reward passes a candidate that learned the format alone: said in the report,
    never a silent pass.

    >>> rs = RewardSet(names=("correct_answer", "number_only"))
    >>> print(shaping_metric_warning(PromotionPolicy(metric="number_only"), rs))
    warning: promote.metric=number_only is a shaping reward (format or length, learned in a few steps whatever the skill does); the task's skill is correct_answer: unset promote.metric to judge it
    """
    if policy.metric not in rewards.shaping:
        return None
    return (
        f"warning: promote.metric={policy.metric} is a shaping reward (format or length, learned in a few steps "
        f"whatever the skill does); the task's skill is {rewards.skill}: unset promote.metric to judge it"
    )


def _guard(column: str, cand: list[dict], base: list[dict], weight: float, tolerance: float, confidence: float) -> dict:
    """One guarded column's regression: lengths regress upward as a relative increase (rambling); a reward the
    total counts against (negative weight) regresses when it rises; other rewards, rates and the total when they
    drop. A reward or the total blocks when its drop exceeds the tolerance and its paired interval lies wholly on
    the side of the drop (beyond noise); the length by its relative increase alone."""
    c = [float(r[column]) for r in cand]
    b = [float(r[column]) for r in base]
    c_mean, b_mean = statistics.fmean(c), statistics.fmean(b)
    out = {"candidate": c_mean, "baseline": b_mean, "tolerance": tolerance}
    if column == "length":
        regression = (c_mean - b_mean) / max(b_mean, 1e-9)
        return out | {"regression": regression, "unit": "relative increase", "blocks": regression > tolerance}
    diff = paired_difference(c, b, confidence)
    if weight < 0:
        regression, unit, beyond_noise = c_mean - b_mean, "rise (its weight is negative)", diff["ci_low"] > 0
    else:
        regression, unit, beyond_noise = b_mean - c_mean, "drop", diff["ci_high"] < 0
    interval = (diff["ci_low"], diff["ci_high"])
    return out | {
        "regression": regression,
        "unit": unit,
        "interval": interval,
        "blocks": regression > tolerance and beyond_noise,
    }


def decide_promotion(
    candidate: list[dict],
    baseline: list[dict],
    policy: PromotionPolicy,
    rewards: RewardSet,
    evaluation_complete: bool = True,
) -> PromotionDecision:
    """Promote only when the compared column's interval (the skill reward's by default) clears the minimum effect
    and no guardrail regresses.

    `candidate` and `baseline` are per-sample rows (`key`, each reward, `total`, each guarded column). The total
    and every reward of `rewards` are guarded with `policy.reward_tolerance` unless `policy.guardrails` names them:
    a format that fell beyond noise blocks a skill gain, and a skill that did not move blocks whatever the format
    gained (said in one reason, the report's line).
    """
    if not evaluation_complete or not candidate:
        return PromotionDecision(promote=False, reasons=["the evaluation did not complete"], stats={})
    metric = compared(policy, rewards)
    reasons: list[str] = []
    cand, base = paired_rows(candidate, baseline)
    primary = paired_difference([r[metric] for r in cand], [r[metric] for r in base], policy.confidence)
    summary: dict = {metric: primary, "metric": metric, "skill": rewards.skill, "guardrails": {}}
    win = primary["ci_low"] > policy.min_effect
    role = " (the skill)" if metric == rewards.skill else ""
    reasons.append(
        f"{metric}{role}: {primary['mean_candidate']:.3f} vs {primary['mean_baseline']:.3f}, difference "
        f"{primary['mean_diff']:+.3f} ({policy.confidence:.0%} CI {primary['ci_low']:+.3f} to {primary['ci_high']:+.3f}); "
        + ("lower bound clears" if win else "lower bound does not clear")
        + f" the minimum effect {policy.min_effect:+.3f}"
    )
    if warning := shaping_metric_warning(policy, rewards):
        reasons.append(warning)
    if primary["n"] < policy.min_samples:
        reasons.append(
            f"warning: {primary['n']} paired prompts detect only effects of {primary['min_detectable_effect']:.3f} "
            f"or more (80% power); use at least {policy.min_samples}"
        )
    guards_ok = True
    weights = dict(zip(rewards.names, rewards.weights, strict=True))
    guarded = [name for name in ("total", *rewards.names) if name != metric]
    guardrails = dict.fromkeys(guarded, policy.reward_tolerance) | policy.guardrails
    for column, tolerance in guardrails.items():
        guard = _guard(column, cand, base, weights.get(column, 1.0), tolerance, policy.confidence)
        unit, blocks = guard.pop("unit"), guard.pop("blocks")
        summary["guardrails"][column] = guard
        if blocks:
            guards_ok = False
            reasons.append(f"guardrail {column}: {unit} {guard['regression']:.3f} exceeds tolerance {tolerance:.3f}")
    if not win and metric == rewards.skill and "total" in guardrails:
        total = summary["guardrails"]["total"]
        if total["candidate"] > total["baseline"]:
            gained = [
                f"{name} {g['baseline']:.3f} -> {g['candidate']:.3f}"
                for name in rewards.shaping
                if (g := summary["guardrails"].get(name)) and g["candidate"] > g["baseline"]
            ]
            summary["shaping_only"] = (
                f"not promoted: the skill ({metric}) did not improve beyond noise, although the total rose "
                f"{total['baseline']:.3f} -> {total['candidate']:.3f}"
                + (f" (shaping: {', '.join(gained)})" if gained else "")
            )
            reasons.append(summary["shaping_only"])
    return PromotionDecision(promote=win and guards_ok, reasons=reasons, stats=summary)
