"""A test reward that gives the trainer garbage: NaN for one completion of every batch (`row`, an argument that
`train.reward_args` sets)."""


def nan_on_row(completions, *, row: int = 1, **_) -> list[float]:
    """
    >>> nan_on_row(["a", "b"])
    [0.0, nan]
    """
    return [float("nan") if i == row else 0.0 for i in range(len(completions))]
