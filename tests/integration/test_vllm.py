"""vLLM evaluation (the [gpu] extra on a CUDA machine) must score exactly as batched transformers does.

Skipped where vLLM or a GPU is missing (every CPU machine); a GPU session runs it.
"""

import pytest

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import EvalConfig, ModelConfig
from grpo_pipeline.tasks.evaluate import evaluate_model, vllm_usable

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not vllm_usable(), reason="vLLM and a CUDA GPU are needed")]


def test_vllm_and_transformers_agree_on_greedy_completions(tiny_model, tiny_splits):
    model = ModelConfig(compute_dtype="float32")
    args = (str(tiny_model), model, tiny_splits["holdout"], RewardSet(names=("correct_answer", "number_only")))
    by_vllm = evaluate_model(*args, EvalConfig(engine="vllm", max_new_tokens=6))
    by_hf = evaluate_model(*args, EvalConfig(engine="transformers", max_new_tokens=6))
    assert [r["completion"] for r in by_vllm.rows] == [r["completion"] for r in by_hf.rows]
