"""The gate's pairing is unchanged by the baseline cache: on the tiny random model, a baseline's scores read back
from the cache are the freshly computed ones, row for row in the holdout's order and keys, and the promotion
decision against them is the same; the champion's adapter, downloaded afresh, is found by its content."""

import shutil

import pytest

from grpo_pipeline.configs.promote import PromotionPolicy
from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import EvalConfig, ModelConfig
from grpo_pipeline.tasks.baseline_cache import baseline_scores
from grpo_pipeline.tasks.evaluate import evaluate_model, read_jsonl
from grpo_pipeline.tasks.promote.decide import decide_promotion
from tests.tiny_model import create_random_adapter

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two tiny flows: make test-slow

REWARDS = RewardSet(entries=["correct_answer", {"name": "number_only", "weight": 0.2}])
CFG = EvalConfig(engine="transformers", max_new_tokens=6, batch_size=3)


def test_cached_baseline_scores_give_the_same_rows_and_decision(tiny_model, tiny_splits, tmp_path):
    holdout = tiny_splits["holdout"]
    adapter = create_random_adapter(tiny_model, tmp_path / "champion-adapter", seed=1)
    candidate = evaluate_model(
        str(tiny_model), ModelConfig(), holdout, REWARDS, CFG, str(create_random_adapter(tiny_model, tmp_path / "c", 2))
    )
    policy = PromotionPolicy(min_effect=-10, reward_tolerance=10, guardrails={})

    def scored(adapter_dir, evaluate):
        return baseline_scores(
            evaluate,
            data_dir=tmp_path / "data",
            model_path=str(tiny_model),
            model_cfg=ModelConfig(),
            holdout=holdout,
            rewards=REWARDS,
            cfg=CFG,
            adapter=adapter_dir,
            label="champion v1" if adapter_dir else "base",
        )

    def not_again():
        raise AssertionError("the cache held these scores: nothing is evaluated again")

    for baseline_adapter in (None, str(adapter)):
        fresh = evaluate_model(str(tiny_model), ModelConfig(), holdout, REWARDS, CFG, baseline_adapter)  # cache off
        first = scored(baseline_adapter, lambda f=fresh: f.model_copy(deep=True))  # a miss: computed, then kept
        if baseline_adapter:  # the champion is downloaded into each run's directory: same bytes, new files
            baseline_adapter = str(shutil.copytree(adapter, tmp_path / "run2" / "champion-adapter"))
        second = scored(baseline_adapter, not_again)
        assert (first.cached, second.cached) == (False, True)
        assert second.rows == fresh.rows  # each prompt's completion and scores, in the holdout's order and keys
        assert [r["key"] for r in second.rows] == [r["key"] for r in read_jsonl(holdout)]
        assert (second.reward, second.per_reward, second.metrics, second.examples) == (
            fresh.reward,
            fresh.per_reward,
            fresh.metrics,
            fresh.examples,
        )
        with_cache = decide_promotion(candidate.rows, second.rows, policy, REWARDS)
        without = decide_promotion(candidate.rows, fresh.rows, policy, REWARDS)
        assert with_cache == without
