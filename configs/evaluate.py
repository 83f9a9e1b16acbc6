"""`evaluate.*`: how the candidate and the champion (or the base) are scored on the holdout: the engine, greedy
and sampled completions, and which training rewards say right and well formed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel


class EvalConfig(StrictModel):
    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto", description="auto: vLLM on a CUDA GPU when the [gpu] extra is installed, else batched transformers"
    )
    max_new_tokens: int = Field(
        16,
        ge=1,
        description="greedy completion length; for reasoning, train.grpo.max_completion_length (what "
        "overlong_penalty measures against here)",
    )
    batch_size: int = Field(32, ge=1, description="prompts per generate() call; more = faster, more memory")
    samples_k: int = Field(0, ge=0, description="sampled completions per prompt for pass@k; 0 = greedy only")
    temperature: float = Field(
        0.8, gt=0, description="sampling temperature for pass@k and the search's sampled trial score"
    )
    seed: int = Field(0, description="sampling seed: the candidate and the champion draw alike")
    accuracy_reward: str | None = Field(
        "correct_answer",
        description="the training reward that says a completion is right (accuracy: its mean); "
        "math_answer for reasoning recipes",
    )
    format_reward: str | None = Field(
        "number_only",
        description="the training reward that says a completion is well formed (format_rate); "
        "think_format for reasoning recipes",
    )
    examples: int = Field(
        3, ge=0, description="right and as many wrong holdout completions kept per model for the report"
    )
    cache_baseline: bool = Field(
        True,
        description="keep the baseline's (base or champion) per-prompt holdout scores under data_dir/baseline-scores "
        "and reuse them while the model, holdout, settings, rewards and code are the same; false: score it every run",
    )
