"""Rewards for answers that are not numbers: a short text (`exact_match`), one of a task's labels (`label`), a
JSON object (`json_fields`, and the shaping `json_schema`).

Each scores its own reference 1.0 when offered it as the completion (the data stage's check), and each has a
reference check (`*_reference_problem`) that says, in words a user can act on, why a row's reference cannot be
judged. Hostile completions (huge, deeply nested, ambiguous JSON) score 0; none raises or hangs.

One module, not one per reward: the three skill rewards read the final answer the same way (`final_span`,
`normalize_answer`) and `json_schema` finds the reply's object as `json_fields` does; cut apart they would import
each other's parts.
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_pipeline.trainer.rewards.base import RewardError, check_tag, completion_text

# --- the final answer of a completion (exact_match, label) ---------------------------------------------------

_THINK_END = "</think>"


@functools.lru_cache(maxsize=64)
def _marker_pattern(marker: str) -> re.Pattern[str]:
    return re.compile(re.escape(marker), re.I)


def final_span(text: str, *, marker: str | None = None, answer_tag: str = "answer") -> str:
    """The part of a completion that holds its final answer: the last `<answer_tag>…</answer_tag>` block;
    else, after the last `</think>` if any: the first non-empty line after the last `marker` (case-insensitive),
    when `marker` is set and present; else the last non-empty line. Stripped; '' when there is none.

    >>> final_span("<think>maybe Lyon</think><answer> Paris </answer> (I think)")
    'Paris'
    >>> final_span("Let me see.\\nAnswer: Paris\\nHope this helps.", marker="answer:")
    'Paris'
    >>> final_span("It is in France.\\n\\nParis.\\n"), final_span("<think>x</think> Paris"), final_span("  ")
    ('Paris.', 'Paris', '')
    """
    close = text.rfind(f"</{answer_tag}>")  # rfind, not a lazy regex: linear on any text
    if close >= 0:
        opened = text.rfind(f"<{answer_tag}>", 0, close)
        if opened >= 0:
            return text[opened + len(answer_tag) + 2 : close].strip()
    think = text.rfind(_THINK_END)
    if think >= 0:
        text = text[think + len(_THINK_END) :]
    if marker:
        last = None
        for last in _marker_pattern(marker).finditer(text):  # noqa: B007 - the last one is wanted
            pass
        if last is not None:
            for line in text[last.end() :].splitlines():
                if line.strip():
                    return line.strip()
            return ""
    for line in reversed(text.splitlines()):  # Python's line breaks, as the reference check counts them
        if line.strip():
            return line.strip()
    return ""


# Stripped from both ends of an answer: whitespace, sentence punctuation, markdown emphasis, ASCII quotes; and
# (by Unicode category) every opening/closing quote and bracket. Not '-', '+', '#', '%', '$', '/': they change
# what an answer says ("-5", "C#").
_EDGE = frozenset(".,;:!?¿¡…*_`\"'")
_EDGE_CATEGORIES = frozenset({"Pi", "Pf", "Ps", "Pe"})
_ARTICLE = re.compile(r"(?:a|an|the)\s+(?=\S)")
_QUOTED = re.compile(r'["“]([^"“”\n]{1,200})["”]')  # a phrase in double quotes, ASCII or typographic


def _edge(ch: str) -> bool:
    return ch.isspace() or ch in _EDGE or unicodedata.category(ch) in _EDGE_CATEGORIES


def _strip_edges(text: str) -> str:
    start, end = 0, len(text)
    while start < end and _edge(text[start]):
        start += 1
    while end > start and _edge(text[end - 1]):
        end -= 1
    return text[start:end]


def normalize_answer(text: str) -> str:
    """An answer as `exact_match` compares it: Unicode NFKC, case-folded, inner whitespace collapsed to one
    space, surrounding whitespace and punctuation stripped (sentence punctuation `.,;:!?`, `*`, `_`, backticks,
    quotes and brackets; not `-`, `+`, `#`, `%`), then one leading English article (a, an, the) dropped when
    words follow it.

    >>> normalize_answer('  "The  Eiffel Tower." '), normalize_answer("**ＰＡＲＩＳ**"), normalize_answer("(B)")
    ('eiffel tower', 'paris', 'b')
    >>> normalize_answer("-5."), normalize_answer("C#"), normalize_answer("The"), normalize_answer("Straße")
    ('-5', 'c#', 'the', 'strasse')
    """
    text = _strip_edges(" ".join(unicodedata.normalize("NFKC", text).casefold().split()))
    article = _ARTICLE.match(text)
    return _strip_edges(text[article.end() :]) if article else text


@functools.lru_cache(maxsize=4096)
def _right_answers(reference: str, aliases: tuple[str, ...]) -> frozenset[str]:
    return frozenset(n for n in map(normalize_answer, (reference, *aliases)) if n)


def _row_aliases(value: Any) -> tuple[str, ...]:
    """One row's aliases: None, a list of strings, or a JSON array of strings; else a RewardError."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RewardError(f"aliases {value[:80]!r} is neither a list nor a JSON array of answers") from None
    if not isinstance(value, list | tuple) or not all(isinstance(a, str) for a in value):
        raise RewardError(f"aliases must be a list of answers (text), got {_json_type(value)} {str(value)[:80]!r}")
    return tuple(value)


def exact_match(
    completions: list,
    answer: list,
    aliases: list | None = None,
    *,
    marker: str | None = None,
    answer_tag: str = "answer",
    **_: object,
) -> list[float]:
    """1.0 when the completion's final answer equals the reference (or one of the row's aliases) as text, after normalization.

    The final answer is the last `<answer>…</answer>` block (`answer_tag`); else, after any `</think>`, the first
    non-empty line after the last `marker` (say "Answer:"; case-insensitive) when it is set and present; else the
    completion's last non-empty line. Both sides are normalized (`normalize_answer`): Unicode NFKC, case-folded,
    inner whitespace collapsed, surrounding whitespace and punctuation (`.,;:!?*_`, quotes, brackets; not `-`
    or `#`) stripped, one leading article (a, an, the) dropped. A final line that quotes its answer, as chat models
    write it ('The plural of "fox" is "foxes".'), is also read by the phrase it quotes last. Nothing else is
    forgiven: "Paris, France" is not "Paris", and "The answer is Paris" as the last line is not either (ask for the
    answer on its own line, or set `marker` or use the tag). `aliases`, an optional column, holds each row's other
    right answers: a list, or a JSON-array string of them.

    >>> exact_match(["The capital is Paris.\\nParis.", "<answer>the Eiffel Tower</answer>", "Answer: paris!"],
    ...             answer=["Paris", "Eiffel Tower", "Paris"], marker="Answer:")
    [1.0, 1.0, 1.0]
    >>> exact_match(["Paris, France", "The answer is Paris", "Lyon", ""], answer=["Paris"] * 4)
    [0.0, 0.0, 0.0, 0.0]
    >>> exact_match(['The plural of "fox" is "foxes".', 'Not "foxes" but "foxen".', '"fox"'], answer=["foxes"] * 3)
    [1.0, 0.0, 0.0]
    >>> exact_match(["NYC", "Big Apple", "Boston"], answer=["New York City"] * 3,
    ...             aliases=[["NYC"], '["the Big Apple"]', None])
    [1.0, 1.0, 0.0]
    """
    check_tag(answer_tag, "answer_tag")
    n = len(completions)
    if aliases is not None and len(aliases) != n:
        raise RewardError(f"exact_match: {len(aliases)} rows of aliases for {n} completions (aliases is a column)")
    per_row = [()] * n if aliases is None else [_row_aliases(a) for a in aliases]
    scores = []
    for completion, ref, extra in zip(completions, answer, per_row, strict=True):
        span = final_span(completion_text(completion), marker=marker, answer_tag=answer_tag)
        right = _right_answers(str(ref), extra)
        readings = [span, *_QUOTED.findall(span)[-1:]]  # the line, and the phrase it quotes last
        scores.append(float(any((got := normalize_answer(r)) and got in right for r in readings)))
    return scores


def check_exact_match_arguments(aliases: object = None, marker: object = None, answer_tag: str = "answer") -> None:
    """exact_match's arguments before any work: `aliases` is a column, never an argument."""
    if aliases is not None:
        raise RewardError(
            "exact_match: aliases is a column (each row's other right answers), not an argument; "
            "put them in the data as an 'aliases' list per row"
        )
    if marker is not None and (not isinstance(marker, str) or not marker.strip()):
        raise RewardError(f"exact_match: marker must be a non-empty text such as 'Answer:', got {marker!r}")
    check_tag(answer_tag, "answer_tag")


_SEVERAL_LINES = (
    "the answer spans several lines: {reward} reads one line of a reply (its last, or the line after the marker) "
    "unless the reply uses the answer tag; write the answer on one line"
)


def exact_match_reference_problem(
    answer: str, aliases: object = None, *, marker: str | None = None, answer_tag: str = "answer"
) -> str | None:
    """Why exact_match cannot judge a row whose reference is `answer`; None when it can.

    >>> exact_match_reference_problem("Paris", ["City of Light"]) is None
    True
    >>> exact_match_reference_problem("...")
    "the answer '...' is empty once normalized (case, surrounding punctuation, articles): exact_match can never match it"
    >>> exact_match_reference_problem("Paris", "Lutetia")
    "the row's aliases: aliases 'Lutetia' is neither a list nor a JSON array of answers"
    """
    try:
        _row_aliases(aliases)
    except RewardError as exc:
        return f"the row's aliases: {exc}"
    text = str(answer)
    if not normalize_answer(text):
        return (
            f"the answer {text[:80]!r} is empty once normalized (case, surrounding punctuation, articles): "
            "exact_match can never match it"
        )
    if len(text.strip().splitlines()) > 1:
        return _SEVERAL_LINES.format(reward="exact_match")
    return None


# --- one of a task's labels -----------------------------------------------------------------------------------


def _fold(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


@functools.lru_cache(maxsize=4096)
def _label_pattern(keys: tuple[str, ...]) -> re.Pattern[str] | None:
    """The labels, longest first, as one whole-word pattern: at each position the longest label matches."""
    ordered = sorted({k for k in keys if k}, key=len, reverse=True)
    if not ordered:
        return None
    return re.compile(rf"(?<!\w)(?:{'|'.join(map(re.escape, ordered))})(?!\w)")


def named_labels(span: str, labels: Sequence[str]) -> set[str]:
    """The labels (case-folded) a span names: each a whole-word, case-insensitive match; where labels overlap,
    the longest match at a position wins and matches do not overlap ("not neutral" names only "not neutral"). A
    label of one character (a multiple choice's A-D) matches in its own case: the article "a" names no choice A.

    >>> sorted(named_labels("Not  Neutral.", ["neutral", "not neutral"]))
    ['not neutral']
    >>> sorted(named_labels("positive or negative", ["positive", "negative"])), named_labels("nonpositive", ["positive"])
    (['negative', 'positive'], set())
    >>> named_labels("The answer is B, as a result of the rule.", ["A", "B", "C", "D"])
    {'b'}
    """
    words = tuple(_fold(label) for label in labels if len(_fold(label)) > 1)
    letters = tuple(unicodedata.normalize("NFKC", label).strip() for label in labels if len(_fold(label)) == 1)
    found: set[str] = set()
    taken: list[tuple[int, int]] = []  # a longer label's match holds its letters: none of them is a label too
    if (pattern := _label_pattern(words)) is not None:
        for m in pattern.finditer(folded := _fold(span)):
            found.add(m.group(0))
            taken.append(m.span())
    if (exact := _label_pattern(letters)) is not None:
        text = " ".join(unicodedata.normalize("NFKC", span).split())  # the same positions as the folded text's
        same = len(text) == len(folded) if pattern is not None else True
        for m in exact.finditer(text):
            if not (same and any(a <= m.start() < b for a, b in taken)):
                found.add(_fold(m.group(0)))
    return found


def _row_labels(labels: Any, n: int) -> list[Sequence[str]]:
    """The labels of each of n rows: one flat list of names for every row (bound once as an argument), or a list
    per row (a column)."""
    if labels is None:
        raise RewardError(
            "label needs the task's labels: bind them once (args: {labels: [positive, negative]}) or give each "
            "row a 'labels' column (a list)"
        )
    if not isinstance(labels, list | tuple):
        raise RewardError(f"labels must be a list of label names, got {_json_type(labels)}")
    if all(isinstance(x, str) for x in labels):
        return [labels] * n
    if len(labels) != n:
        raise RewardError(f"label: {len(labels)} rows of labels for {n} completions")
    for row in labels:
        if not isinstance(row, list | tuple) or not all(isinstance(x, str) for x in row):
            raise RewardError(
                f"labels: each row's labels must be a list of label names (text), got {_json_type(row)} "
                f"{str(row)[:80]!r}"
            )
    return list(labels)


def label(
    completions: list,
    answer: list,
    labels: list | None = None,
    *,
    marker: str | None = None,
    answer_tag: str = "answer",
    **_: object,
) -> list[float]:
    """1.0 when the completion's final answer names exactly one of the task's labels, and it is the reference.

    The final answer is found as `exact_match` finds it (the last `<answer>` block, else the line after the
    last `marker`, else the last non-empty line). A label is named by a whole-word, case-insensitive match
    (Unicode NFKC, whitespace collapsed; a one-letter label, a multiple choice's A-D, in its own case, so the article
    "a" is no choice A) anywhere in that span: "Sentiment: Positive." names positive,
    "nonpositive" names nothing. Where labels overlap the longest match wins ("not neutral" names not neutral,
    not neutral). Naming two labels ("positive or negative") or none scores 0. `labels` is bound once as an
    argument (`args: {labels: [positive, negative]}`, the same for every row) or is a column (a list per row).

    >>> label(["Sentiment: Positive.", "I'd say positive or negative", "negative", "meh"],
    ...       answer=["positive"] * 4, labels=["positive", "negative"])
    [1.0, 0.0, 0.0, 0.0]
    >>> label(["not neutral", "neutral"], answer=["neutral", "neutral"], labels=[["neutral", "not neutral"]] * 2)
    [0.0, 1.0]
    """
    n = len(completions)
    scores = []
    for completion, ref, names in zip(completions, answer, _row_labels(labels, n), strict=True):
        named = named_labels(final_span(completion_text(completion), marker=marker, answer_tag=answer_tag), names)
        reference = _fold(str(ref))
        scores.append(float(named == {reference} and reference in {_fold(x) for x in names}))
    return scores


def check_label_arguments(labels: object = None, marker: object = None, answer_tag: str = "answer") -> None:
    """label's arguments before any work: labels bound once are a list of two or more distinct names."""
    if labels is not None:
        if not isinstance(labels, list | tuple) or not all(isinstance(x, str) for x in labels):
            raise RewardError(f"label: labels must be a list of label names (text), got {labels!r}")
        folded = [_fold(x) for x in labels]
        if not all(folded) or len(set(folded)) < 2:
            raise RewardError(f"label: labels must be two or more distinct, non-empty names, got {labels!r}")
    check_exact_match_arguments(marker=marker, answer_tag=answer_tag)


def label_reference_problem(answer: str, labels: object = None) -> str | None:
    """Why label cannot judge a row whose reference is `answer`, given the row's labels (bound or its own);
    None when it can.

    >>> label_reference_problem("Positive", ["positive", "negative"]) is None
    True
    >>> label_reference_problem("maybe", ["positive", "negative"])
    "the answer 'maybe' is not among the labels (negative, positive): add it to labels or fix the row"
    >>> label_reference_problem("positive", "positive, negative")
    "the row's labels are a string, not a list of label names: write them as a list, e.g. ['positive', 'negative']"
    """
    if labels is None:
        return (
            "label has no labels for this row: bind them once (args: {labels: [positive, negative]}) or give "
            "each row a 'labels' column (a list)"
        )
    if not isinstance(labels, list | tuple):
        return (
            f"the row's labels are {_json_type(labels)}, not a list of label names: write them as a list, "
            "e.g. ['positive', 'negative']"
        )
    if stray := [x for x in labels if not isinstance(x, str)]:
        return f"the row's labels hold {_json_type(stray[0])} ({str(stray[0])[:40]!r}), not only label names (text)"
    if _fold(str(answer)) not in {_fold(x) for x in labels}:
        listed = ", ".join(sorted(labels))
        return f"the answer {str(answer)[:80]!r} is not among the labels ({listed}): add it to labels or fix the row"
    if len(str(answer).strip().splitlines()) > 1:
        return _SEVERAL_LINES.format(reward="label")
    return None


# --- JSON objects ---------------------------------------------------------------------------------------------

MAX_JSON_CHARS = 65_536  # a completion longer than this (in characters) is not scanned: it scores 0
MAX_JSON_DEPTH = 64  # an object nested deeper than this scores 0
# Places where a JSON value starts (parsed, or not JSON after all) scanned in one completion; more scores 0. Each
# failed parse costs json's error message a pass over the text before it, so this bounds a completion of
# thousands of '{"' to milliseconds; a reply holds a few.
MAX_JSON_STARTS = 256


class _Refused(Exception):
    """A JSON text no reward judges: a key twice, NaN or Infinity, a number out of range, nesting too deep."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Refused("an object has a key twice")
    return obj


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"{text} is out of range")
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_constant, parse_float=_float)
# Where a JSON value may start: an object's '{' before a key or '}', or an array's '[' (parsed only to skip it:
# an object inside an array is not top-level).
_START = re.compile(r"\{\s*[\"}]|\[\s*[\[{\"\-0-9tfn\]]")


def _depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value, without recursion: 0 for a scalar, 1 for {"a": 1}."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def json_equal(a: Any, b: Any) -> bool:
    """Two parsed JSON values are the same value: numbers by value (1 = 1.0), never a number and a string (34 is
    not "34") or a boolean (true is not 1); strings exactly; arrays in order; objects with the same keys.

    >>> json_equal({"a": [1, {"b": None}]}, {"a": [1.0, {"b": None}]}), json_equal(34, "34"), json_equal(True, 1)
    (True, False, False)
    """
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float):
        return isinstance(b, int | float) and a == b
    if isinstance(a, str) or a is None:
        return type(a) is type(b) and a == b
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return False


def find_object(text: str) -> dict[str, Any] | None:
    """The one top-level JSON object in a completion, or None.

    The object may stand bare or in a fenced block (```json), with prose around it; an object inside an array is
    not top-level. None when there is no object, when there are two that differ (the same object twice is one),
    or when the text is refused: over `MAX_JSON_CHARS` characters, an object with a key twice, NaN, Infinity or
    a number out of float range, nesting deeper than `MAX_JSON_DEPTH`, more than `MAX_JSON_STARTS` places that
    start a JSON value (`{"`, `[1`, ...).

    >>> find_object('Here it is:\\n```json\\n{"name": "Ann", "age": 34}\\n```\\nDone.')
    {'name': 'Ann', 'age': 34}
    >>> find_object('{"a": 1} or {"a": 2}'), find_object('{"a": 1, "a": 2}'), find_object('[{"a": 1}]')
    (None, None, None)
    >>> find_object('{"a": NaN}'), find_object("[" * 100_000), find_object('{"a": 1} and again {"a": 1.0}')
    (None, None, {'a': 1})
    """
    if len(text) > MAX_JSON_CHARS:
        return None
    found: list[dict[str, Any]] = []
    pos = 0
    for _ in range(MAX_JSON_STARTS):
        start = _START.search(text, pos)
        if start is None:
            return found[0] if found else None
        i = start.start()
        try:
            value, end = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            pos = max(exc.pos, i + 1)  # everything before the error was read: the scan stays linear
            continue
        except (_Refused, RecursionError, ValueError):  # ValueError: an integer of over 4,300 digits
            return None
        pos = end
        if isinstance(value, dict):
            if _depth(value) > MAX_JSON_DEPTH:
                return None
            if not any(json_equal(value, seen) for seen in found):
                found.append(value)
                if len(found) > 1:
                    return None
    return None  # more starts than MAX_JSON_STARTS: no reply needs them


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", tuple: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), f"a {type(value).__name__}")


def _parse_reference(answer: Any) -> dict[str, Any] | str:
    """The reference as a JSON object, or why it is not one."""
    if isinstance(answer, Mapping):
        answer = json.dumps(answer, sort_keys=True, ensure_ascii=False)
    return _reference_object(str(answer))


@functools.lru_cache(maxsize=4096)  # a group's completions share one reference
def _reference_object(text: str) -> dict[str, Any] | str:
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        return f"the answer is not JSON ({exc.msg} at character {exc.pos})"
    except _Refused as exc:
        return f"the answer is not JSON that can be judged: {exc}"
    except (RecursionError, ValueError):
        return "the answer is not JSON that can be judged: nested too deep or a number too long"
    if not isinstance(value, dict):
        return f"the answer is not a JSON object (it is {_json_type(value)})"
    if _depth(value) > MAX_JSON_DEPTH:
        return f"the answer is nested deeper than {MAX_JSON_DEPTH} levels"
    return value


def json_fields(
    completions: list, answer: list, *, fields: list[str] | None = None, partial: bool = False, **_: object
) -> list[float]:
    """1.0 when the completion holds exactly one JSON object and its named fields equal the reference's.

    The reference (`answer`) is a JSON object as a string. The completion's object is found by `find_object`: bare
    or in a ```json block, prose around it allowed; two different objects, a key twice, NaN/Infinity, nesting
    deeper than 64 levels or a completion over 65,536 characters score 0. The fields are `fields` (top-level
    keys), default all of the reference's; keys the completion adds are ignored. Values compare as JSON values
    (`json_equal`): numbers by value (1 = 1.0), never across types (34 is not "34", true is not 1), strings
    exactly (case and spaces count), nested objects and arrays whole (arrays in order). With `partial: true` the
    score is the fraction of the fields right (shaping, not the skill).

    >>> ref = '{"age": 34, "name": "Ann"}'
    >>> json_fields(['Sure! {"name": "Ann", "age": 34.0, "note": "x"}', '```json\\n{"name": "Ann", "age": "34"}\\n```',
    ...              '{"name": "Ann", "age": 34, "name": "Bob"}', '{"name": "Ann"} {"age": 34}'], answer=[ref] * 4)
    [1.0, 0.0, 0.0, 0.0]
    >>> json_fields(['{"name": "Ann", "age": 35}'] * 2, answer=[ref] * 2, partial=True)
    [0.5, 0.5]
    >>> json_fields(['{"name": "Ann", "age": 35}'], answer=[ref], fields=["name"])
    [1.0]
    """
    scores = []
    for completion, ref in zip(completions, answer, strict=True):
        reference = _parse_reference(ref)
        got = find_object(completion_text(completion))
        if isinstance(reference, str) or got is None:
            scores.append(0.0)  # a reference that is not an object: the data stage's reference check says why
            continue
        names = list(reference) if fields is None else fields
        right = sum(1 for k in names if k in got and k in reference and json_equal(got[k], reference[k]))
        if partial:
            scores.append(right / len(names) if names else 1.0)
        else:
            scores.append(float(right == len(names)))
    return scores


def check_json_fields_arguments(fields: object = None, partial: object = False) -> None:
    """json_fields' arguments before any work."""
    if fields is not None and (
        not isinstance(fields, list | tuple) or not fields or not all(isinstance(f, str) and f for f in fields)
    ):
        raise RewardError(f"json_fields: fields must be a non-empty list of field names (text), got {fields!r}")
    if not isinstance(partial, bool):
        raise RewardError(f"json_fields: partial must be true or false, got {partial!r}")


def json_fields_reference_problem(answer: str, *, fields: Sequence[str] | None = None) -> str | None:
    """Why json_fields cannot judge a row whose reference is `answer`; None when it can.

    >>> json_fields_reference_problem('{"age": 34}') is None
    True
    >>> json_fields_reference_problem('[1, 2]'), json_fields_reference_problem("Ann, 34")
    ('the answer is not a JSON object (it is a list)', 'the answer is not JSON (Expecting value at character 0)')
    >>> json_fields_reference_problem('{"name": "Ann"}', fields=["name", "age"])
    "the answer lacks the field 'age' that json_fields' fields names"
    """
    reference = _parse_reference(answer)
    if isinstance(reference, str):
        return reference
    if fields is None and not reference:
        return "the answer is an empty JSON object: json_fields has no field to check (name some with fields)"
    lacking = [f for f in fields or () if f not in reference]
    if lacking:
        return f"the answer lacks the field{'s' if len(lacking) > 1 else ''} {', '.join(map(repr, lacking))} that json_fields' fields names"
    return None


def _validator_class(schema: Any) -> Any:
    """The `jsonschema` validator for a schema's draft; the package (no type stubs) imported by a run that uses it."""
    from jsonschema.validators import validator_for  # type: ignore[import-untyped]

    return validator_for(schema)


@functools.lru_cache(maxsize=64)
def _validator(schema_json: str) -> Any:
    schema = json.loads(schema_json)
    return _validator_class(schema)(schema)


def json_schema(completions: list, *, schema: Mapping[str, Any] | bool | None = None, **_: object) -> list[float]:
    """1.0 when the completion holds exactly one JSON object (found as `json_fields` finds it) and, when `schema` is given, it validates against that JSON Schema.

    Shaping: it says the reply is well-formed JSON of the right shape, not that its values are right (that is
    `json_fields`). The schema's draft is its `$schema` (default: the latest `jsonschema` knows); a schema that is
    not valid is refused before any work.

    >>> schema = {"type": "object", "required": ["age"], "properties": {"age": {"type": "integer"}}}
    >>> json_schema(['{"age": 34}', 'Age: {"age": "34"}', '{"name": "Ann"}', "34"], schema=schema)
    [1.0, 0.0, 0.0, 0.0]
    >>> json_schema(['{"age": 34}', '{"a": 1} {"b": 2}'])
    [1.0, 0.0]
    """
    validator = None if schema is None else _validator(json.dumps(schema, sort_keys=True))
    scores = []
    for completion in completions:
        got = find_object(completion_text(completion))
        scores.append(float(got is not None and (validator is None or validator.is_valid(got))))
    return scores


def check_json_schema_arguments(schema: object = None) -> None:
    """json_schema's schema is a valid JSON Schema, before any work.

    >>> check_json_schema_arguments({"type": "objekt"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    grpo_pipeline.trainer.rewards.base.RewardError: json_schema: schema is not a valid JSON Schema: 'objekt' is not valid under any of the given schemas...
    """
    if schema is None:
        return
    if not isinstance(schema, Mapping | bool):
        raise RewardError(f"json_schema: schema must be a JSON Schema (an object), got {_json_type(schema)}")
    from jsonschema.exceptions import SchemaError  # type: ignore[import-untyped]

    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise RewardError(f"json_schema: schema is not JSON: {exc}") from None
    try:
        _validator_class(schema).check_schema(schema)
    except SchemaError as exc:
        raise RewardError(f"json_schema: schema is not a valid JSON Schema: {exc.message}") from None
    _validator(text)
