"""`train.health.*`: the health rules of an unattended run, each one entry of `RULES` (pure pydantic, no I/O).

An entry says everything about its rule: the metric TRL logs that it reads, how the window's mean compares with
the threshold, the defaults (action, window, threshold), the threshold's bounds and the words of its message.
The config's section (`HealthConfig`: one field per entry, each of its rule's own class with those defaults
and bounds) and the trainer's checks (`grpo_pipeline.trainer.health.Monitor`) are derived from the table, so
adding a rule is one entry here, one row in docs/training.md#health-rules, and nothing else
(tests/unit/test_health.py runs every entry through the config, its validation and the trainer's check).

The trainer's job spec carries this section as it is (`grpo_pipeline.trainer.spec.TrainSettings.health`): like
`configs/layout.py`, this module imports nothing else of the project, so a node runs it alone.

    >>> RULES["kl_blowup"].fired(2.0, 1.0), HealthConfig().rule("kl_blowup").window
    (True, 3)
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

Action = Literal["off", "warn", "stop", "rollback"]


def _yaml_off(value: Any) -> Any:
    """YAML 1.1 (PyYAML, and so `--set`) reads a bare `off` as false: for an action, false is `off`."""
    return "off" if value is False else value


HealthAction = typing.Annotated[Action, BeforeValidator(_yaml_off)]
_ACTION = (
    "warn: a log line, an MLflow tag and metric; stop: end training after this step and evaluate what "
    "exists; rollback: restart from the last healthy checkpoint at a lower learning rate; off"
)

# How a rule's value compares with its threshold: `reaches` (>=), `falls to` (<=), `either way` (>= t or <= 1/t,
# for a ratio that may drift up or down). `non-finite` reads no window: any NaN or inf in its metrics fires.
# `format hacking` reads the run's rewards by role (`grpo_pipeline.trainer.health.Monitor`): a shaping reward's
# window mean reaches the threshold, or the mean length falls to SHORT_TOKENS, while the skill stays flat.
Comparison = Literal["reaches", "falls to", "either way", "non-finite", "format hacking"]
_FIRES: dict[str, Callable[[float, float], bool]] = {
    "reaches": lambda v, t: v >= t,
    "falls to": lambda v, t: v <= t,
    "either way": lambda v, t: v >= t or v <= 1 / t,
}


@dataclass(frozen=True)
class Bounds:
    """The range a rule's threshold may be set to (pydantic's own constraints, so its messages name them)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None


@dataclass(frozen=True)
class Rule:
    """One health rule: what it reads, when it fires, its defaults and the range of its threshold."""

    about: str  # what goes wrong: the rule's section in the config (`grpo-pipeline config`)
    metrics: tuple[str, ...]  # the keys of TRL's step log it reads; a windowed rule averages its one key
    fires: Comparison
    threshold: float  # the default
    bounds: Bounds
    threshold_doc: str
    says: str  # what the value is, for the event's message
    action: Action = "warn"
    window: int = 5  # logged steps averaged (the default)
    max_window: int | None = None
    window_doc: str = "logged steps the rule averages over"
    relative: bool = False  # compare with the run's first full window: for metrics with no model-independent scale
    names_rewards: bool = False  # the message adds the batch's mean reward and each reward's spread

    def fired(self, value: float, threshold: float) -> bool:
        """Whether a value is bad: a window's mean (for a relative rule, its ratio to the run's first window), or
        for `non-finite` one logged value.

        >>> RULES["length_drift"].fired(0.3, 3.0), RULES["length_drift"].fired(1.5, 3.0)
        (True, False)
        """
        if self.fires == "non-finite":
            return not math.isfinite(value)
        return _FIRES[self.fires](value, threshold)


NON_FINITE = "non_finite"
FORMAT_HACKING = "format_hacking"
SKILL_FLAT = 0.05  # format_hacking: the skill's window mean rose less than this since the run's first window
SHORT_TOKENS = 2.0  # format_hacking: completions this short (mean tokens) say the answer has become a format

# Why each default: docs/training.md#health-rules (each rule's row, with its source).
RULES: dict[str, Rule] = {
    "zero_variance": Rule(
        about="Groups whose completions all got the same reward have zero advantage: the step learns nothing from them.",
        metrics=("frac_reward_zero_std",),
        fires="reaches",
        threshold=0.9,
        bounds=Bounds(ge=0, le=1),
        threshold_doc="fires when the mean of frac_reward_zero_std reaches this",
        says="mean fraction of groups whose completions all got the same reward (no advantage, no gradient)",
        names_rewards=True,
    ),
    "entropy_collapse": Rule(
        about="The policy stops exploring: its entropy falls far below where the run started.",
        metrics=("entropy",),
        fires="falls to",
        threshold=0.1,
        bounds=Bounds(gt=0, lt=1),
        threshold_doc="fires when mean entropy falls to this fraction of the run's first window",
        says="mean policy entropy as a fraction of the run's first window",
        relative=True,
    ),
    "length_drift": Rule(
        about="Length hacking: mean completion length drifts far from where the run started, either way.",
        metrics=("completions/mean_length",),
        fires="either way",
        threshold=3.0,
        bounds=Bounds(gt=1),
        threshold_doc="fires when mean length is this multiple of the run's first window, or its inverse",
        says="mean completion length as a multiple of the run's first window",
        relative=True,
    ),
    "clipped_completions": Rule(
        about="Completions cut at max_completion_length: rewards then score text that never finished.",
        metrics=("completions/clipped_ratio",),
        fires="reaches",
        threshold=0.5,
        bounds=Bounds(ge=0, le=1),
        threshold_doc="fires when the mean clipped fraction reaches this",
        says="mean fraction of completions cut at max_completion_length",
    ),
    "kl_blowup": Rule(
        about="The policy runs away from the reference (only with train.grpo.beta > 0: TRL logs no kl otherwise).",
        metrics=("kl",),
        fires="reaches",
        threshold=1.0,
        bounds=Bounds(gt=0),
        threshold_doc="fires when mean per-token KL reaches this (nats)",
        says="mean per-token KL to the reference",
        window=3,
    ),
    "reward_collapse": Rule(
        about="The batch's rewards stop differing: all right (nothing left to learn) or all wrong (too hard).",
        metrics=("reward_std",),
        fires="falls to",
        threshold=0.01,
        bounds=Bounds(ge=0),
        threshold_doc="fires when mean reward_std falls to this",
        says="mean spread (std) of the rewards in a batch",
        names_rewards=True,
    ),
    FORMAT_HACKING: Rule(
        about="Format hacking: a shaping reward (a format) saturates, or completions shrink to a token or two, while "
        "the skill reward (the answer checker) stays where the run started: the total rises, the task does not.",
        metrics=("rewards/<shaping>/mean", "completions/mean_length", "rewards/<skill>/mean"),
        fires="format hacking",
        threshold=0.95,
        bounds=Bounds(gt=0, le=1),
        threshold_doc=f"fires when a shaping reward's window mean reaches this, or mean length falls to "
        f"{SHORT_TOKENS:g} tokens, while the skill's rose less than {SKILL_FLAT:g} since the run's first window (and "
        "is itself below this)",
        says="format hacking",
    ),
    NON_FINITE: Rule(
        about="A NaN or inf loss or gradient norm: the optimizer step has already spread it into the weights.",
        metrics=("loss", "grad_norm"),  # grad_norm not under fp16: the GradScaler skips inf steps itself
        fires="non-finite",
        threshold=0.0,
        bounds=Bounds(ge=0, le=0),
        threshold_doc="unused (any non-finite value fires)",
        says="non-finite",
        action="rollback",
        window=1,
        max_window=1,
        window_doc="always 1: one non-finite step is enough",
    ),
}


class RuleConfig(BaseModel):
    """What sets every rule: what to do when it fires, over how many logged steps, at what value. Each rule's
    own class (`RULE_CONFIGS`) gives these its entry's defaults and bounds."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    action: HealthAction
    window: int
    threshold: float


def _rule_config(name: str, rule: Rule) -> type[RuleConfig]:
    """The class of `train.health.<name>`: its entry's defaults, and its threshold's bounds as pydantic's own."""
    b = rule.bounds
    return create_model(
        "".join(part.title() for part in name.split("_")) + "Rule",  # zero_variance -> ZeroVarianceRule
        __base__=RuleConfig,
        __module__=__name__,
        __doc__=rule.about,
        action=(HealthAction, Field(rule.action, description=_ACTION)),
        window=(int, Field(rule.window, ge=1, le=rule.max_window, description=rule.window_doc)),
        threshold=(
            float,
            Field(
                rule.threshold, ge=b.ge, gt=b.gt, le=b.le, lt=b.lt, allow_inf_nan=False, description=rule.threshold_doc
            ),
        ),
    )


RULE_CONFIGS: dict[str, type[RuleConfig]] = {name: _rule_config(name, rule) for name, rule in RULES.items()}

H = TypeVar("H", bound=BaseModel)


def _one_field_per_rule(cls: type[H]) -> type[H]:
    """`cls` with a field per entry of RULES, of that rule's own class: how an entry becomes a config key."""
    fields: dict[str, Any] = {name: (config, config.model_validate({})) for name, config in RULE_CONFIGS.items()}
    return create_model(cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__, **fields)


@_one_field_per_rule
class HealthConfig(BaseModel):
    """Guards for an unattended run, read from the metrics TRL logs each step (docs/training.md#health-rules:
    each default and its source). Every rule that fires is in the log, in MLflow and in the run's summary."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_rollbacks: int = Field(2, ge=0, description="rollbacks in one job; a rule that asks for one more stops instead")
    rollback_lr_factor: float = Field(0.5, gt=0, lt=1, description="each rollback multiplies the learning rate by this")

    def rule(self, name: str) -> RuleConfig:
        """The settings of the rule `name` (a key of RULES)."""
        return typing.cast(RuleConfig, getattr(self, name))

    def rolls_back(self) -> list[str]:
        return [name for name in RULES if self.rule(name).action == "rollback"]
