"""Test rewards for the health rules: one that gives every completion the same score (every group has zero
variance), one that poisons the policy's weights with NaN once at a known step, and one that records each
call (step, time) for the orphan test."""

import os
import time
from pathlib import Path

POISON_ENV = "HEALTH_TEST_POISON"  # a marker file: its absence arms the poison, and poisoning creates it
CALLS_ENV = "HEALTH_TEST_CALLS"  # a file prefix: each rank appends one line per call to <prefix>.rank<N>


def same_score(completions, **_) -> list[float]:
    """
    >>> same_score(["a", "b"])
    [1.0, 1.0]
    """
    return [1.0] * len(completions)


def nan_weights_once(completions, *, at_step: int = 3, trainer_state=None, **_) -> list[float]:
    """A normal reward (length of the completion, mod 3) that, while step `at_step` is being computed, sets one
    trainable weight of the policy to NaN, once per marker file: that step's loss and gradients are then NaN,
    as an overflow would make them. The trainer is found up the call stack (TRL calls rewards from its own
    method), so nothing in the trainer knows about this test."""
    import inspect
    import math

    marker = os.environ.get(POISON_ENV)
    if marker and not Path(marker).exists() and trainer_state is not None and trainer_state.global_step == at_step - 1:
        for frame in inspect.stack():
            owner = frame.frame.f_locals.get("self")
            if owner is not None and any(c.__name__ == "GRPOTrainer" for c in type(owner).__mro__):
                weight = next(p for p in owner.model.parameters() if p.requires_grad)
                weight.data.fill_(math.nan)
                Path(marker).touch()
                break
    return [float(len(c[0]["content"] if isinstance(c, list) else c) % 3) for c in completions]


def recorded(completions, trainer_state=None, **_) -> list[float]:
    """Varied scores; each call appends `<step> <time>` to this rank's file, then waits 0.2 s (a kill lands
    mid-run on any machine)."""
    prefix = os.environ.get(CALLS_ENV)
    if prefix:
        with open(f"{prefix}.rank{os.environ.get('RANK', '0')}", "a") as f:
            f.write(f"{trainer_state.global_step if trainer_state else -1} {time.time()}\n")
    time.sleep(0.2)
    return [float(i % 2) for i in range(len(completions))]


def worse_with_steps(completions, trainer_state=None, **_) -> list[float]:
    """1 / (1 + step), plus 0.01 for completions of odd length (so groups differ and the adapter changes):
    each evaluation scores lower than the one before, so the best validation reward is the first one's."""
    step = trainer_state.global_step if trainer_state is not None else 0
    return [1.0 / (1 + step) + 0.01 * (len(str(c)) % 2) for c in completions]


def longer_is_better(completions, **_) -> list[float]:
    """Pays for length alone, in characters: the reward hacking the length rules are there to catch.

    >>> longer_is_better(["ab", [{"role": "assistant", "content": "abcd"}]])
    [2.0, 4.0]
    """
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


HALT_ENV = "HEALTH_TEST_HALT"  # a marker file: created when step `at_step` starts scoring, then the reward waits


def same_score_halting(completions, *, at_step: int = 3, trainer_state=None, **_) -> list[float]:
    """`same_score`, which with HEALTH_TEST_HALT set stops for good while step `at_step` is being scored (after
    step `at_step - 1`'s checkpoint is in the store), for the test to kill the process there: a preemption at a
    known point, whatever the machine's speed."""
    marker = os.environ.get(HALT_ENV)
    if marker and trainer_state is not None and trainer_state.global_step == at_step - 1:
        Path(marker).touch()
        while True:
            time.sleep(1)
    return same_score(completions)


def same_score_recorded(completions, trainer_state=None, **_) -> list[float]:
    """`same_score`, and each call appends its step to this rank's file (HEALTH_TEST_CALLS), as `recorded`."""
    prefix = os.environ.get(CALLS_ENV)
    if prefix:
        with open(f"{prefix}.rank{os.environ.get('RANK', '0')}", "a") as f:
            f.write(f"{trainer_state.global_step if trainer_state else -1} {time.time()}\n")
    return same_score(completions)
