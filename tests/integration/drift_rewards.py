"""A test reward for the drift stage that reads only the reference answer: 1.0 for a whole number, else 0.0. With it
the champion's reward on a set of rows is known whatever a random model writes (integer answers: 1, text: 0)."""


def integer_answer(completions, answer, **_) -> list[float]:
    """
    >>> integer_answer(["x", "y"], answer=["12", "blue"])
    [1.0, 0.0]
    """
    return [1.0 if str(a).strip().lstrip("-").isdigit() else 0.0 for a in answer]
