"""`promote.*`: the offline gate (`grpo_pipeline.tasks.promote.decide`): the paired comparison on the holdout, its
guardrails, and whether a passing candidate becomes champion at once or challenger for the online A/B."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel


class PromotionPolicy(StrictModel):
    """When a candidate may replace the baseline (the champion, or the base model when there is none)."""

    metric: str | None = Field(
        None,
        description="per-prompt column compared: unset, the skill reward (train.rewards' answer checker); 'total' (the "
        "weighted sum) or a reward name. The total and the shaping rewards are guarded either way; naming a shaping "
        "reward here warns in the report (a format is learned in a few steps whatever the skill does)",
    )
    min_effect: float = Field(0.0, description="the confidence interval's lower bound must exceed this")
    confidence: float = Field(0.95, gt=0.5, lt=1)
    min_samples: int = Field(
        100, ge=1, description="fewer paired prompts than this adds a warning with the detectable effect"
    )
    guardrails: dict[str, float] = Field(
        default_factory=lambda: {"length": 0.5},
        description="column -> tolerated regression: a reward's drop, or 'length' as a relative increase",
    )
    reward_tolerance: float = Field(
        0.05,
        ge=0,
        description="tolerated drop of the total and of each reward not listed in guardrails; a drop blocks when it "
        "exceeds this and its paired interval lies below zero (beyond noise)",
    )
    mode: Literal["offline", "canary"] = Field(
        "offline",
        description="offline: a candidate that passes becomes champion at once. canary: it becomes challenger and "
        "the online A/B (`ab-decide`) promotes or rolls it back; a newer passing candidate replaces a "
        "running challenger (the test restarts); with no champion yet it becomes champion directly",
    )
