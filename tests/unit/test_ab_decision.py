"""The online decision (`grpo_pipeline.tasks.serve.ab.decide`) on simulated outcome streams: seeded NumPy, no services, a few seconds.

Each simulated stream is a live test as the log would hold it: requests arrive one at a time, each to the
challenger with probability `challenger_fraction`, each scored by thumbs up (1) or down (0). "Continuous
peeking" means a decision after every scored response: `sequential_path` gives the test's statistic at each of
those looks with the same formula `decide` uses, and at the first look where it crosses 1/alpha the stream's
prefix goes through `decide` itself, whose action is what the test counts.
"""

import math

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from grpo_pipeline.configs.ab import ABConfig, Guardrails
from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.tasks.serve.ab import ArmSample, decide, msprt, sequential_path

POLICY = ABConfig(challenger_fraction=0.5, alpha=0.05, mixture_effect=0.2, min_samples=100)
BASE_RATE = 0.5  # the champion's thumbs-up rate


def arms_of(is_challenger: np.ndarray, scores: np.ndarray, rng, slow: float = 1.0) -> tuple[ArmSample, ArmSample]:
    """Both arms' samples from a stream prefix: every request scored, latencies and lengths alike per arm (times
    `slow` for the challenger's latency)."""
    out = []
    for mask, factor in ((~is_challenger, 1.0), (is_challenger, slow)):
        n = int(mask.sum())
        out.append(
            ArmSample.of(
                latency_s=rng.lognormal(math.log(0.2), 0.3, n) * factor,
                completion_tokens=rng.poisson(40, n),
                error=np.zeros(n, bool),
                scores=scores[mask],
            )
        )
    return out[0], out[1]


def first_decision(rng, delta: float, horizon: int, policy: ABConfig = POLICY):
    """(action, responses seen) at the first look that decides, or ("continue", horizon) if none does."""
    is_b = rng.random(horizon) < policy.challenger_fraction
    scores = (rng.random(horizon) < np.where(is_b, BASE_RATE + delta, BASE_RATE)).astype(float)
    _, log_lr = sequential_path(is_b, scores, policy.alpha, policy.mixture_effect, policy.min_samples)
    crossed = np.nonzero(log_lr >= math.log(1 / policy.alpha))[0]
    stop = int(crossed[0]) + 1 if len(crossed) else horizon
    champion, challenger = arms_of(is_b[:stop], scores[:stop], rng)
    return decide(champion, challenger, policy, elapsed_h=1.0).action, stop


def fixed_horizon_total(delta: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Responses (both arms, even split) a fixed-sample two-sided z-test needs for `delta` at this power:
    the yardstick for a sequential test's sample size."""
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    per_arm = 2 * z**2 * BASE_RATE * (1 - BASE_RATE) / delta**2
    return 2 * math.ceil(per_arm)


def test_a_better_challenger_is_promoted_within_the_expected_sample_size():
    rng = np.random.default_rng(1)
    delta = 0.1  # 50 % -> 60 % thumbs up: 0.2 standard deviations, the mixture's tuning
    expected = fixed_horizon_total(delta)  # 784 responses at 80 % power
    runs = [first_decision(rng, delta, horizon=4 * expected) for _ in range(100)]
    actions = [a for a, _ in runs]
    assert actions.count("promote") >= 97, actions  # measured: 100/100
    # The price of peeking at will: about the fixed test's sample in the median (measured 1.0x), never a multiple
    assert np.median([n for _, n in runs]) <= 1.5 * expected


def test_a_worse_challenger_is_rolled_back():
    rng = np.random.default_rng(2)
    runs = [first_decision(rng, -0.1, horizon=4 * fixed_horizon_total(0.1)) for _ in range(50)]
    assert [a for a, _ in runs].count("rollback") >= 48


def test_equal_arms_watched_after_every_response_are_falsely_promoted_at_most_alpha():
    """400 A/A tests, each looked at after every one of 6,000 responses: the always-valid guarantee. (A t-test
    at 5 % rerun at each look would promote in roughly a third of them.)"""
    rng = np.random.default_rng(3)
    actions = [first_decision(rng, 0.0, horizon=6000)[0] for _ in range(400)]
    assert actions.count("promote") / len(actions) <= POLICY.alpha, actions.count("promote")  # measured 0.75 %
    assert (actions.count("promote") + actions.count("rollback")) / len(actions) <= POLICY.alpha  # both sides


def test_a_slow_challenger_is_rolled_back_even_when_it_scores_better():
    rng = np.random.default_rng(4)
    n = 400
    is_b = np.arange(n) % 2 == 1
    scores = np.where(is_b, 1.0, 0.0)  # the challenger wins every comparison
    champion, challenger = arms_of(is_b, scores, rng, slow=2.0)
    decision = decide(champion, challenger, POLICY, elapsed_h=1.0)
    assert decision.action == "rollback"
    assert decision.breaches == ["latency_p95_ratio"]
    assert "ab.guardrails.latency_p95_ratio_max" in decision.reasons[0]
    assert decision.arms["challenger"].latency_p95_s > 1.5 * decision.arms["champion"].latency_p95_s


def _requests(n, latency=0.2, tokens=40, errors=0, scores=()):
    return ArmSample.of(
        latency_s=[latency] * n,
        completion_tokens=[tokens] * n,
        error=[True] * errors + [False] * (n - errors),
        scores=scores,
    )


def test_errors_and_completion_length_are_guarded_and_named():
    policy = POLICY.model_copy(update={"guardrails": Guardrails(latency_p95_max_s=0.5)})
    champion = _requests(200, errors=2)
    assert decide(champion, _requests(200, errors=10), policy, 1.0).breaches == ["error_rate"]  # 5 % vs 1 %
    assert decide(champion, _requests(200, tokens=100), policy, 1.0).breaches == ["completion_tokens"]
    assert decide(champion, _requests(200, tokens=5), policy, 1.0).breaches == ["completion_tokens"]  # collapse
    assert decide(champion, _requests(200, latency=0.6), policy, 1.0).breaches == [
        "latency_p95_ratio",
        "latency_p95_max_s",
    ]
    assert decide(champion, _requests(200, errors=5), policy, 1.0).action == "continue"  # 2.5 % vs 1 %: in margin


def test_guardrails_wait_for_their_minimum_and_the_test_for_its_sample():
    slow = _requests(50, latency=5.0)
    decision = decide(_requests(50), slow, POLICY, elapsed_h=1.0)
    assert decision.action == "continue" and decision.breaches == []  # 50 < ab.guardrails.min_requests
    assert "ab.min_samples=100" in decision.reasons[0]
    # a huge difference on 20 scores each does not decide before the minimum sample
    early = decide(_requests(20, scores=[0.0] * 20), _requests(20, scores=[1.0] * 20), POLICY, 1.0)
    assert early.action == "continue" and early.test.likelihood_ratio > early.test.threshold


def test_the_clock_stops_an_undecided_test_and_keeps_the_champion():
    rng = np.random.default_rng(5)
    same = rng.random(600) < 0.5
    champion = _requests(300, scores=same[:300].astype(float))
    challenger = _requests(300, scores=same[300:].astype(float))
    assert decide(champion, challenger, POLICY, elapsed_h=10.0).action == "continue"
    stopped = decide(champion, challenger, POLICY, elapsed_h=POLICY.max_duration_h)
    assert stopped.action == "stop" and "ab.max_duration_h" in stopped.reasons[0]
    assert stopped.test.interval[0] < 0 < stopped.test.interval[1]


def test_the_interval_covers_the_difference_and_the_p_value_is_its_dual():
    a, b = np.array([0.0, 1.0] * 500), np.array([1.0, 1.0, 1.0, 0.0] * 250)
    s = msprt(a, b, alpha=0.05, mixture_effect=0.2)
    assert s.interval[0] < 0.25 < s.interval[1] and s.interval[0] > 0  # excludes 0 exactly when Lambda >= 1/alpha
    assert s.p_value == pytest.approx(1 / s.likelihood_ratio) and s.p_value < 0.05
    constant = msprt(np.ones(200), np.ones(200), alpha=0.05, mixture_effect=0.2)  # all thumbs up in both arms
    assert constant.difference == 0 and constant.p_value == 1.0


def test_bad_ab_settings_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="ab.challenger_fraction"):
        load_config(None, ["ab.challenger_fraction=1.5"])
    with pytest.raises(ConfigError, match="ab.alpha"):
        load_config(None, ["ab.alpha=0"])
    with pytest.raises(ValidationError, match="completion_tokens_ratio_min"):
        Guardrails(completion_tokens_ratio_min=3.0, completion_tokens_ratio_max=2.0)
    assert load_config(None, ["ab.challenger_fraction=0.25"]).ab.challenger_fraction == 0.25
    with pytest.raises(ValueError, match="scores"):
        ArmSample.of(scores=[1.0, float("nan")])
