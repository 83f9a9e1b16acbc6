"""`train.curriculum.*` and `train.dynamic_sampling.*`: which prompts a step trains on, to waste fewer steps on
groups without reward variance (pure pydantic, no I/O).

The trainer's job spec carries both sections as they are (`grpo_pipeline.trainer.spec.TrainSettings`): like
`configs/layout.py`, this module imports nothing else of the project but `configs/base.py` (itself importing nothing
of it), so a node runs it alone.
"""

from __future__ import annotations

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel


class CurriculumConfig(StrictModel):
    """Fewer wasted steps (docs/training.md#fewer-wasted-steps): a prompt whose last group of completions all got
    the same reward (all right or all wrong: no advantage, no gradient) sits out its next passes over the data,
    at most `max_skips` of them, then comes back. Until a prompt recurs, the order is TRL's own
    (`grpo_pipeline.trainer.sampling`)."""

    enabled: bool = Field(True, description="bench prompts whose recent groups had zero reward variance")
    patience: int = Field(1, ge=1, description="zero-variance groups in a row before a prompt is benched")
    max_skips: int = Field(
        2,
        ge=1,
        description="passes over the data a benched prompt sits out before it is drawn "
        "again (the cap: a prompt too hard today may be learnable later)",
    )


class DynamicSamplingConfig(StrictModel):
    """DAPO-style dynamic sampling (docs/training.md#dynamic-sampling; Yu et al. 2025, arXiv:2503.14476, §3.2):
    each generation makes more groups than a step trains on, in one batched generate, and the step trains on the
    groups whose rewards differ (flat groups only fill up when too few differ). Mixed groups left over are trained
    on at the next step (`carry`), and the extra groups follow the measured share of mixed groups (`adaptive`), up
    to `oversample` times the groups trained. It pays some generation per step for fewer zero-signal groups, where
    the curriculum cannot help: prompts seen once (`grpo_pipeline.trainer.dynamic_sampling`)."""

    enabled: bool = Field(
        False,
        description="off by default: each step costs up to `oversample` times the generation, worth it only where "
        "many groups are flat (bench.zero_signal measures it at equal wall time)",
    )
    oversample: float = Field(
        2.0,
        gt=1,
        allow_inf_nan=False,
        description="the most groups generated per group trained on (> 1; extra groups per process at most "
        "ceil((oversample - 1) x its groups)); 2: DAPO's budget finds a group with variance for most slots when half "
        "the groups are flat",
    )
    # both off until bench.dynamic_cost has measured them on the recipe over 5 seeds: the recipe's published gains
    # were measured with the fixed budget
    carry: bool = Field(
        False,
        description="keep the mixed groups a step generated but did not train on, and train on them first at the "
        "next step (at most one generation old; verl's and prime-rl's bounded off-policy); false: discard them",
    )
    adaptive: bool = Field(
        False,
        description="generate only the extra groups that the measured share of mixed groups (the last steps') and "
        "the carried groups say are needed to fill the step, `oversample` being the most; false: always the most",
    )
