"""`plan.*`: the planner's assumptions (GPU memory, GPU choice, batch split, time and cost before training) and the
budget guard (`grpo_pipeline.tasks.plan`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel


class PlanConfig(StrictModel):
    """GPU memory, GPU choice, batch split, time and cost before training (`grpo_pipeline.tasks.plan`), and the budget guard."""

    budget_usd: float | None = Field(
        None, ge=0, description="refuse a run estimated above this many USD; None: no limit"
    )
    gpu_catalog: str | None = Field(None, description="YAML merged over configs/gpus.yaml (your prices, more GPUs)")
    target_effective_batch: int | None = Field(
        None,
        ge=1,
        description="completions per optimizer step; None: per_device_train_batch_size x gradient_accumulation_steps",
    )
    spot: bool | None = Field(
        None, description="price spot GPUs; None: as the launcher rents them (sky: train.sky.use_spot)"
    )
    optimizer: (
        Literal[
            "adamw_torch", "adamw_torch_fused", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit"
        ]
        | None
    ) = Field(None, description="None: train.grpo.optim (TRL's default adamw_torch_fused)")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="auto: off when a group of num_generations fits without it (it costs ~1/3 more compute)"
    )
    prompt_tokens: int = Field(256, ge=1, description="typical prompt length in tokens, chat template included")
    preemption_overhead: float = Field(
        0.10, ge=0, description="expected extra spot GPU-time from preemptions (lost steps, restarts)"
    )
    mfu: float = Field(0.35, gt=0, le=1, description="assumed model FLOPs utilisation for the time estimate")
    daily_projection: bool = Field(True, description="also project the monthly cost of retraining daily")
    allowed_gpus: list[str] | None = Field(
        None,
        description="GPU types to choose from; None: the launcher's GPU options "
        "(sky: train.sky.accelerators, else its task YAML's list)",
    )
