"""What every part of the planner shares: its error, frozen value models, the GiB."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from grpo_pipeline.configs.schema import ConfigError

GIB = 2**30


class PlanError(ConfigError):
    """The planner cannot answer for these inputs (unknown model, nothing fits); the message says what to change."""


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
