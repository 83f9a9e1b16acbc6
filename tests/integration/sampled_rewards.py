"""Test rewards for the sampled trial scorer: one that depends only on the row, so a per-prompt mean shows which
prompt its samples came from, and one that depends only on the completion, so it shows the draws."""


def answer_tenth(completions, answer, **_) -> list[float]:
    """
    >>> answer_tenth(["x", "y"], answer=["3", "7"])
    [0.3, 0.7]
    """
    return [int(a) / 10 for a in answer]


def odd_characters(completions, **_) -> list[float]:
    """
    >>> odd_characters(["ab", "abc"])
    [0.0, 1.0]
    """
    return [float(len(c) % 2) for c in completions]
