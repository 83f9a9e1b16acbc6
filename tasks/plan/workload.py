"""The workload: what a GRPO run does (model precision, adapter, lengths, batch, steps), the one description
the memory estimate, the search, the pipeline's config adapter and the `plan` command's options all share.

A field that is a TRL `GRPOConfig` setting defaults to TRL's own default, read from the snapshot of that
class (`grpo_pipeline.configs.library_fields`), so an unset field plans what TRL would run:

    >>> w = Workload(model="qwen2.5-7b")
    >>> w.num_generations, w.completion_tokens, w.optimizer, w.beta
    (8, 512, 'adamw_torch_fused', 0.0)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from grpo_pipeline.configs.dtypes import DType, Quantization
from grpo_pipeline.configs.library_fields import default
from grpo_pipeline.tasks.plan.base import Frozen

Optimizer = Literal[
    "adamw_torch", "adamw_torch_fused", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit"
]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def trl_default(name: str) -> Any:  # the snapshot's JSON value
    """TRL's default for a GRPOConfig field.

    >>> trl_default("per_device_train_batch_size")
    8
    """
    return default("GRPOConfig", name)


class Workload(Frozen):
    """What the run does; the planner chooses how (GPU, count, batch split, checkpointing)."""

    model: str = Field(description="the model's display name")
    quantization: Quantization = Field("none", description="base weights: none | nf4 | fp4 | int8 (bitsandbytes)")
    double_quant: bool = Field(False, description="nested 4-bit quantization (~0.4 bit/param less)")
    dtype: DType = Field("bfloat16", description="compute dtype: bfloat16 | float16 | float32")
    # The adapter the project's recipes train (QLoRA's all-linear), not PEFT's minimal default (r=8 on q/v):
    # a plan given no adapter sizes a run people make. lora_targets=None is PEFT's default.
    lora_rank: int = Field(16, ge=0, description="LoRA rank; 0 = full fine-tuning")
    lora_targets: str | tuple[str, ...] | None = Field(
        "all-linear", description="LoRA targets: all-linear or q_proj,v_proj,..."
    )
    optimizer: Optimizer = Field(
        trl_default("optim"), description="adamw_torch(_fused) | adamw_8bit | paged_adamw_8bit | paged_adamw_32bit"
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="auto | on | off; auto: on only when a prompt's group does not fit without it"
    )
    prompt_tokens: int = Field(256, ge=0, description="prompt length in tokens, chat template included")
    completion_tokens: int = Field(
        trl_default("max_completion_length"), ge=1, description="completion length in tokens (max_completion_length)"
    )
    num_generations: int = Field(trl_default("num_generations"), ge=2, description="completions per prompt")
    effective_batch: int = Field(64, ge=1, description="completions per optimizer step, all GPUs together")
    max_steps: int | None = Field(
        500, ge=1, description="optimizer steps; None: unknown (a local plan does not estimate time)"
    )
    beta: float = Field(
        trl_default("beta"), ge=0, description="KL coefficient (full fine-tuning keeps a reference copy when > 0)"
    )
    vllm: bool = Field(trl_default("use_vllm"), description="generate with colocated vLLM")
