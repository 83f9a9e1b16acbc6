"""Rewards that check a completion's answer against the reference in the `answer` column.

`math_answer` finds the completion's *final* answer (an `<answer>` block, else the last `\\boxed{}`, else a
`#### n` line, else the last number) and compares it with the reference numerically: plain numbers and
fractions exactly, in Python (`1,234` = `1234` = `1234.0`, `3/4` = `0.75`); anything else (LaTeX such as
`\\frac{3}{4}`, `\\sqrt{2}`, `2\\pi`) through Hugging Face's `math-verify`, imported only then.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

from grpo_pipeline.trainer.rewards.base import ascii_digits, check_tag, completion_text

# A number as people write it: sign, thousands separators, decimals, a fraction a/b.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")
_WHOLE = re.compile(r"-?\d+")
_HASHES = re.compile(r"####\s*(.+?)\s*$", re.M)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PLAIN = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/[-+]?(?:\d+(?:\.\d*)?|\.\d+))?$")
_LATEX_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
# Around a number, what does not change its value: currency and percent signs, units and words.
_NOISE = re.compile(r"[$€£¥₹%]|\\[$%]|\\(?:text|mathrm|mbox)\{[^{}]*\}|\\[,;!]|\\ |\\left|\\right")


def correct_answer(completions: list, answer: list[str], **_: object) -> list[float]:
    """1.0 when the completion's final answer is the reference number: accuracy apart from format.

    The answer is the completion's last number (or its `<answer>` block, `\\boxed{}` or `#### n` line, as
    `math_answer` finds it), so "3 + 14 = 17" and "17" are both right: whether the reply is just the number is
    the format reward's business (`number_only`), not the skill's. The first number would score the base's
    "3 + 14 = 17" as wrong and make a format-only gain look like a skill gain.

    >>> correct_answer(["42", "It is 41.", "3 + 14 = 17", "17 - 3", "no idea"], answer=["42", "41", "17", "17", "3"])
    [1.0, 1.0, 1.0, 0.0, 0.0]
    """
    scores = []
    for completion, ref in zip(completions, answer, strict=True):
        value = final_number(completion)
        reference = str(ref).strip()  # an integer task's answer: a decimal or a date can never score (unverifiable)
        scores.append(float(value is not None and _WHOLE.fullmatch(reference) is not None and value == int(reference)))
    return scores


def near_answer(completions: list, answer: list[str], **_: object) -> list[float]:
    """Partial credit for a final answer near the reference number: 1 - |answer - reference| / max(|reference|, 1),
    floored at 0; 0 with no number, or for a reference that is not a number.

    Shaping, not the skill: where the base model is almost never right, every sampled group scores 0 on
    `correct_answer`, and a nearer wrong answer still ranks above a farther one. A right answer scores 1, so it
    never pays more than being right. Measured on a sequence's next term (SmolLM2-135M, base 0 %), it taught the
    sequence's last term, near and wrong (bench/results/recipe_candidates.json): a near answer is not always a step
    toward the right one.

    >>> near_answer(["73", "The sequence is 13, 28, 43, 58.", "100", "I do not know"], answer=["73"] * 4)
    [1.0, 0.7945205479452055, 0.6301369863013699, 0.0]
    """
    scores = []
    for completion, ref in zip(completions, answer, strict=True):
        value = final_number(completion)
        reference = _number(str(ref))
        if value is None or reference is None:
            scores.append(0.0)
            continue
        scores.append(max(0.0, 1.0 - float(abs(value - reference)) / max(float(abs(reference)), 1.0)))
    return scores


def final_number(completion: str | list[dict]) -> Fraction | None:
    """The completion's final answer as an exact number (`final_answer`, then `_number`), or None.

    >>> final_number("3 + 14 = 17"), final_number([{"role": "assistant", "content": "It is 1/2."}]), final_number("no")
    (Fraction(17, 1), Fraction(1, 2), None)
    """
    span = final_answer(completion_text(completion))
    return _number(span) if span is not None else None


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces matched.

    >>> _last_boxed(r"so \\boxed{\\frac{1}{2}} or \\boxed{3}")
    '3'
    """
    found = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found = text[start:i]
                break
    return found


def final_answer(text: str, answer_tag: str = "answer") -> str | None:
    """The span of a completion that holds its final answer, or None when it has none.

    >>> final_answer("<think>2+2</think> <answer>The total is $4.</answer>")
    'The total is $4.'
    >>> final_answer("48/2 = 24 apples, then 24 + 6 = 30")
    '30'
    >>> final_answer("so the answer is \\\\boxed{18} (not 20)")
    '18'
    >>> final_answer("I do not know") is None
    True
    """
    text = ascii_digits(text)
    tag = re.escape(answer_tag)
    tagged = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)
    if tagged:
        return tagged[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _number(span: str) -> Fraction | None:
    """A plain number or fraction in a span (the last one when the span has words around it), exactly.

    >>> _number("1,234.0"), _number("3/4"), _number("-\\\\frac{1}{2}"), _number("It costs $18.50 in all.")
    (Fraction(1234, 1), Fraction(3, 4), Fraction(-1, 2), Fraction(37, 2))
    >>> _number("\\\\sqrt{2}") is None
    True
    """
    text = _NOISE.sub("", ascii_digits(span)).strip().rstrip(".").strip()
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    frac = _LATEX_FRAC.match(text.replace(" ", ""))
    if frac:
        sign, num, den = frac.groups()
        text = f"{sign}{num}/{den}"
    compact = text.replace(" ", "")
    if not _PLAIN.match(compact):
        if "\\" in text or "^" in text or "{" in text:
            return None  # an expression: math-verify's
        numbers = _NUMBER.findall(text)
        if not numbers:
            return None
        compact = numbers[-1].replace(",", "").replace(" ", "")
    try:
        num, _, den = compact.partition("/")
        value = Fraction(num) / Fraction(den) if den else Fraction(num)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _verify(reference: str, span: str) -> bool:
    """Symbolic equivalence through math-verify (its timeouts use SIGALRM, available in the main thread only)."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"${reference}$", parsing_timeout=timeout)
        pred = parse(f"${span}$", parsing_timeout=timeout)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # math-verify raises on what it cannot parse; such an answer is not the reference
        return False


def answers_match(reference: str, span: str | None) -> bool:
    """Whether a final-answer span equals the reference.

    >>> answers_match("1234", "1,234"), answers_match("0.75", "3/4"), answers_match("18", "$18.00")
    (True, True, True)
    >>> answers_match("-3", "3"), answers_match("5", None), answers_match("\\\\frac{\\\\sqrt{2}}{2}", "\\\\frac{1}{\\\\sqrt{2}}")
    (False, False, True)
    """
    if span is None or not span.strip():
        return False
    ref, got = _number(str(reference)), _number(span)
    if ref is not None and got is not None:
        return ref == got
    if ref is not None and got is None and not re.search(r"\\|\^|\{", span):
        return False  # words with no number in them
    return _verify(str(reference), span)


def math_answer(completions: list, answer: list, *, answer_tag: str = "answer", **_: object) -> list[float]:
    """1.0 when the completion's final answer equals the reference numerically (last number, \\boxed{}, #### n, <answer>).

    The final answer is the last `<answer_tag>` block, else the last `\\boxed{}`, else a `#### n` line, else
    the last number; thousands separators, currency and percent signs and units are ignored, a minus is not.

    >>> math_answer(["<think>48/2 = 24</think><answer>24</answer>", "It is 1,234.0 dollars.", "#### 3/4", "five"],
    ...             answer=["24", "1234", "0.75", "5"])
    [1.0, 1.0, 1.0, 0.0]
    """
    check_tag(answer_tag, "answer_tag")
    return [
        float(answers_match(str(ref), final_answer(completion_text(c), answer_tag)))
        for c, ref in zip(completions, answer, strict=True)
    ]
