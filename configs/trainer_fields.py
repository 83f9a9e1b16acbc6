"""The `train.*` fields the trainer itself reads, declared once: their types, defaults, bounds and descriptions.

`grpo_pipeline.configs.train.TrainConfig` (the pipeline's `train` section) and the job spec's
`grpo_pipeline.trainer.spec.TrainSettings` (what a node runs) both build on `TrainerFields`, so a field the
trainer reads cannot be renamed, retyped or given another default on one side alone; the job spec adds the rewards
resolved (`RewardSet`) and reads specs of older versions, the config adds what the launch needs. Pure pydantic,
importing nothing of the project but the sections it holds (`layout.py`, `health.py`, `sampling.py`) and
`base.py`, so the trainer, which a node runs alone, may import it (tests/unit/test_layers.py holds it so).
`train.grpo` and `train.lora` are checked against TRL's and PEFT's fields in `configs/train.py`, where the
pipeline reads them; the trainer hands them to those classes, which check them again.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel
from grpo_pipeline.configs.health import HealthConfig
from grpo_pipeline.configs.layout import DistributedConfig
from grpo_pipeline.configs.sampling import CurriculumConfig, DynamicSamplingConfig


class TrainerFields(StrictModel):
    """What of `train.*` the trainer runs, the rewards apart: TRL's GRPOConfig and PEFT's LoraConfig fields,
    checkpointing, the step's cuts, and the sections it runs as they are."""

    grpo: dict[str, Any] = Field(default_factory=dict, description="passed to trl.GRPOConfig")
    lora: dict[str, Any] = Field(default_factory=dict, description="passed to peft.LoraConfig")
    checkpoint_every: int = Field(10, ge=1, description="steps between checkpoints: the most a preemption loses")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept in the store")
    early_stopping_patience: int | None = Field(
        None, ge=1, description="stop after this many evaluations without a better validation reward"
    )
    # The step's cuts (trainer/step.py): each computes what TRL's path computes. Unset (auto): on where it can apply,
    # TRL's path silently where it cannot; true: on, with one warning naming the setting and why where it cannot;
    # false: TRL's path.
    merged_generation: bool | None = Field(
        None,
        description="sample completions from the LoRA adapter merged into a copy of the base weights (exact: the "
        "base is put back bit for bit; the loss's forward and backward stay unmerged); unset: on where the node "
        "has no GPU (a cheaper decode step there, bench.step_profile), off on GPU nodes (the merged copy costs "
        "the adapted weights' memory again while generating). Cannot apply to a quantized base, a LoRA variant or "
        "bias, a LoRA dropout above 0 (TRL samples in train mode), vLLM or sharded weights: there it samples from "
        "the unmerged adapter, with a warning if set to true (trainer/generation.py)",
    )
    prefill_once: bool | None = Field(
        None,
        description="prefill each distinct prompt once and share its KV cache with the rows that repeat it (TRL "
        "repeats each prompt num_generations times before generate, which prefills every copy); the same decode "
        "batch and sampling draws, so the same completions, log-probs equal to float rounding. Unset: on where it "
        "can apply; it cannot with a static or quantized cache, beam search, assisted or vLLM generation, dropout "
        "while sampling: there generate prefills every row, with a warning if set to true (trainer/generation.py)",
    )
    share_prompt_forward: bool | None = Field(
        None,
        description="the loss's forward and backward run each distinct prompt once and share its keys and values "
        "with the rows that repeat it (TRL runs every copy: num_generations per prompt); the same log-probs, loss "
        "and gradients to float rounding. Unset: on where it can apply; it cannot with gradient checkpointing, "
        "dropout in train mode, DDP/FSDP wrappers, multimodal inputs: there every row runs, with a warning if set "
        "to true (trainer/shared_prompt.py)",
    )
    compact_lm_head: bool | None = Field(
        None,
        description="on a CPU node, TRL's fused LM head projects only the completion's positions onto the vocabulary, "
        "as it does on GPUs (same log-probs and loss; TRL's CPU path projects the prompt's positions too and drops "
        "them). Unset: on where this TRL has the compact branch, with a warning if set to true and it has not "
        "(trainer/lm_head.py)",
    )
    skip_zero_advantage: bool | None = Field(
        None,
        description="a training batch whose advantages are all zero (every group's completions scored alike) runs "
        "no loss forward or backward: its gradient is zero, given to every trainable weight as TRL's backward would "
        "give it, so the optimizer steps as before (exact; the demo's zero-variance batches are a third to a half "
        "of its steps). Unset: on where it can apply; it cannot where a zero advantage still has a gradient or "
        "skipping cannot be exact (beta > 0, an entropy bonus, a MoE auxiliary loss, Liger's loss, several "
        "processes): there every batch runs the loss, with a warning if set to true (trainer/zero_advantage.py)",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch's intra-op threads in the trainer (torch.set_num_threads); unset: torch's own choice (the "
        "node's cores), except in a search running hpo.concurrency local trials at once, which gives each trial its "
        "share of the cores (two trials of one thread each on 2 cores: 0.67-0.71x the wall time of one after the "
        "other at two threads, docs/training.md#hyperparameter-search)",
    )
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, SeaweedFS); AWS when unset")
    distributed: DistributedConfig = Field(
        DistributedConfig(),
        description="several training processes (GPUs) and nodes: see docs/training.md#training-on-many-gpus",
    )
    health: HealthConfig = Field(
        HealthConfig(),
        description="collapse and reward-hacking guards: warn, stop or roll back (docs/training.md#health-rules)",
    )
    curriculum: CurriculumConfig = Field(
        CurriculumConfig(), description="prompts without reward variance sit out (docs/training.md#fewer-wasted-steps)"
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        DynamicSamplingConfig(),
        description="over-generate groups and train on those with reward variance (docs/training.md#dynamic-sampling)",
    )
