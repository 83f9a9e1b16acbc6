"""Test rewards for the task check: one that calls every completion right (a task the base has solved) and one that
calls every completion wrong (a task it cannot start on). Neither takes the `answer` column, so the data stage's
verifiability check (which offers each answer-checking reward the reference itself) keeps every row."""


def always_right(completions, **_) -> list[float]:
    """
    >>> always_right(["a", "b"])
    [1.0, 1.0]
    """
    return [1.0] * len(completions)


def never_right(completions, **_) -> list[float]:
    """
    >>> never_right(["a", "b"])
    [0.0, 0.0]
    """
    return [0.0] * len(completions)
