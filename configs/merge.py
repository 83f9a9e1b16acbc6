"""`merge.*`: merging the adapter into a full-precision copy of the base, verified against base + adapter."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel


class MergeConfig(StrictModel):
    """Merge the adapter into a full-precision copy of the base, for serving without PEFT."""

    enabled: bool = Field(False, description="merged weights are as large as the base: off for the CPU demo")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="never 4-bit: merging into quantized weights loses the adapter's precision"
    )
    verify_prompts: int = Field(8, ge=1, description="holdout prompts whose logits must match base + adapter")
    tolerance: float = Field(1e-3, gt=0, description="largest allowed |logit difference|, merged vs unmerged")
