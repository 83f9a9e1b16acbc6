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


def test_a_clear_win_promotes():
    decision = decide_promotion(
        _rows(_coin(0.8, 200, 1)), _rows(_coin(0.3, 200, 2)), POLICY, RewardSet(names=("correct_answer",))
    )
    assert decision.promote, decision.reasons
    stats = decision.stats["total"]
    assert stats["ci_low"] > 0 and stats["mcnemar"]["p_value"] < 0.001


def test_a_win_inside_the_noise_does_not_promote():
    base = _coin(0.5, 40, 3)
    cand = list(base)
    cand[base.index(0)] = 1  # one more right answer out of 40
    decision = decide_promotion(_rows(cand), _rows(base), POLICY)
    assert not decision.promote
    assert decision.stats["total"]["mean_diff"] > 0 and decision.stats["total"]["ci_low"] <= 0
    assert any("detect only effects" in r for r in decision.reasons)


def test_a_guardrail_regression_blocks_a_win():
    cand, base = _rows(_coin(0.9, 200, 4), length=10), _rows(_coin(0.2, 200, 5), length=2)
    decision = decide_promotion(cand, base, POLICY)
    assert not decision.promote
    assert any("guardrail length" in r for r in decision.reasons)


def test_a_reward_guardrail_blocks_when_another_reward_carries_the_total():
    base = [{"key": i, "total": 1.0, "fmt": 1.0, "ok": 0.0, "length": 1} for i in range(200)]
    cand = [
        {"key": i, "total": 1.5, "fmt": 0.5 if i % 2 else 1.0, "ok": 1.0 if i % 2 else 0.5, "length": 1}
        for i in range(200)
    ]
    decision = decide_promotion(cand, base, POLICY, rewards=RewardSet(names=("fmt", "ok")))
    assert not decision.promote
    assert any(r.startswith("guardrail fmt") for r in decision.reasons)
    assert decide_promotion(cand, base, POLICY, rewards=["fmt", "ok"]) == decision  # the names alone: weighed 1.0


def test_a_reward_the_total_counts_against_regresses_when_it_rises():
    """A negative weight: the total gains when the reward falls, so its guardrail reads a rise as the regression."""
    base = [{"key": i, "total": 1.0, "ok": 1.0, "verbose": 0.5, "length": 1} for i in range(200)]
    fell = [{**r, "total": 1.4, "verbose": 0.1} for r in base]
    rose = [{**r, "total": 1.4, "ok": 1.8, "verbose": 0.9} for r in base]
    rewards = RewardSet(names=("ok", "verbose"), weights=(1.0, -1.0))
    assert decide_promotion(fell, base, POLICY, rewards).promote  # less of what the total counts against
    blocked = decide_promotion(rose, base, POLICY, rewards)
    assert not blocked.promote
    assert "guardrail verbose: rise (its weight is negative) 0.400 exceeds tolerance 0.050" in blocked.reasons
    assert not decide_promotion(fell, base, POLICY, ["ok", "verbose"]).promote  # names alone: the fall is a drop


def test_a_failed_evaluation_blocks():
    decision = decide_promotion([], _rows([1, 0]), POLICY, evaluation_complete=False)
    assert not decision.promote and decision.reasons == ["the evaluation did not complete"]


def test_different_prompt_sets_are_refused():
    with pytest.raises(ValueError, match="different prompts"):
        decide_promotion(_rows([1, 1]), _rows([1, 1, 0]), POLICY)


def test_interval_covers_the_true_difference():
    stats = paired_difference([1.0] * 60 + [0.0] * 40, [1.0] * 40 + [0.0] * 60, confidence=0.95)
    assert stats["ci_low"] < 0.2 < stats["ci_high"]
    assert stats["mcnemar"] == {"candidate_only": 20, "baseline_only": 0, "p_value": pytest.approx(2 * 0.5**20)}


def test_the_pipelines_decide_stage_judges_by_the_runs_reward_set_whole(monkeypatch):
    """The flow's decide stage hands the decision the run's RewardSet, weights included, not its names alone: a
    reward the total counts against (negative weight) that fell is no regression (names alone would read a drop)."""
    from types import SimpleNamespace

    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.flows.stages import promote
    from grpo_pipeline.tasks.evaluate import EvalResult

    logged: dict = {}
    fake = SimpleNamespace(log_dict=lambda obj, name: logged.__setitem__(name, obj), set_tags=logged.update)
    monkeypatch.setattr(promote, "mlflow", fake)
    base = [{"key": i, "total": 1.0, "ok": 1.0, "verbose": 0.5, "length": 1} for i in range(200)]
    fell = [{**r, "total": 1.4, "verbose": 0.1} for r in base]
    rewards = RewardSet(names=("ok", "verbose"), weights=(1.0, -1.0))
    cfg = PipelineConfig.model_validate({"promote": {"min_samples": 100}})

    def result(rows: list[dict]) -> EvalResult:
        return EvalResult(reward=rows[0]["total"], per_reward={}, n=len(rows), rows=rows)

    decision = promote.decide_stage(cfg, rewards, result(fell), result(base))
    assert decision.promote, decision.reasons
    assert logged["decision"] == "promote" and logged["decision.json"] == decision.model_dump()
