"""A test reward for the hyperparameter search's bad input: every trial diverges (raises once a step has trained),
whatever its learning rate."""


def diverging_reward(completions, trainer_state=None, **_) -> list[float]:
    """
    >>> diverging_reward(["a"])
    [0.0]
    """
    if trainer_state is not None and trainer_state.global_step >= 1:
        raise FloatingPointError("loss diverged (nan) at this learning rate")
    return [0.0] * len(completions)
