"""`check.*`: the task check a run makes on the base model before anything trains (`grpo-pipeline task check` makes
it alone): the base's sampled accuracy, the share of prompts whose group holds both a right and a wrong answer
(the only groups GRPO learns from), and a verdict (`grpo_pipeline.tasks.check`, docs/training.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel


class CheckConfig(StrictModel):
    enabled: bool = Field(True, description="measure the task on the base before training; false: nothing runs")
    prompts: int = Field(
        16,
        ge=1,
        description="validation prompts sampled (topped up from train when val is smaller), each num_generations "
        "times: more = tighter intervals, a longer check (the demo's 16: about 20 s on 2 cores)",
    )
    on_too_hard: Literal["refuse", "warn"] = Field(
        "refuse",
        description="refuse: a task with no mixed groups stops the run before training (exit 2); warn: it trains "
        "anyway",
    )
    seed: int = Field(0, description="sampling seed of the check's draws (and which train prompts top up val)")
