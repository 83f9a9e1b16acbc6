"""A test reward that gives the trainer garbage: NaN for one completion of every batch (`row`, an argument that
its `train.rewards` entry sets)."""


def nan_on_row(completions, *, row: int = 1, **_) -> list[float]:
    """
    >>> nan_on_row(["a", "b"])
    [0.0, nan]
    """
    return [float("nan") if i == row else 0.0 for i in range(len(completions))]


def nan_on_rank(completions, *, rank: int = 1, **_) -> list[float]:
    """NaN for every completion on one rank of a torchrun job (its RANK), 0.0 on the others.

    >>> nan_on_rank(["a"], rank=-1)
    [0.0]
    """
    import os

    bad = int(os.environ.get("RANK", "0")) == rank
    return [float("nan") if bad else 0.0 for _ in completions]
