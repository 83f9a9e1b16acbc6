"""A test reward for a search whose every point fails: each trial runs out of memory once a step has trained,
whatever its learning rate. Memory exhausted inside a reward is a failure of the attempt, not bad input (the
trainer exits 1, a trial is not relaunched), so each trial fails with its reason and the search goes on."""


def oom_reward(completions, trainer_state=None, **_) -> list[float]:
    """
    >>> oom_reward(["a"])
    [0.0]
    """
    if trainer_state is not None and trainer_state.global_step >= 1:
        raise MemoryError("out of memory at this learning rate")
    return [0.0] * len(completions)
