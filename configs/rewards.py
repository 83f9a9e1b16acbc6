"""The run's rewards as one value: names, their arguments and their weights (`RewardSet`), and the one
function that sums a completion's scores into the total every stage ranks by (`RewardSet.total`).

It lives in the config layer, the lowest one every user imports: tasks (evaluation, the search's scorer, base
selection, the quantization cost, the promotion decision) take it as it is, and so does the trainer: the job spec
carries it whole (`grpo_pipeline.trainer.spec.TrainSettings.rewards`), and the trainer gives its weights to TRL.
Pure pydantic importing nothing else of the project, so a node runs it alone. `TrainConfig.reward_set()` resolves
it from the config.

    >>> rs = RewardSet(names=("correct_answer", "number_only"), weights=(1.0, 0.5))
    >>> rs.total({"correct_answer": 1.0, "number_only": 1.0, "length": 7})
    1.5
    >>> RewardSet(names=("correct_answer",), weights=(1.0, 2.0))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for RewardSet
      Value error, 2 weights for 1 reward (correct_answer): give one weight per reward ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RewardSet(BaseModel):
    """What GRPO optimises: the sum of each named reward's score times its weight, each reward bound with its
    arguments. Frozen: resolved once from the config, then passed whole, so no stage rebuilds it from parts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    names: tuple[str, ...] = Field(min_length=1)  # in train.rewards order: TRL's reward_funcs order
    # reward name -> its keyword arguments (train.reward_args); a name with none is absent
    args: Mapping[str, Mapping[str, Any]] = Field(default_factory=dict)
    weights: tuple[float, ...] = ()  # one per name, in that order (TRL's reward_weights); () = 1.0 each

    @model_validator(mode="before")
    @classmethod
    def _unit_weights(cls, data: Any) -> Any:
        """No weights given means TRL's default, 1.0 each, written out so `total` has one rule."""
        if isinstance(data, dict) and not data.get("weights") and data.get("names"):
            return {**data, "weights": tuple(1.0 for _ in data["names"])}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RewardSet:
        if len(self.weights) != len(self.names):
            raise ValueError(
                f"{len(self.weights)} weights for {len(self.names)} reward"
                f"{'s' if len(self.names) > 1 else ''} ({', '.join(self.names)}): give one weight per reward"
            )
        if bad := [w for w in self.weights if not math.isfinite(w)]:
            raise ValueError(f"reward weights {bad} are not finite numbers")
        if not any(self.weights):  # every group's advantages would be 0, and every ranking a tie
            raise ValueError(f"every reward weight is 0 ({', '.join(self.names)}): there is nothing to optimise")
        if stray := sorted(set(self.args) - set(self.names)):
            raise ValueError(
                f"arguments for {', '.join(stray)}, which are not among the rewards ({', '.join(self.names)})"
            )
        return self

    def args_for(self, name: str) -> dict[str, Any] | None:
        """The keyword arguments `name` is bound with, as the trainer binds them; None when it has none.

        >>> RewardSet(names=("math_answer",), args={"math_answer": {"tag": "answer"}}).args_for("math_answer")
        {'tag': 'answer'}
        """
        given = self.args.get(name)
        return dict(given) if given is not None else None

    def total(self, scores: Mapping[str, float]) -> float:
        """The weighted total of one completion's scores (reward name -> score; other columns are ignored):
        what GRPO normalises per group, and so what every stage that ranks models compares.

        >>> RewardSet(names=("a", "b"), weights=(1.0, 0.2)).total({"a": 0.0, "b": 1.0})
        0.2
        """
        return sum(w * scores[name] for w, name in zip(self.weights, self.names, strict=True))

    @property
    def span(self) -> float:
        """How far the total can range when every reward scores in [0, 1]: the sum of |weight|. Half of it is
        the total's largest possible standard deviation, which sizes the search's validation prompts.

        >>> RewardSet(names=("a", "b"), weights=(1.0, -0.5)).span
        1.5
        """
        return sum(abs(w) for w in self.weights)
