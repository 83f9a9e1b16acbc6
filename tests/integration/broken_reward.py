"""A test reward that gives the trainer garbage: NaN for the second completion of every batch."""


def nan_on_second_row(completions, **_) -> list[float]:
    """
    >>> nan_on_second_row(["a", "b"])
    [0.0, nan]
    """
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]
