"""The one launch interface: every launcher takes a `JobSpec` and gives back the trainer's `TrainResult`.

- `launch(spec) -> handle` starts the job, `wait(handle) -> TrainResult` follows it to the end (through its
  relaunches) and raises `TrainingFailed` (the job contract's, `trainer.spec`) when it cannot finish, `cancel(handle)` stops it (the trainer
  checkpoints on SIGTERM).
- `LocalLauncher` (`infra.launch.local`) runs the trainer as a subprocess here, the embedded default;
  `SkyLauncher` (`infra.launch.skypilot`) runs it as a SkyPilot managed job on spot GPUs.
- `make_launcher` picks one from `train.launcher`; `preflight` checks what that launcher needs before any
  work is done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from configs.schema import TrainConfig
from trainer.spec import JobSpec, TrainingFailed, TrainResult

__all__ = ["Launcher", "TrainingFailed", "make_launcher", "preflight", "run_job"]


class Launcher(Protocol):
    def launch(self, spec: JobSpec) -> Any: ...

    def wait(self, handle: Any) -> TrainResult: ...

    def cancel(self, handle: Any) -> None: ...


def make_launcher(
    train: TrainConfig, on_line: Callable[[str], None] | None = None, on_status: Callable[[str], None] | None = None
) -> Launcher:
    """The launcher `train.launcher` names; `on_line` gets each line of the trainer's output, `on_status`
    the managed job's state changes."""
    if train.launcher == "sky":
        from infra.launch.skypilot import SkyLauncher

        return SkyLauncher(train.sky, train.max_restarts, on_status=on_status, on_line=on_line)
    from infra.launch.local import LocalLauncher

    return LocalLauncher(train.max_restarts, on_line=on_line)


def preflight(train: TrainConfig, mlflow_uri: str) -> None:
    """What the configured launcher needs, checked before anything runs; each failure names its fix."""
    if train.launcher == "sky":
        from infra.launch.skypilot import preflight as sky_preflight

        sky_preflight(train, mlflow_uri)


def run_job(launcher: Launcher, spec: JobSpec) -> TrainResult:
    """Launch and wait; a cancelled caller (a cancelled flow run, Ctrl-C) must not leave the trainer
    running, or a GPU rented, on its own."""
    handle = launcher.launch(spec)
    try:
        return launcher.wait(handle)
    except TrainingFailed:
        raise
    except BaseException:
        launcher.cancel(handle)
        raise
