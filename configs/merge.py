"""`merge.*`: merging the adapter into a full-precision copy of the base, verified against base + adapter."""

from __future__ import annotations

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel
from grpo_pipeline.configs.dtypes import DType


class MergeConfig(StrictModel):
    """Merge the adapter into a full-precision copy of the base, for serving without PEFT."""

    enabled: bool = Field(False, description="merged weights are as large as the base: off for the CPU demo")
    dtype: DType = Field(
        "float32", description="never 4-bit: merging into quantized weights loses the adapter's precision"
    )
    verify_prompts: int = Field(8, ge=1, description="holdout prompts whose logits must match base + adapter")
    tolerance: float = Field(1e-3, gt=0, description="largest allowed |logit difference|, merged vs unmerged")
