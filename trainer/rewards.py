"""Reward functions with TRL's signature `(completions, **columns) -> list[float]`.

Completions arrive as plain strings, or as message lists for conversational prompts; dataset columns
(such as `answer`) arrive as keyword lists aligned with the completions. Register a new reward in
`REWARDS`, or name any importable function as 'package.module:function'.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

RewardFn = Callable[..., list[float]]

_INT = re.compile(r"-?\d+")


def completion_text(completion: str | list[dict]) -> str:
    """The assistant text of a completion in either TRL format.

    >>> completion_text([{"role": "assistant", "content": " 7"}])
    ' 7'
    """
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion if m.get("role", "assistant") == "assistant")


def correct_answer(completions: list, answer: list[str], **_: object) -> list[float]:
    """1.0 when the first integer in the completion equals the reference answer, else 0.0.

    >>> correct_answer(["42", "It is 41.", "no idea"], answer=["42", "41", "3"])
    [1.0, 1.0, 0.0]
    """
    scores = []
    for completion, ref in zip(completions, answer, strict=True):
        found = _INT.search(completion_text(completion))
        scores.append(float(found is not None and found.group() == str(ref).strip()))
    return scores


def number_only(completions: list, **_: object) -> list[float]:
    """1.0 when the completion is just an integer (the format the demo prompt asks for).

    >>> number_only(["12", " 12.", "The answer is 12"])
    [1.0, 1.0, 0.0]
    """
    return [float(re.fullmatch(r"\s*-?\d+\s*\.?\s*", completion_text(c)) is not None) for c in completions]


REWARDS: dict[str, RewardFn] = {"correct_answer": correct_answer, "number_only": number_only}


def resolve_reward(name: str) -> RewardFn:
    """A registered reward by name, or any function by 'package.module:function'.

    >>> resolve_reward("number_only") is number_only
    True
    >>> resolve_reward("nope")
    Traceback (most recent call last):
    ...
    ValueError: unknown reward 'nope'; registered: correct_answer, number_only, or use 'package.module:function'
    """
    if name in REWARDS:
        return REWARDS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(
            f"unknown reward '{name}'; registered: {', '.join(REWARDS)}, or use 'package.module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward '{name}' cannot be imported: {exc}") from None
    if not callable(fn):
        raise ValueError(f"reward '{name}' is not callable")
    return fn
