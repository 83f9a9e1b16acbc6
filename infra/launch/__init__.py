"""Launchers share one interface: `launch(spec) -> handle`, `wait(handle) -> TrainResult`, `cancel(handle)`.

LocalLauncher runs the trainer as a subprocess here (the embedded default); SkyLauncher
(`infra.launch.skypilot`) runs it as a SkyPilot managed job on spot GPUs.
"""

from infra.launch.local import LocalLauncher, TrainingFailed

__all__ = ["LocalLauncher", "TrainingFailed"]
