"""What a command that works for a while (`stack up`, `stack down`, `deploy`) shows meanwhile, on stderr only (their
stdout carries exports or JSON): a spinner saying what it is doing (on a terminal), and a line for each step done
with its time (a CI log too)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from grpo_pipeline.failure import err

# step(doing, done): the spinner reads "<doing> ..." while the step runs, then "<done> (<seconds> s)" is printed
Steps = Callable[[str, str], AbstractContextManager[None]]


@contextmanager
def progress() -> Iterator[Steps]:
    """The spinner for the command's whole run; yields `step`, which wraps each step. A step that raises prints no
    line: the command's failure says what happened."""
    with err.status("", spinner="dots") as status:

        @contextmanager
        def step(doing: str, done: str) -> Iterator[None]:
            status.update(f"{doing} ...")
            began = time.monotonic()
            yield
            err.print(f"{done} ({time.monotonic() - began:.0f} s)", highlight=False, markup=False)

        yield step
