"""Rewards on a completion's form: a bare number, the `<think>…</think>` then answer structure, its length."""

from __future__ import annotations

import re

from grpo_pipeline.trainer.rewards.base import RewardError, check_tag, completion_text


def number_only(completions: list, **_: object) -> list[float]:
    """1.0 when the completion is just an integer (the format the demo prompt asks for).

    >>> number_only(["12", " 12.", "The answer is 12"])
    [1.0, 1.0, 0.0]
    """
    return [float(re.fullmatch(r"\s*-?\d+\s*\.?\s*", completion_text(c)) is not None) for c in completions]


def _think_then_answer(text: str, think_tag: str, answer_tag: str, strict: bool) -> bool:
    t, a = re.escape(think_tag), re.escape(answer_tag)
    think = rf"<{t}>(?P<think>.*?)</{t}>"
    if strict:
        pattern = rf"\s*{think}\s*<{a}>(?P<answer>.*?)</{a}>\s*"
    else:
        pattern = rf"\s*{think}(?P<answer>.*)"
    match = re.fullmatch(pattern, text, re.S)
    if not match or not match["think"].strip() or not match["answer"].strip():
        return False
    tags = (f"<{think_tag}>", f"</{think_tag}>") + ((f"<{answer_tag}>", f"</{answer_tag}>") if strict else ())
    return all(text.count(tag) == 1 for tag in tags)  # one block each: no second attempt appended


def think_format(
    completions: list, *, think_tag: str = "think", answer_tag: str = "answer", **_: object
) -> list[float]:
    """1.0 for one non-empty `<think>…</think>` block at the start followed by a non-empty answer.

    The answer after the block may be plain text or tagged; `think_format_strict` requires the tags.

    >>> think_format(["<think>24 + 6 = 30</think> 30", "<think></think> 30", "30", "<think>a</think>"])
    [1.0, 0.0, 0.0, 0.0]
    """
    check_tag(think_tag, "think_tag"), check_tag(answer_tag, "answer_tag")
    return [float(_think_then_answer(completion_text(c), think_tag, answer_tag, strict=False)) for c in completions]


def think_format_strict(
    completions: list, *, think_tag: str = "think", answer_tag: str = "answer", **_: object
) -> list[float]:
    """1.0 for exactly `<think>…</think>` then `<answer>…</answer>`, both non-empty, nothing else around them.

    >>> think_format_strict(["<think>\\n24 + 6\\n</think>\\n<answer>30</answer>", "<think>x</think> 30",
    ...                      "<think>x</think><answer>30</answer> so 30", "<think>x</think><answer> </answer>"])
    [1.0, 0.0, 0.0, 0.0]
    """
    check_tag(think_tag, "think_tag"), check_tag(answer_tag, "answer_tag")
    return [float(_think_then_answer(completion_text(c), think_tag, answer_tag, strict=True)) for c in completions]


def overlong_penalty(
    completions: list,
    completion_ids: list | None = None,
    completion_lengths: list[int] | None = None,
    *,
    max_completion_length: int | None = None,
    buffer: int | None = None,
    **_: object,
) -> list[float]:
    """DAPO's soft overlong penalty: 0 up to max_completion_length - buffer tokens, then linearly down to -1 at the limit.

    Lengths are tokens: TRL passes `completion_ids`; evaluation passes `completion_lengths`.
    `max_completion_length` is the run's own (the trainer and the evaluation pass it); `buffer` defaults to a
    fifth of it (DAPO: 4,096 of 20,480). A completion cut at the limit gets -1: it never ended.

    >>> overlong_penalty(["a"] * 4, completion_lengths=[10, 80, 90, 100], max_completion_length=100, buffer=20)
    [0.0, 0.0, -0.5, -1.0]
    """
    max_length = max_completion_length
    if max_length is None:
        raise RewardError("overlong_penalty needs max_completion_length (the trainer passes its own)")
    buffer = max(1, max_length // 5) if buffer is None else buffer
    if not 0 < buffer <= max_length:
        raise RewardError(f"overlong_penalty: buffer must be in 1..max_completion_length ({max_length}), got {buffer}")
    if completion_lengths is None:
        if completion_ids is None:
            raise RewardError("overlong_penalty needs token lengths: completion_ids (TRL) or completion_lengths")
        completion_lengths = [len(ids) for ids in completion_ids]
    if len(completion_lengths) != len(completions):
        raise RewardError(f"overlong_penalty: {len(completion_lengths)} lengths for {len(completions)} completions")
    start = max_length - buffer
    return [0.0 if n <= start else -1.0 if n >= max_length else (start - n) / buffer for n in completion_lengths]
