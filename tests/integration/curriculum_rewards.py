"""A test reward for the curriculum: the rows whose `kind` is "same" give every completion the same score
(no variance, no gradient), the others alternate 0 and 1 within each group."""


def same_for_some(completions, kind, **_) -> list[float]:
    """
    >>> same_for_some(["a", "b", "c", "d"], kind=["same", "same", "varied", "varied"])
    [1.0, 1.0, 0.0, 1.0]
    """
    return [1.0 if k == "same" else float(i % 2) for i, k in enumerate(kind)]


def varied_shape(completions, **_) -> list[float]:
    """A stand-in shaping reward that differs in every group (as a length penalty does), task or not.

    >>> varied_shape(["a", "b", "c"])
    [0.0, 0.5, 0.0]
    """
    return [0.5 * (i % 2) for i in range(len(completions))]
