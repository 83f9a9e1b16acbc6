"""Launchers share one interface: `launch(spec) -> handle`, `wait(handle) -> TrainResult`, `cancel(handle)`."""

from infra.launch.local import LocalLauncher, TrainingFailed

__all__ = ["LocalLauncher", "TrainingFailed"]
