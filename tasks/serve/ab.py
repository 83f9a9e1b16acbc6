"""The online decision between `champion` and `challenger`, as a pure function of what the request log holds.

`decide(champion, challenger, policy, elapsed_h) -> ABDecision` with `ABDecision.action` one of

- `rollback`: a guardrail is breached (latency, errors, completion length), or the test finds the challenger
  worse; the challenger alias goes off and all traffic returns to the champion;
- `promote`: the test finds the challenger better; it becomes `champion`;
- `stop`: `ab.max_duration_h` has passed without a difference; the champion stays;
- `continue`: not enough evidence yet.

The test is a two-sided normal-mixture sequential probability ratio test (mSPRT; Robbins 1970, Johari, Pekelis
and Walsh, "Always valid inference", 2017) on the difference of the arms' mean feedback scores. Its mixture
likelihood ratio is a nonnegative martingale under "no difference", so by Ville's inequality it crosses 1/alpha
with probability at most alpha *at any time, ever*: the decision may run hourly, or after every request, and
the false-decision rate stays at alpha (a fixed-sample t-test rerun at each look would not). It is a few lines
over NumPy/SciPy here rather than a dependency: the libraries that do it (`confseq`, last release 2023;
`savvi`, 2024; `seqabpy`, `expectation`) are small, single-maintainer projects, and the formula is closed-form.

With the per-arm sample means m_A, m_B, variances s_A^2, s_B^2 and sizes n_A, n_B:
    theta = m_B - m_A,   V = s_A^2 / n_A + s_B^2 / n_B,   tau = mixture_effect * pooled sd
    Lambda = sqrt(V / (V + tau^2)) * exp(theta^2 tau^2 / (2 V (V + tau^2)))
and the (1 - alpha) confidence sequence for the difference is theta +- sqrt(2 V (V + tau^2) / tau^2 *
(log(1/alpha) + log(sqrt((V + tau^2) / V)))). The variances are estimated (a plug-in; exact validity is
asymptotic), which is why the test waits for `ab.min_samples` scored responses per arm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel

from grpo_pipeline.configs.ab import ABConfig
from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION, AliasMove, plan_promotion

if TYPE_CHECKING:
    from grpo_pipeline.tasks.promote.registry import AliasMove, Registry

Action = Literal["promote", "rollback", "continue", "stop"]
ARMS = ("champion", "challenger")
Sums = float | np.ndarray  # an arm's count, sum or sum of squares: one look's, or one per look


@dataclass(frozen=True)
class ArmSample:
    """One arm's requests and scored outcomes, as read from the request log.

    `latency_s`, `completion_tokens` and `error` have one entry per request; `scores` one per feedback (joined
    to its request), in any order. Non-finite scores never reach here (the store refuses them)."""

    latency_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    completion_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    error: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    scores: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def of(
        cls, latency_s: ArrayLike = (), completion_tokens: ArrayLike = (), error: ArrayLike = (), scores: ArrayLike = ()
    ) -> ArmSample:
        out = cls(
            np.asarray(latency_s, dtype=float),
            np.asarray(completion_tokens, dtype=float),
            np.asarray(error, dtype=bool),
            np.asarray(scores, dtype=float),
        )
        if not (len(out.latency_s) == len(out.completion_tokens) == len(out.error)):
            raise ValueError(
                "ArmSample: latency_s, completion_tokens and error need one entry per request "
                f"(got {len(out.latency_s)}, {len(out.completion_tokens)}, {len(out.error)})"
            )
        if not np.all(np.isfinite(out.scores)):
            raise ValueError("ArmSample.scores: a score is NaN or infinite; the feedback store refuses those")
        return out

    @property
    def requests(self) -> int:
        return int(len(self.error))


class ArmSummary(BaseModel):
    requests: int
    scored: int
    mean_score: float | None
    error_rate: float | None
    latency_p95_s: float | None  # over answered (error-free) requests
    mean_completion_tokens: float | None


class TestStatistics(BaseModel):
    difference: float | None = None  # challenger mean score minus champion's
    interval: tuple[float, float] | None = None  # (1 - alpha) confidence sequence for the difference
    likelihood_ratio: float | None = None  # the mixture likelihood ratio Lambda
    p_value: float | None = None  # always-valid p-value at this look: min(1, 1 / Lambda)
    threshold: float  # 1 / alpha: Lambda at or above it decides


class ABDecision(BaseModel):
    action: Action
    reasons: list[str]
    arms: dict[str, ArmSummary]
    test: TestStatistics
    breaches: list[str] = []  # the guardrails that fired (their names), empty when none
    elapsed_h: float


def summarize(arm: ArmSample) -> ArmSummary:
    answered = arm.latency_s[~arm.error]
    return ArmSummary(
        requests=arm.requests,
        scored=int(len(arm.scores)),
        mean_score=float(arm.scores.mean()) if len(arm.scores) else None,
        error_rate=float(arm.error.mean()) if arm.requests else None,
        latency_p95_s=float(np.percentile(answered, 95)) if len(answered) else None,
        mean_completion_tokens=float(arm.completion_tokens[~arm.error].mean()) if len(answered) else None,
    )


def _mixture(
    n_a: Sums, s_a: Sums, ss_a: Sums, n_b: Sums, s_b: Sums, ss_b: Sums, alpha: float, mixture_effect: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(difference, log Lambda, half-width of the confidence sequence) from each arm's count, sum and sum of
    squares; scalars or arrays alike (`sequential_path` passes running sums, one entry per look)."""
    n_a, n_b = np.asarray(n_a, dtype=float), np.asarray(n_b, dtype=float)
    mean_a, mean_b = s_a / n_a, s_b / n_b
    var_a = np.maximum(ss_a - n_a * mean_a**2, 0.0) / (n_a - 1)
    var_b = np.maximum(ss_b - n_b * mean_b**2, 0.0) / (n_b - 1)
    pooled = ((n_a - 1) * var_a + (n_b - 1) * var_b) / (n_a + n_b - 2)
    # A floor keeps two constant arms (all thumbs up) from dividing by zero; far below any real variance.
    floor = 1e-12 * np.maximum(1.0, np.maximum(np.abs(mean_a), np.abs(mean_b)))
    v = np.maximum(var_a / n_a + var_b / n_b, floor)
    tau2 = np.maximum(mixture_effect**2 * pooled, floor)
    theta = mean_b - mean_a
    log_lr = 0.5 * np.log(v / (v + tau2)) + theta**2 * tau2 / (2 * v * (v + tau2))
    half = np.sqrt(2 * v * (v + tau2) / tau2 * (math.log(1 / alpha) + 0.5 * np.log((v + tau2) / v)))
    return theta, log_lr, half


def msprt(
    champion_scores: np.ndarray, challenger_scores: np.ndarray, alpha: float, mixture_effect: float
) -> TestStatistics:
    """The normal-mixture SPRT of "equal means" at this look (formulas in the module docstring).

    >>> s = msprt(np.array([0., 1.] * 200), np.array([1., 1., 1., 0.] * 100), alpha=0.05, mixture_effect=0.2)
    >>> round(s.difference, 2), s.likelihood_ratio > 20, s.interval[0] > 0
    (0.25, True, True)
    """
    threshold = 1.0 / alpha
    a, b = np.asarray(champion_scores, dtype=float), np.asarray(challenger_scores, dtype=float)
    if len(a) < 2 or len(b) < 2:
        return TestStatistics(threshold=threshold)
    theta, log_lr, half = (
        float(x)
        for x in _mixture(len(a), a.sum(), (a * a).sum(), len(b), b.sum(), (b * b).sum(), alpha, mixture_effect)
    )
    likelihood_ratio = math.exp(min(log_lr, 700.0))  # exp overflows past ~709; beyond 1e304 it decides the same
    return TestStatistics(
        difference=theta,
        interval=(theta - half, theta + half),
        likelihood_ratio=likelihood_ratio,
        p_value=min(1.0, 1.0 / likelihood_ratio),
        threshold=threshold,
    )


def sequential_path(
    is_challenger: np.ndarray, scores: np.ndarray, alpha: float, mixture_effect: float, min_samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """The test after every scored response of a stream (in arrival order): (difference, log Lambda) per look,
    NaN before both arms have `min_samples`. What a decision run after every response would see; the
    simulations and the benchmark use it to find the first look that decides, then ask `decide` there."""
    is_b = np.asarray(is_challenger, dtype=bool)
    x = np.asarray(scores, dtype=float)
    n_b = np.cumsum(is_b)
    n_a = np.arange(1, len(x) + 1) - n_b
    s_a, s_b = np.cumsum(np.where(is_b, 0.0, x)), np.cumsum(np.where(is_b, x, 0.0))
    ss_a, ss_b = np.cumsum(np.where(is_b, 0.0, x * x)), np.cumsum(np.where(is_b, x * x, 0.0))
    ready = np.minimum(n_a, n_b) >= max(min_samples, 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        theta, log_lr, _ = _mixture(n_a, s_a, ss_a, n_b, s_b, ss_b, alpha, mixture_effect)
    return np.where(ready, theta, np.nan), np.where(ready, log_lr, np.nan)


def guardrail_breaches(champion: ArmSummary, challenger: ArmSummary, policy: ABConfig) -> list[tuple[str, str]]:
    """(guardrail name, reason) for each bound the challenger is outside; none before both arms have
    `ab.guardrails.min_requests` requests (a handful of requests says nothing about a p95)."""
    g = policy.guardrails
    if min(champion.requests, challenger.requests) < g.min_requests:
        return []
    out = []
    error_gap = (challenger.error_rate or 0.0) - (champion.error_rate or 0.0)
    if error_gap > g.error_rate_margin:
        out.append(
            (
                "error_rate",
                f"challenger error rate {challenger.error_rate:.3f} is {error_gap:.3f} above the "
                f"champion's {champion.error_rate:.3f} (allowed: ab.guardrails.error_rate_margin="
                f"{g.error_rate_margin})",
            )
        )
    if challenger.latency_p95_s is not None and champion.latency_p95_s:
        ratio = challenger.latency_p95_s / champion.latency_p95_s
        if ratio > g.latency_p95_ratio_max:
            out.append(
                (
                    "latency_p95_ratio",
                    f"challenger p95 latency {challenger.latency_p95_s:.3f}s is "
                    f"{ratio:.2f}x the champion's {champion.latency_p95_s:.3f}s (allowed: "
                    f"ab.guardrails.latency_p95_ratio_max={g.latency_p95_ratio_max})",
                )
            )
    if (
        g.latency_p95_max_s is not None
        and challenger.latency_p95_s is not None
        and challenger.latency_p95_s > g.latency_p95_max_s
    ):
        out.append(
            (
                "latency_p95_max_s",
                f"challenger p95 latency {challenger.latency_p95_s:.3f}s is above "
                f"ab.guardrails.latency_p95_max_s={g.latency_p95_max_s}",
            )
        )
    if challenger.mean_completion_tokens is not None and champion.mean_completion_tokens:
        ratio = challenger.mean_completion_tokens / champion.mean_completion_tokens
        if not g.completion_tokens_ratio_min <= ratio <= g.completion_tokens_ratio_max:
            out.append(
                (
                    "completion_tokens",
                    f"challenger mean completion {challenger.mean_completion_tokens:.1f} "
                    f"tokens is {ratio:.2f}x the champion's "
                    f"{champion.mean_completion_tokens:.1f} (allowed: "
                    f"{g.completion_tokens_ratio_min}..{g.completion_tokens_ratio_max}, "
                    "ab.guardrails.completion_tokens_ratio_min/max)",
                )
            )
    return out


def decide(champion: ArmSample, challenger: ArmSample, policy: ABConfig, elapsed_h: float) -> ABDecision:
    """Guardrails first (a breach rolls back whatever the scores say), then the sequential test once both arms
    have `ab.min_samples` scores, then the clock (`ab.max_duration_h`)."""
    arms = {"champion": summarize(champion), "challenger": summarize(challenger)}
    test = msprt(champion.scores, challenger.scores, policy.alpha, policy.mixture_effect)

    def made(action: Action, reasons: list[str], breaches: Sequence[str] = ()) -> ABDecision:
        return ABDecision(
            action=action, reasons=reasons, arms=arms, test=test, breaches=list(breaches), elapsed_h=elapsed_h
        )

    breaches = guardrail_breaches(arms["champion"], arms["challenger"], policy)
    if breaches:
        return made("rollback", [reason for _, reason in breaches], [name for name, _ in breaches])
    scored = min(arms["champion"].scored, arms["challenger"].scored)
    if scored >= policy.min_samples and test.likelihood_ratio is not None and test.likelihood_ratio >= test.threshold:
        assert test.interval is not None and test.difference is not None  # set with the likelihood ratio
        low, high = test.interval
        better = test.difference > 0
        return made(
            "promote" if better else "rollback",
            [
                f"challenger {'better' if better else 'worse'} by {test.difference:+.4f} in mean score "
                f"({1 - policy.alpha:.0%} always-valid interval {low:+.4f}..{high:+.4f}; likelihood ratio "
                f"{test.likelihood_ratio:.3g} >= 1/alpha = {test.threshold:.3g})"
            ],
        )
    if elapsed_h >= policy.max_duration_h:
        return made(
            "stop",
            [
                f"{elapsed_h:.1f} h reached ab.max_duration_h={policy.max_duration_h} without a "
                "difference; the champion stays"
                + (
                    f" (only {scored} scored responses in the smaller arm, ab.min_samples={policy.min_samples})"
                    if scored < policy.min_samples
                    else ""
                )
            ],
        )
    if scored < policy.min_samples:
        return made(
            "continue",
            [f"{scored} scored responses in the smaller arm, fewer than ab.min_samples={policy.min_samples}"],
        )
    ratio = test.likelihood_ratio if test.likelihood_ratio is not None else 0.0
    return made("continue", [f"no difference yet: likelihood ratio {ratio:.3g} below 1/alpha = {test.threshold:.3g}"])


# ------------------------------------------------------------------------------------------------ the aliases


class AliasesMoved(RuntimeError):
    """The champion or challenger changed between reading the log and moving the aliases."""


def plan_ab_moves(action: Action, champion: str | None, challenger: str) -> list:
    """Alias moves for an online decision: promote makes the challenger champion (the champion it replaces kept
    as previous-champion, so `grpo-pipeline rollback` undoes it); rollback takes the challenger alias off, so
    all traffic returns to the champion; continue and stop move nothing.

    >>> plan_ab_moves("promote", "3", "4")
    [AliasMove(alias='previous-champion', version='3'), AliasMove(alias='champion', version='4'), AliasMove(alias='challenger', version=None)]
    >>> plan_ab_moves("rollback", "3", "4"), plan_ab_moves("stop", "3", "4")
    ([AliasMove(alias='challenger', version=None)], [])
    """
    if action == "promote":
        return plan_promotion(champion, challenger, promote=True)
    if action == "rollback":
        return [AliasMove(CHALLENGER, None)]
    return []


def settle(registry: Registry, decision: ABDecision, champion: str | None, challenger: str) -> list[AliasMove]:
    """Move the aliases for `decision` under the registry's lock, unless they moved since the log was read
    (then the decision was about other versions: `AliasesMoved`, nothing moves)."""
    moves = plan_ab_moves(decision.action, champion, challenger)
    if not moves:
        return []
    with registry.lock():
        now = registry.aliases()
        if (now[CHAMPION], now[CHALLENGER]) != (champion, challenger):
            raise AliasesMoved(
                f"the aliases moved since the decision was made (champion {champion} -> "
                f"{now[CHAMPION]}, challenger {challenger} -> {now[CHALLENGER]}); run "
                "`grpo-pipeline ab decide` again"
            )
        tag = {"ab_decision": decision.action, "ab_reason": "; ".join(decision.reasons)[:500]}
        registry.tag(challenger, tag)
        return registry.apply(moves)
