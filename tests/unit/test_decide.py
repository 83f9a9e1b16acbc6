import random

import pytest

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import PromotionPolicy
from grpo_pipeline.tasks.promote.decide import decide_promotion, paired_difference


def _rows(correct: list[int], length: int = 2) -> list[dict]:
    return [
        {"key": f"q{i}", "total": float(c), "correct_answer": float(c), "length": length} for i, c in enumerate(correct)
    ]


def _coin(p: float, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.random() < p) for _ in range(n)]


POLICY = PromotionPolicy(min_samples=100)
ANSWER = RewardSet(names=("correct_answer",))
DEMO = RewardSet(names=("correct_answer", "number_only"))  # the skill and the format


def _demo_rows(correct: list[int], formatted: list[int], length: int = 2) -> list[dict]:
    return [
        {"key": f"q{i}", "correct_answer": float(c), "number_only": float(f), "total": float(c + f), "length": length}
        for i, (c, f) in enumerate(zip(correct, formatted, strict=True))
    ]


def test_a_clear_win_promotes():
    decision = decide_promotion(_rows(_coin(0.8, 200, 1)), _rows(_coin(0.3, 200, 2)), POLICY, ANSWER)
    assert decision.promote, decision.reasons
    stats = decision.stats["correct_answer"]
    assert decision.stats["metric"] == decision.stats["skill"] == "correct_answer"
    assert stats["ci_low"] > 0 and stats["mcnemar"]["p_value"] < 0.001


def test_a_format_only_gain_is_not_promoted_and_says_so_in_one_line():
    """The subtraction run: number_only 1 % -> 100 %, correct_answer 3.9 % -> 4.4 %, the total 0.05 -> 1.04. The
    total's interval is far above zero; the skill's is not, so the gate refuses it, naming why."""
    base_correct = _coin(0.04, 362, 7)
    cand_correct = list(base_correct)
    for i in [i for i, c in enumerate(base_correct) if not c][:2]:  # two more right answers out of 362
        cand_correct[i] = 1
    base = _demo_rows(base_correct, [int(i < 4) for i in range(362)])
    cand = _demo_rows(cand_correct, [1] * 362, length=1)
    decision = decide_promotion(cand, base, POLICY, DEMO)
    assert not decision.promote
    assert decision.stats["correct_answer"]["ci_low"] <= 0 < decision.stats["guardrails"]["total"]["candidate"] - 0.9
    line = decision.stats["shaping_only"]
    assert line in decision.reasons and "\n" not in line
    assert line.startswith("not promoted: the skill (correct_answer) did not improve beyond noise")
    assert line.endswith("(shaping: number_only 0.011 -> 1.000)")  # the shaping rewards that rose, by name
    # judged on the total, as before, the same candidate passes: the default is what refuses it
    assert decide_promotion(cand, base, POLICY.model_copy(update={"metric": "total"}), DEMO).promote


def test_a_skill_gain_with_a_flat_format_is_promoted():
    fmt = [1] * 200
    decision = decide_promotion(_demo_rows(_coin(0.6, 200, 8), fmt), _demo_rows(_coin(0.2, 200, 9), fmt), POLICY, DEMO)
    assert decision.promote, decision.reasons
    assert decision.stats["guardrails"]["number_only"]["regression"] == 0.0 and "shaping_only" not in decision.stats


def test_a_format_that_drops_beyond_noise_blocks_a_skill_gain_and_a_drop_inside_it_does_not():
    correct_base, correct_cand = _coin(0.2, 200, 10), _coin(0.7, 200, 11)
    dropped = decide_promotion(
        _demo_rows(correct_cand, [int(i % 2 == 0) for i in range(200)]),
        _demo_rows(correct_base, [1] * 200),
        POLICY,
        DEMO,
    )
    assert not dropped.promote
    assert "guardrail number_only: drop 0.500 exceeds tolerance 0.050" in dropped.reasons
    # 3 of 40 fewer formatted (0.075 > the tolerance), but the paired interval reaches zero: noise, not a regression
    base_fmt = _coin(0.5, 40, 12)
    cand_fmt = list(base_fmt)
    flips = [i for i, f in enumerate(base_fmt) if f]
    for i in flips[:5]:
        cand_fmt[i] = 0
    for i in [i for i, f in enumerate(base_fmt) if not f][:2]:
        cand_fmt[i] = 1
    noisy = decide_promotion(
        _demo_rows([1] * 40, cand_fmt),
        _demo_rows([0] * 40, base_fmt),
        POLICY.model_copy(update={"min_samples": 1}),
        DEMO,
    )
    guard = noisy.stats["guardrails"]["number_only"]
    assert guard["regression"] == pytest.approx(0.075) and guard["interval"][1] >= 0
    assert noisy.promote, noisy.reasons


def test_a_metric_naming_a_shaping_reward_warns_in_the_reasons():
    fmt_base, fmt_cand = [0] * 200, [1] * 200
    correct = _coin(0.3, 200, 13)
    policy = POLICY.model_copy(update={"metric": "number_only"})
    decision = decide_promotion(_demo_rows(correct, fmt_cand), _demo_rows(correct, fmt_base), policy, DEMO)
    assert decision.promote  # what the operator asked for, but never silently
    assert any(r.startswith("warning: promote.metric=number_only is a shaping reward") for r in decision.reasons)
    assert "the task's skill is correct_answer" in " ".join(decision.reasons)


def test_a_win_inside_the_noise_does_not_promote():
    base = _coin(0.5, 40, 3)
    cand = list(base)
    cand[base.index(0)] = 1  # one more right answer out of 40
    decision = decide_promotion(_rows(cand), _rows(base), POLICY, ANSWER)
    assert not decision.promote
    assert decision.stats["correct_answer"]["mean_diff"] > 0 and decision.stats["correct_answer"]["ci_low"] <= 0
    assert any("detect only effects" in r for r in decision.reasons)


def test_a_guardrail_regression_blocks_a_win():
    cand, base = _rows(_coin(0.9, 200, 4), length=10), _rows(_coin(0.2, 200, 5), length=2)
    decision = decide_promotion(cand, base, POLICY, ANSWER)
    assert not decision.promote
    assert any("guardrail length" in r for r in decision.reasons)


def test_a_reward_guardrail_blocks_when_another_reward_carries_the_total():
    base = [{"key": i, "total": 1.0, "number_only": 1.0, "correct_answer": 0.0, "length": 1} for i in range(200)]
    cand = [
        {
            "key": i,
            "total": 1.5,
            "number_only": 0.5 if i % 2 else 1.0,
            "correct_answer": 1.0 if i % 2 else 0.5,
            "length": 1,
        }
        for i in range(200)
    ]
    decision = decide_promotion(cand, base, POLICY, rewards=DEMO)
    assert not decision.promote
    assert any(r.startswith("guardrail number_only") for r in decision.reasons)


def test_a_reward_the_total_counts_against_regresses_when_it_rises():
    """A negative weight: the total gains when the reward falls, so its guardrail reads a rise as the regression."""
    base = [{"key": i, "total": 1.0, "correct_answer": 0.5, "overlong_penalty": 0.5, "length": 1} for i in range(200)]
    fell = [{**r, "total": 1.4, "correct_answer": 0.6, "overlong_penalty": 0.1} for r in base]
    rose = [{**r, "total": 1.4, "correct_answer": 1.3, "overlong_penalty": 0.9} for r in base]
    rewards = RewardSet(names=("correct_answer", "overlong_penalty"), weights=(1.0, -1.0))
    assert decide_promotion(fell, base, POLICY, rewards).promote  # less of what the total counts against
    blocked = decide_promotion(rose, base, POLICY, rewards)
    assert not blocked.promote
    assert "guardrail overlong_penalty: rise (its weight is negative) 0.400 exceeds tolerance 0.050" in blocked.reasons


def test_a_failed_evaluation_blocks():
    decision = decide_promotion([], _rows([1, 0]), POLICY, ANSWER, evaluation_complete=False)
    assert not decision.promote and decision.reasons == ["the evaluation did not complete"]


def test_different_prompt_sets_are_refused():
    with pytest.raises(ValueError, match="different prompts"):
        decide_promotion(_rows([1, 1]), _rows([1, 1, 0]), POLICY, ANSWER)


def test_interval_covers_the_true_difference():
    stats = paired_difference([1.0] * 60 + [0.0] * 40, [1.0] * 40 + [0.0] * 60, confidence=0.95)
    assert stats["ci_low"] < 0.2 < stats["ci_high"]
    assert stats["mcnemar"] == {"candidate_only": 20, "baseline_only": 0, "p_value": pytest.approx(2 * 0.5**20)}


def test_the_pipelines_decide_stage_judges_by_the_runs_reward_set_whole(monkeypatch):
    """The flow's decide stage hands the decision the run's RewardSet whole, weights and skill included: a reward
    the total counts against (negative weight) that fell is no regression, and the skill is what is compared."""
    from types import SimpleNamespace

    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.flows.stages import promote
    from grpo_pipeline.tasks.evaluate import EvalResult

    logged: dict = {}
    fake = SimpleNamespace(log_dict=lambda obj, name: logged.__setitem__(name, obj), set_tags=logged.update)
    monkeypatch.setattr(promote, "mlflow", fake)
    base = [{"key": i, "total": 1.0, "math_answer": 0.5, "overlong_penalty": 0.5, "length": 1} for i in range(200)]
    fell = [{**r, "total": 1.4, "math_answer": 0.6, "overlong_penalty": 0.1} for r in base]
    cfg = PipelineConfig.model_validate(
        {
            "promote": {"min_samples": 100},
            "train": {"rewards": ["math_answer", {"name": "overlong_penalty", "weight": -1.0}]},
        }
    )

    def result(rows: list[dict]) -> EvalResult:
        return EvalResult(reward=rows[0]["total"], per_reward={}, n=len(rows), rows=rows)

    decision = promote.decide_stage(cfg, result(fell), result(base))
    assert decision.promote, decision.reasons
    assert logged["decision"] == "promote" and logged["decision.json"] == decision.model_dump()
