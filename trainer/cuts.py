"""The step's cuts as data: which ones a job runs (`Cuts`), and each cut's switch (`Switch`).

A switch has three values, as the config's fields have: unset (None, `auto`) runs the cut where it can apply and
falls back to TRL's path silently where it cannot (a vLLM run has nothing to prefill, a LoRA dropout makes a
shared prefill inexact: nothing the user asked for is lost); `true` asks for it, so a fallback says so once,
naming the setting and why; `false` runs TRL's path. `grpo_pipeline.trainer.step.StepTrainer` calls the cuts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_pipeline.configs.sampling import CurriculumConfig, DynamicSamplingConfig

if TYPE_CHECKING:
    from grpo_pipeline.trainer.spec import TrainSettings


@dataclass
class Switch:
    """One cut's setting, as the job gave it, and whether its fallback has been told.

    >>> import logging
    >>> auto, asked = Switch("train.x", None, logging.getLogger("doc")), Switch("train.x", True, logging.getLogger("doc"))
    >>> auto.off, asked.off, Switch("train.x", False, logging.getLogger("doc")).off
    (False, False, True)
    """

    setting: str  # the config field, as the user writes it: `train.prefill_once`
    value: bool | None
    log: logging.Logger
    told: bool = False

    @property
    def off(self) -> bool:
        return self.value is False

    def fall_back(self, doing: str, reason: str) -> None:
        """The cut cannot apply (`reason`) and TRL's path runs (`doing`): one warning if the user asked for the cut,
        one debug line if it was on by default."""
        if self.told:
            return
        self.told = True
        level = logging.WARNING if self.value is True else logging.DEBUG
        self.log.log(level, "%s: %s: %s", self.setting, doing, reason)


@dataclass(frozen=True)
class Cuts:
    """Which of the step's cuts a trainer runs: each switch as in `Switch` (None: where it can apply); the
    sampling cuts by their config, None when off. `Cuts()` is TRL's GRPOTrainer step, unchanged."""

    merged_generation: bool | None = False
    prefill_once: bool | None = False
    share_prompt_forward: bool | None = False
    compact_lm_head: bool | None = False
    skip_zero_advantage: bool | None = False
    curriculum: CurriculumConfig | None = None
    dynamic_sampling: DynamicSamplingConfig | None = None

    @classmethod
    def of(cls, train: TrainSettings) -> Cuts:
        """The cuts a job's settings ask for."""
        return cls(
            merged_generation=train.merged_generation,
            prefill_once=train.prefill_once,
            share_prompt_forward=train.share_prompt_forward,
            compact_lm_head=train.compact_lm_head,
            skip_zero_advantage=train.skip_zero_advantage,
            curriculum=train.curriculum if train.curriculum.enabled else None,
            dynamic_sampling=train.dynamic_sampling if train.dynamic_sampling.enabled else None,
        )
