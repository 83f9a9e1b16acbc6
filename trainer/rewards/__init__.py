"""Reward functions with TRL's signature `(completions, **columns) -> list[float]`, registered by name.

Completions arrive as plain strings, or as message lists for conversational prompts; dataset columns
(such as `answer`) arrive as keyword lists aligned with the completions. A reward's positional parameters
without a default are the columns it needs; its keyword-only parameters are its arguments, bound by
`resolve_reward`. Its positional parameters with a default are optional columns (`optional_columns`: read
when the data has them, such as `label`'s `labels`), each of which may instead be bound once as an argument.
Register a new reward in `REWARDS`, or name any importable function as 'package.module:function'.

Every resolved reward is checked on each call: a missing column, an exception, the wrong number of
scores, or a score that is not a finite number is a `RewardError` that names the reward and the row. It
would fail the same way on every attempt, so the trainer exits 2 (never relaunched). A failure from outside
the reward and the data (an `OSError`: a connection refused or reset, a timeout; `MemoryError`, torch's
out-of-memory error; or `RewardUnavailable`, which `remote_verifier` raises for an outage that outlasts its
retries and a custom reward may raise too) is a `RewardUnavailable`: another attempt may succeed, so the
trainer exits 1, is relaunched and resumes from its checkpoint.

    python -m grpo_pipeline.cli rewards                     # the registry: what each checks, its columns
    python -m grpo_pipeline.cli rewards check math_answer --input samples.jsonl
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo_pipeline.trainer.rewards.answers import correct_answer, math_answer, near_answer
from grpo_pipeline.trainer.rewards.base import RewardError, RewardFn, RewardUnavailable, completion_text
from grpo_pipeline.trainer.rewards.code import check_code_arguments, code_tests, code_tests_reference_problem
from grpo_pipeline.trainer.rewards.formats import number_only, overlong_penalty, think_format, think_format_strict
from grpo_pipeline.trainer.rewards.model import reward_model
from grpo_pipeline.trainer.rewards.remote import check_arguments as check_remote_arguments
from grpo_pipeline.trainer.rewards.remote import remote_verifier
from grpo_pipeline.trainer.rewards.text import (
    check_exact_match_arguments,
    check_json_fields_arguments,
    check_json_schema_arguments,
    check_label_arguments,
    exact_match,
    exact_match_reference_problem,
    json_fields,
    json_fields_reference_problem,
    json_schema,
    label,
    label_reference_problem,
)

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "RewardUnavailable",
    "check_columns",
    "completion_text",
    "describe",
    "optional_columns",
    "reference_problem",
    "required_columns",
    "resolve_reward",
    "resolve_rewards",
    "target",
    "transient",
]

REWARDS: dict[str, RewardFn] = {
    "math_answer": math_answer,
    "think_format": think_format,
    "think_format_strict": think_format_strict,
    "overlong_penalty": overlong_penalty,
    "reward_model": reward_model,
    "remote_verifier": remote_verifier,
    "correct_answer": correct_answer,
    "number_only": number_only,
    "near_answer": near_answer,
    "exact_match": exact_match,
    "label": label,
    "json_fields": json_fields,
    "json_schema": json_schema,
    "code_tests": code_tests,
}

# Checks of a reward's argument values that can run before any work (preflight), not only at its first call:
# each takes some of the reward's arguments by name and raises RewardError.
ARGUMENT_CHECKS: dict[RewardFn, Callable[..., None]] = {
    remote_verifier: check_remote_arguments,
    code_tests: check_code_arguments,
    exact_match: check_exact_match_arguments,
    label: check_label_arguments,
    json_fields: check_json_fields_arguments,
    json_schema: check_json_schema_arguments,
}

# Why a row's reference answer cannot be judged by a reward (the data stage quarantines the row with the reason):
# each takes the answer and, by name, some of the reward's arguments and optional columns; None when it can.
REFERENCE_CHECKS: dict[RewardFn, Callable[..., str | None]] = {
    exact_match: exact_match_reference_problem,
    label: label_reference_problem,
    json_fields: json_fields_reference_problem,
    code_tests: code_tests_reference_problem,
}

# What the runner (TRL's trainer, the evaluation, `rewards check`) passes itself: never a data column.
RUNNER_INPUTS = frozenset(
    {
        "completions",
        "prompts",
        "completion_ids",
        "completion_lengths",
        "trainer_state",
        "log_extra",
        "log_metric",
        "environments",
    }
)
REQUIRED = inspect.Parameter.empty


def target(name: str) -> RewardFn:
    if name in REWARDS:
        return REWARDS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise RewardError(
            f"unknown reward '{name}'; registered: {', '.join(REWARDS)}, or use 'package.module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise RewardError(f"reward '{name}' cannot be imported: {exc}") from None
    if not callable(fn):
        raise RewardError(f"reward '{name}' is not callable")
    return fn


def _parameters(fn: RewardFn) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []


def required_columns(fn: RewardFn) -> list[str]:
    """The data columns a reward needs: its positional parameters without a default, runner inputs aside.

    >>> required_columns(math_answer), required_columns(think_format)
    (['answer'], [])
    """
    return [
        p.name
        for p in _parameters(fn)[1:]
        if p.name not in RUNNER_INPUTS
        and p.default is REQUIRED
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def optional_columns(fn: RewardFn) -> list[str]:
    """The data columns a reward reads when the data has them: its positional parameters with a default, runner
    inputs aside. Each may instead be bound once as an argument (`label`'s `labels`), never both.

    >>> optional_columns(label), optional_columns(exact_match), optional_columns(math_answer)
    (['labels'], ['aliases'], [])
    """
    return [
        p.name
        for p in _parameters(fn)[1:]
        if p.name not in RUNNER_INPUTS and p.default is not REQUIRED and p.kind is p.POSITIONAL_OR_KEYWORD
    ]


def arguments(fn: RewardFn) -> dict[str, Any]:
    """A reward's arguments and their defaults (`REQUIRED` where there is none): its keyword-only parameters and
    its optional columns, in signature order.

    >>> arguments(label)
    {'labels': None, 'marker': None, 'answer_tag': 'answer'}
    """
    optional = set(optional_columns(fn))
    return {
        p.name: p.default
        for p in _parameters(fn)
        if (p.kind is p.KEYWORD_ONLY or p.name in optional) and p.name not in RUNNER_INPUTS
    }


def resolve_reward(name: str, args: Mapping[str, Any] | None = None, **context: Any) -> RewardFn:
    """A registered reward by name, or any function by 'package.module:function', with its arguments bound
    and every call checked. `context` offers values the runner knows (`max_completion_length`) to the
    rewards that take them, unless `args` sets them.

    >>> resolve_reward("number_only")(["12", "twelve"])
    [1.0, 0.0]
    >>> resolve_reward("label", {"labels": ["positive", "negative"]})(["Positive."], answer=["positive"])
    [1.0]
    >>> resolve_reward("nope")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    grpo_pipeline.trainer.rewards.base.RewardError: unknown reward 'nope'; registered: math_answer, ..., or use 'package.module:function'
    >>> resolve_reward("remote_verifier")
    Traceback (most recent call last):
    ...
    grpo_pipeline.trainer.rewards.base.RewardError: reward 'remote_verifier' needs the argument url
    """
    fn = target(name)
    takes = arguments(fn)
    bound = dict(args or {})
    unknown = sorted(set(bound) - set(takes))
    if unknown:
        offered = ", ".join(f"{k}={'(required)' if v is REQUIRED else repr(v)}" for k, v in takes.items()) or "none"
        raise RewardError(
            f"reward '{name}' takes no argument {', '.join(map(repr, unknown))}; its arguments: {offered}"
        )
    for key, value in context.items():
        if key in takes and key not in bound and value is not None:
            bound[key] = value
    missing = [k for k, v in takes.items() if v is REQUIRED and k not in bound]
    if missing:
        raise RewardError(f"reward '{name}' needs the argument{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    if (check := ARGUMENT_CHECKS.get(fn)) is not None:
        check(**{k: v for k, v in bound.items() if k in inspect.signature(check).parameters})
    as_argument = [c for c in optional_columns(fn) if c in bound]
    return _checked(functools.partial(fn, **bound) if bound else fn, name, required_columns(fn), as_argument)


def resolve_rewards(
    names: Sequence[str], args: Mapping[str, Mapping[str, Any]] | None = None, **context: Any
) -> list[RewardFn]:
    """Every reward of a run, in order, each with its own arguments (`args[name]`)."""
    args = args or {}
    stray = sorted(set(args) - set(names))
    if stray:
        raise RewardError(
            f"reward arguments for {', '.join(stray)}, which are not among the rewards ({', '.join(names)})"
        )
    return [resolve_reward(name, args.get(name), **context) for name in names]


def check_columns(names: Sequence[str], columns: Sequence[str]) -> None:
    """Every reward's columns are among the data's, or a `RewardError` that names what is missing.

    >>> check_columns(["math_answer", "think_format"], ["prompt", "answer", "key"])
    >>> check_columns(["math_answer"], ["prompt", "key"])
    Traceback (most recent call last):
    ...
    grpo_pipeline.trainer.rewards.base.RewardError: reward 'math_answer' needs the column 'answer', which the data does not have (it has: prompt, key)
    """
    for name in names:
        lacking = [c for c in required_columns(target(name)) if c not in columns]
        if lacking:
            raise RewardError(
                f"reward '{name}' needs the column{'s' if len(lacking) > 1 else ''} {', '.join(map(repr, lacking))}, "
                f"which the data does not have (it has: {', '.join(columns)})"
            )


def reference_problem(name: str, args: Mapping[str, Any] | None, answer: str, columns: Mapping[str, Any]) -> str | None:
    """Why reward `name`, bound with `args`, cannot judge a row whose reference answer is `answer`, in words a user
    can act on; None when it can, and for a reward without a reference check (`REFERENCE_CHECKS`). `columns` is
    the row's own values (one row, not lists) of the reward's optional columns, where the data has them.

    >>> reference_problem("label", {"labels": ["positive", "negative"]}, "maybe", {})
    "the answer 'maybe' is not among the labels (negative, positive): add it to labels or fix the row"
    >>> reference_problem("label", None, "neutral", {"labels": ["neutral", "not neutral"]}) is None
    True
    >>> reference_problem("json_fields", {"fields": ["age"]}, '{"name": "Ann"}', {})
    "the answer lacks the field 'age' that json_fields' fields names"
    >>> reference_problem("math_answer", None, "anything", {}) is None
    True
    """
    fn = target(name)
    check = REFERENCE_CHECKS.get(fn)
    if check is None:
        return None
    bound = dict(args or {})
    row = {c: columns[c] for c in [*optional_columns(fn), *required_columns(fn)] if c in columns and c != "answer"}
    if both := sorted(set(row) & set(bound)):
        return f"{', '.join(both)} is given both as an argument of {name} and as a column of the row: keep one"
    takes = inspect.signature(check).parameters
    return check(answer, **{k: v for k, v in (bound | row).items() if k in takes})


def describe(name: str) -> dict[str, Any]:
    """What a reward checks (its docstring's first line), the columns it needs, those it reads when the data has
    them, and its arguments.

    >>> describe("overlong_penalty")["arguments"]
    {'max_completion_length': None, 'buffer': None}
    """
    fn = target(name)
    doc = inspect.getdoc(fn) or ""
    return {
        "name": name,
        "statement": doc.split("\n\n")[0].replace("\n", " ").strip(),
        "columns": required_columns(fn),
        "optional_columns": optional_columns(fn),
        "arguments": {k: ("required" if v is REQUIRED else v) for k, v in arguments(fn).items()},
    }


def _where(i: int, completions: list, kwargs: dict) -> str:
    keys = kwargs.get("key")
    key = f" (key {keys[i]})" if isinstance(keys, list) and len(keys) == len(completions) else ""
    text = completion_text(completions[i])
    return f"row {i}{key}, completion {text[:60]!r}{'...' if len(text) > 60 else ''}"


def _row_slice(i: int, n: int, kwargs: dict) -> dict:
    return {k: v[i : i + 1] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}


def transient(exc: BaseException) -> bool:
    """Whether a reward's exception comes from outside the reward and its input, so another attempt may not
    see it: a connection or timeout (`OSError`), exhausted host or GPU memory, or `RewardUnavailable`.

    >>> transient(ConnectionResetError()), transient(TimeoutError()), transient(MemoryError())
    (True, True, True)
    >>> transient(ZeroDivisionError()), transient(KeyError("answer")), transient(RewardError("nan"))
    (False, False, False)
    """
    if isinstance(exc, RewardUnavailable | OSError | MemoryError):
        return True
    torch = sys.modules.get("torch")  # a reward that ran torch imported it; one that did not cannot OOM in it
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(exc, oom)


def _checked(fn: RewardFn, name: str, columns: list[str], as_argument: Sequence[str] = ()) -> RewardFn:
    """`fn` that refuses to hand the trainer garbage: each failure names the reward and the row. `as_argument`:
    optional columns bound as arguments, which the data must not also hold (which would win is no one's guess); a
    column of nulls only (a reader that fills every row's columns) holds nothing, and the argument holds."""

    def reward(completions: list, *args: Any, **kwargs: Any) -> list[float]:
        n = len(completions)
        for c in as_argument:
            if c in kwargs and isinstance(kwargs[c], list) and all(v is None for v in kwargs[c]):
                del kwargs[c]
        if both := [c for c in as_argument if c in kwargs]:
            raise RewardError(
                f"reward '{name}' has {', '.join(both)} both as an argument and as a data column: keep one "
                "(drop the argument, or the column)"
            )
        lacking = [c for c in columns if c not in kwargs]
        if lacking:
            given = sorted(k for k in kwargs if k not in RUNNER_INPUTS)
            raise RewardError(
                f"reward '{name}' needs the column{'s' if len(lacking) > 1 else ''} "
                f"{', '.join(map(repr, lacking))}, which the data does not have (it has: "
                f"{', '.join(given) or 'no columns'})"
            )
        try:
            out = fn(completions, *args, **kwargs)
        except RewardError as exc:  # its class says whether it is an outage (RewardUnavailable) or bad input
            raise exc if f"'{name}'" in str(exc) else type(exc)(f"reward '{name}': {exc}") from None
        except Exception as exc:
            if transient(exc):  # not the row's fault: no rerun (it would hit the service or the GPU n more times)
                raise RewardUnavailable(
                    f"reward '{name}' could not run on a batch of {n} completions: {type(exc).__name__}: {exc}"
                ) from exc
            for i in range(n):  # which row breaks it: rerun one at a time (only ever on the way to an error)
                try:
                    fn(completions[i : i + 1], *args, **_row_slice(i, n, kwargs))
                except Exception as row_exc:
                    raise (RewardUnavailable if transient(row_exc) else RewardError)(
                        f"reward '{name}' raised on {_where(i, completions, kwargs)}: "
                        f"{type(row_exc).__name__}: {row_exc}"
                    ) from exc
            raise RewardError(
                f"reward '{name}' raised on a batch of {n} completions: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            scores = list(out)
        except TypeError:
            raise RewardError(f"reward '{name}' returned {type(out).__name__}, not a list of scores") from None
        if len(scores) != n:
            raise RewardError(f"reward '{name}' returned {len(scores)} scores for {n} completions")
        for i, s in enumerate(scores):
            if not isinstance(s, numbers.Real) or not math.isfinite(s):
                raise RewardError(
                    f"reward '{name}' returned {s!r} for {_where(i, completions, kwargs)}: "
                    "every score must be a finite number"
                )
        return [float(s) for s in scores]

    reward.__name__ = reward.__qualname__ = name  # TRL logs rewards/<name>/mean
    reward.__doc__ = getattr(fn, "__doc__", None)
    reward.__wrapped__ = fn  # type: ignore[attr-defined]  # functools.wraps would copy more; inspect.signature sees the reward's own parameters (the data stage reads them)
    return reward
