"""The one launch interface: every launcher takes a `JobSpec` and gives back the trainer's `TrainResult`.

- `launch(spec) -> handle` starts the job, `wait(handle) -> TrainResult` follows it to the end (through its
  relaunches) and raises `TrainingFailed` (the job contract's, `grpo_pipeline.trainer.spec`) when it cannot finish, `cancel(handle)` stops it (the trainer
  checkpoints on SIGTERM).
- `LocalLauncher` (`grpo_pipeline.infra.launch.local`) runs the trainer as a subprocess here, the embedded default;
  `SkyLauncher` (`grpo_pipeline.infra.launch.skypilot`) runs it as a SkyPilot managed job on spot GPUs.
- Each launcher's module defines `KIND` (a `LauncherKind`): how it is built, the GPU counts its nodes may have and
  what it needs before any work. The launcher registry (`grpo_pipeline.configs.launchers.LAUNCHERS`) names each
  launcher's module in its entry, beside what the config knows of it; `launcher_kind` imports it on use, so a run
  loads only the launcher it uses. A new launcher is one module and one entry there.
- `make_launcher` builds the one `train.launcher` names; `check_launcher` checks what that launcher needs before any
  work is done, including whether `train.distributed` can launch at all (`grpo_pipeline.trainer.distributed.problems`:
  processes against GPUs, batch against num_generations, strategy against quantization, store against nodes);
  `check_launch` repeats that for the very job spec a launcher is handed, before it starts anything.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from grpo_pipeline.configs import library_fields
from grpo_pipeline.configs.launchers import LAUNCHERS
from grpo_pipeline.configs.schema import ConfigError, ModelConfig, TrainConfig
from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.distributed import problems
from grpo_pipeline.trainer.launch import strategy_env
from grpo_pipeline.trainer.spec import JobSpec, TrainingFailed, TrainResult

__all__ = [
    "BadTrainingInput",
    "LaunchRefused",
    "Launcher",
    "LauncherKind",
    "TrainingFailed",
    "check_launch",
    "launcher_kind",
    "make_launcher",
    "check_launcher",
    "run_job",
]


class LaunchRefused(ConfigError):
    """The job cannot run as configured (exit 2 from the CLI); nothing was started."""


class BadTrainingInput(TrainingFailed, ConfigError):
    """The trainer exited 2 (its spec, a reward or the data is at fault): every attempt would fail the same way,
    so it was not relaunched; exit 2 from the CLI, like any bad input, with the trainer's reason first."""


class Launcher(Protocol):
    def launch(self, spec: JobSpec) -> Any: ...

    def wait(self, handle: Any) -> TrainResult: ...

    def cancel(self, handle: Any) -> None: ...


Listener = Callable[[str], None] | None  # gets each line of output, or each state change


@dataclass(frozen=True)
class LauncherKind:
    """How one launcher is built and checked; each launcher's module defines one, `KIND`."""

    build: Callable[[TrainConfig, Listener, Listener], Launcher]  # (train, on_line, on_status)
    gpus_per_node: Callable[[TrainConfig], list[int]]  # each GPU count a node of the job may have
    check: Callable[[TrainConfig, str], None]  # (train, mlflow_uri): what it needs beyond a launchable job


def launcher_kind(name: str) -> LauncherKind:
    """The launcher `name` (a `train.launcher` value, which the config has checked against the registry): its
    entry's module, imported now, and that module's `KIND`."""
    kind: LauncherKind = importlib.import_module(LAUNCHERS[name].module).KIND
    return kind


def make_launcher(train: TrainConfig, on_line: Listener = None, on_status: Listener = None) -> Launcher:
    """The launcher `train.launcher` names; `on_line` gets each line of the trainer's output, `on_status`
    the job's state changes."""
    return launcher_kind(train.launcher).build(train, on_line, on_status)


def check_launch(spec: JobSpec, gpu_counts: list[int]) -> None:
    """Refuse (LaunchRefused, exit 2) a job whose processes could not start or would fail once started."""
    defaults = {name: f.default for name, f in library_fields.fields("GRPOConfig").items()}  # TRL not imported
    found = list(dict.fromkeys(p for gpus in gpu_counts for p in problems(spec, gpus, defaults)))
    if spec.train.distributed.strategy != "ddp" and not found:
        try:  # accelerate's own parser reads the strategy's config file with the overrides
            strategy_env(spec, max(gpu_counts) or 1, spec.train.distributed.nodes)
        except ValueError as exc:
            found.append(str(exc))
    if found:
        raise LaunchRefused("cannot launch training:\n  " + "\n  ".join(found))


def check_launcher(train: TrainConfig, mlflow_uri: str, model: ModelConfig | None = None) -> None:
    """What the configured launcher needs, checked before anything runs; each failure names its fix."""
    probe = JobSpec(
        model_path="",
        model=model_load(model or ModelConfig()),
        train=train_settings(train),
        train_file="",
        work_dir="",
        adapter_dir="",
        checkpoint_uri=train.checkpoint_uri or "",
    )
    kind = launcher_kind(train.launcher)
    check_launch(probe, kind.gpus_per_node(train))
    kind.check(train, mlflow_uri)


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
