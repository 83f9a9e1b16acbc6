"""A test reward for the hyperparameter search: 1000 x the learning rate the run trains with.

A random tiny model's real rewards are the same noise for every trial, so they cannot show that the
search ranks, prunes and picks by what trials report; with this reward a trial's validation reward is a
known function of its hyperparameters (with a constant learning-rate schedule).
"""


def learning_rate_reward(completions, trainer_state=None, **_) -> list[float]:
    """
    >>> from transformers import TrainerState
    >>> state = TrainerState(log_history=[{"loss": 0.1, "learning_rate": 2e-3, "step": 1}])
    >>> learning_rate_reward(["a", "b"], trainer_state=state)
    [2.0, 2.0]
    """
    history = trainer_state.log_history if trainer_state is not None else []
    lr = next((entry["learning_rate"] for entry in reversed(history) if "learning_rate" in entry), 0.0)
    return [lr * 1000] * len(completions)
