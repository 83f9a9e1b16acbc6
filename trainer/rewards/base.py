"""What every reward shares: the completion's text in either TRL format, and the one error a reward raises."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

RewardFn = Callable[..., list[float]]


class RewardError(ValueError):
    """A reward that cannot run or gave unusable scores; the message names the reward and, where one is to
    blame, the row. A ValueError, so the stages that check rewards before any work report it as bad input.
    It repeats on every attempt (a wrong number of scores, NaN, a missing column, an exception the reward
    raises again on one row): the trainer exits 2 on it and no launcher relaunches it."""


class RewardUnavailable(RewardError):
    """A reward that could not run for a reason outside the reward and the data: its service down after its
    retries, a connection or timeout, memory exhausted. Another attempt may succeed, so the trainer exits 1
    on it (relaunched, resumed from its checkpoint), never 2. A `RewardError` too, so whoever shows reward
    failures (`rewards check`, the evaluation) shows its message the same way."""


def completion_text(completion: str | list[dict]) -> str:
    """The assistant text of a completion in either TRL format.

    >>> completion_text([{"role": "assistant", "content": " 7"}])
    ' 7'
    """
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion if m.get("role", "assistant") == "assistant")


_MINUS = {"−": "-", "﹣": "-", "－": "-"}


def ascii_digits(text: str) -> str:
    """Text with every Unicode decimal digit (Arabic-Indic, Devanagari, full-width, ...) written as an ASCII
    one, and the Unicode minus signs as '-'.

    >>> ascii_digits("٤٢ and ７ and −3")
    '42 and 7 and -3'
    """
    if text.isascii():
        return text
    return "".join(str(unicodedata.decimal(c)) if c.isdecimal() else _MINUS.get(c, c) for c in text)


_TAG_CHARS = re.compile(r"^[A-Za-z][\w.-]*$")


def check_tag(tag: str, what: str) -> str:
    """An XML-like tag name (`think`, `answer`), refused when it could not be matched literally."""
    if not _TAG_CHARS.match(tag):
        raise RewardError(f"{what} {tag!r} is not a tag name (letters, digits, '_', '-', '.')")
    return tag
