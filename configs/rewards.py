"""The run's rewards as one value: each reward's name, weight, arguments and role (`RewardSet`), the one
function that sums a completion's scores into the total GRPO optimises (`RewardSet.total`), and which reward is
the task's skill (`RewardSet.skill`): what every stage that judges a model compares first.

A reward is the **skill** (does the completion do the task: the answer checkers) or **shaping** (does it look
right: format, length). A format is learned in a few steps on any task, so a rising total can be format alone;
the promotion gate, early stopping, the search, the drift check and the report judge the skill, and guard the
total and the shaping rewards against drops.

It lives in the config layer, the lowest one every user imports: tasks (evaluation, the search's scorer, base
selection, the quantization cost, the promotion decision) take it as it is, and so does the trainer: the job spec
carries it whole (`grpo_pipeline.trainer.spec.TrainSettings.rewards`), and the trainer gives its weights to TRL.
Pure pydantic importing nothing else of the project, so a node runs it alone. `TrainConfig.reward_set()` resolves
it from the config's `train.rewards`.

    >>> rs = RewardSet(entries=["correct_answer", {"name": "number_only", "weight": 0.5}])
    >>> rs.total({"correct_answer": 1.0, "number_only": 1.0, "length": 7}), rs.skill, rs.shaping
    (1.5, 'correct_answer', ('number_only',))
    >>> RewardSet(entries=["number_only"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for RewardSet
    entries
      Value error, train.rewards has no skill reward ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["skill", "shaping"]

# The shipped rewards' roles (grpo_pipeline.trainer.rewards.REWARDS; tests/unit/test_reward_set.py checks that
# every registered reward has one). The answer checkers and the judges say whether the task was done; the
# formats and the length penalty say how the completion looks.
SKILL_REWARDS = frozenset(
    {
        "correct_answer",
        "math_answer",
        "remote_verifier",
        "reward_model",
        "exact_match",
        "label",
        "json_fields",
        "code_tests",
    }
)
SHAPING_REWARDS = frozenset(
    {"near_answer", "number_only", "think_format", "think_format_strict", "overlong_penalty", "json_schema"}
)
# A skill reward that an argument turns into partial credit, which shapes: reward -> that argument.
PARTIAL_CREDIT = {"json_fields": "partial"}

# The entry that names no reward: the skill reward that can judge the task's answers, chosen from them before any
# work (`grpo_pipeline.tasks.data.shape.task_rewards`; the demo's integers: correct_answer).
AUTO = "auto"

ENTRY_FORM = "train.rewards: [{name: correct_answer, role: skill}, {name: number_only, weight: 0.2}]"


def default_role(name: str, args: Mapping[str, Any] | None = None) -> Role | None:
    """A reward's role when its entry names none, given the arguments it is bound with: the shipped rewards' own
    (partial credit shapes: `json_fields` with `partial: true`); None for a custom reward, whose role the rest of
    the set decides (`RewardSet`).

    >>> default_role("math_answer"), default_role("think_format_strict"), default_role("pkg.mod:grade")
    ('skill', 'shaping', None)
    >>> default_role("json_fields"), default_role("json_fields", {"partial": True}), default_role("json_schema")
    ('skill', 'shaping', 'shaping')
    """
    if name in PARTIAL_CREDIT and (args or {}).get(PARTIAL_CREDIT[name]) is True:
        return "shaping"
    if name in SKILL_REWARDS or name == AUTO:
        return "skill"
    if name in SHAPING_REWARDS or name.startswith("think_format"):
        return "shaping"
    return None


class RewardEntry(BaseModel):
    """One reward of the set: a name from `grpo_pipeline.trainer.rewards.REWARDS` (`grpo-pipeline rewards` lists
    them) or a dotted path 'package.module:function', its weight in the total, its keyword arguments and its
    role. A bare string in `train.rewards` is `{name: that}`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    weight: float = Field(1.0, description="its weight in the total GRPO normalises per group")
    args: Mapping[str, Any] = Field(
        default_factory=dict,
        description="its keyword arguments, e.g. {url: 'http://grader:8000/score'} for remote_verifier; the trainer "
        "and every evaluation bind them, and preflight checks them against the reward's own parameters",
    )
    role: Role | None = Field(
        None,
        description="skill (does the task: the answer checkers) or shaping (format, length); unset: the shipped "
        "reward's own, and a lone custom reward is the skill",
    )
    chosen_by: str | None = Field(
        None, description="set by the run when this entry was `auto`: what in the task's answers chose the reward"
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"weight {v} is not a finite number")
        return v


def _listing(entries: tuple[RewardEntry, ...]) -> str:
    return ", ".join(f"{e.name} ({e.role or default_role(e.name, e.args) or 'custom'})" for e in entries)


def resolve_roles(entries: tuple[RewardEntry, ...]) -> tuple[RewardEntry, ...]:
    """Each entry with its role written out, exactly one of them the skill: the entries that say `role: skill`;
    else the shipped answer checkers; else the custom rewards (a custom reward beside an answer checker shapes).
    None or several: refused, naming the rewards and the fix.

    >>> [e.role for e in resolve_roles((RewardEntry(name="pkg:grade"), RewardEntry(name="number_only")))]
    ['skill', 'shaping']
    >>> [e.role for e in resolve_roles((RewardEntry(name="label"), RewardEntry(name="json_fields", args={"partial": True})))]
    ['skill', 'shaping']
    """
    declared = [e for e in entries if e.role == "skill"]
    shipped = [e for e in entries if e.role is None and default_role(e.name, e.args) == "skill"]
    custom = [e for e in entries if e.role is None and default_role(e.name, e.args) is None]
    candidates = declared or shipped or custom
    if len(candidates) != 1:
        problem = (
            "no skill reward (one that says whether the task was done, not how the answer looks)"
            if not candidates
            else f"{len(candidates)} skill rewards ({', '.join(e.name for e in candidates)})"
        )
        raise ValueError(
            f"train.rewards has {problem}: its rewards are {_listing(entries)}. Mark the one that judges the task "
            f"with `role: skill` (the others shape), e.g. {ENTRY_FORM}"
        )
    skill = candidates[0].name
    return tuple(e.model_copy(update={"role": "skill" if e.name == skill else "shaping"}) for e in entries)


class RewardSet(BaseModel):
    """What GRPO optimises: the sum of each reward's score times its weight, each reward bound with its
    arguments, and which one is the task's skill. Frozen: resolved once from the config, then passed whole, so no
    stage rebuilds it from parts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    entries: tuple[RewardEntry, ...] = Field(min_length=1)  # train.rewards' order: TRL's reward_funcs order

    @model_validator(mode="before")
    @classmethod
    def _parallel_lists(cls, data: Any) -> Any:
        """`names` with `weights` and `args` beside them: the shape job specs were written in before the rewards
        were entries (and a short form for code). Read as entries, each role the reward's default."""
        if not isinstance(data, dict) or "names" not in data:
            return data
        if stray := set(data) - {"names", "weights", "args"}:
            raise ValueError(f"rewards given as names take weights and args beside them, not {sorted(stray)}")
        names, weights, args = list(data["names"]), list(data.get("weights") or ()), dict(data.get("args") or {})
        if weights and len(weights) != len(names):
            raise ValueError(
                f"{len(weights)} weights for {len(names)} reward{'s' if len(names) > 1 else ''} "
                f"({', '.join(names)}): give one weight per reward"
            )
        if stray_args := sorted(set(args) - set(names)):
            raise ValueError(
                f"arguments for {', '.join(stray_args)}, which are not among the rewards ({', '.join(names)})"
            )
        return {
            "entries": [
                {"name": n, "weight": w, **({"args": args[n]} if n in args else {})}
                for n, w in zip(names, weights or [1.0] * len(names), strict=True)
            ]
        }

    @field_validator("entries")
    @classmethod
    def _consistent(cls, entries: tuple[RewardEntry, ...]) -> tuple[RewardEntry, ...]:
        names = [e.name for e in entries]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"train.rewards names {', '.join(twice)} more than once: give each reward one entry")
        if not any(e.weight for e in entries):  # every group's advantages would be 0, and every ranking a tie
            raise ValueError(f"every reward weight is 0 ({', '.join(names)}): there is nothing to optimise")
        return resolve_roles(entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def weights(self) -> tuple[float, ...]:
        """One per reward, in order (TRL's reward_weights)."""
        return tuple(e.weight for e in self.entries)

    @property
    def args(self) -> dict[str, dict[str, Any]]:
        """Reward name -> its keyword arguments, for the rewards that have any."""
        return {e.name: dict(e.args) for e in self.entries if e.args}

    @property
    def skill(self) -> str:
        """The reward that says whether the task was done: what the gate, early stopping, the search, the drift
        check and the report judge a model by."""
        return next(e.name for e in self.entries if e.role == "skill")

    @property
    def shaping(self) -> tuple[str, ...]:
        """The rewards that shape how a completion looks (format, length): guarded, never the verdict."""
        return tuple(e.name for e in self.entries if e.role == "shaping")

    def skill_only(self) -> RewardSet:
        """The skill reward alone, weight 1 and its arguments kept: a set whose total is the skill's score, for a
        judge that reads the total (the live A/B's `reference` feedback).

        >>> RewardSet(entries=[{"name": "correct_answer", "weight": 2.0}, "number_only"]).skill_only().names
        ('correct_answer',)
        """
        entry = next(e for e in self.entries if e.role == "skill")
        return RewardSet(entries=(entry.model_copy(update={"weight": 1.0}),))

    def weight(self, name: str) -> float:
        return next(e.weight for e in self.entries if e.name == name)

    def args_for(self, name: str) -> dict[str, Any] | None:
        """The keyword arguments `name` is bound with, as the trainer binds them; None when it has none.

        >>> RewardSet(entries=[{"name": "math_answer", "args": {"tag": "answer"}}]).args_for("math_answer")
        {'tag': 'answer'}
        """
        return self.args.get(name)

    def total(self, scores: Mapping[str, float]) -> float:
        """The weighted total of one completion's scores (reward name -> score; other columns are ignored):
        what GRPO normalises per group.

        >>> RewardSet(names=("correct_answer", "number_only"), weights=(1.0, 0.2)).total(
        ...     {"correct_answer": 0.0, "number_only": 1.0}
        ... )
        0.2
        """
        return sum(e.weight * scores[e.name] for e in self.entries)

    @property
    def span(self) -> float:
        """How far the total can range when every reward scores in [0, 1]: the sum of |weight|. Half of it is
        the total's largest possible standard deviation, which sizes the search's validation prompts.

        >>> RewardSet(names=("math_answer", "overlong_penalty"), weights=(1.0, -0.5)).span
        1.5
        """
        return sum(abs(w) for w in self.weights)
