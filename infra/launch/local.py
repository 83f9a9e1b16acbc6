"""Run a training job as a local subprocess, with a managed job's recovery rule.

A SkyPilot managed job relaunches after a preemption or an error until it is done or out of restarts,
and the trainer resumes from its newest complete checkpoint; this launcher does the same on one machine.
It runs the node launcher a SkyPilot node runs (`python -m grpo_pipeline.trainer.launch`), so `train.distributed`'s
processes_per_node start here as they would there: one process is the plain trainer, more run under torchrun
on a free port of this machine.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from grpo_pipeline.infra.launch import BadTrainingInput, LauncherKind, TrainingFailed, check_launch
from grpo_pipeline.tasks.job import check_store
from grpo_pipeline.trainer.launch import PARENT_PID_ENV, detect_gpus, free_port
from grpo_pipeline.trainer.spec import (
    EXIT_BAD_INPUT,
    EXIT_SUPERSEDED,
    NOT_RELAUNCHED,
    RESULT_FILE,
    JobSpec,
    TrainResult,
    parse_bad_input,
)

log = logging.getLogger(__name__)


@dataclass
class LocalHandle:
    spec: JobSpec
    spec_path: Path
    process: subprocess.Popen
    restarts: int = 0
    cancelled: bool = False
    tail: deque = field(default_factory=lambda: deque(maxlen=30))
    # the trainer's exit-2 reason, kept as the lines pass: another rank's traceback can push it out of `tail`
    bad_input: str | None = None


class LocalLauncher:
    def __init__(self, max_restarts: int = 3, on_line: Callable[[str], None] | None = None):
        self.max_restarts = max_restarts
        self.on_line = on_line or (lambda line: log.info("trainer: %s", line))

    def _start(self, spec_path: Path) -> subprocess.Popen:
        # a fresh port each start: the last attempt's rendezvous port may linger in TIME_WAIT
        # PARENT_PID_ENV: the launcher dies with this process (grpo_pipeline.trainer.launch.launcher_lifeline), so a flow that
        # is SIGKILLed leaves no trainer behind; it must be waited on from this thread (`wait` is)
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "grpo_pipeline.trainer.launch",
                "--spec",
                str(spec_path),
                "--master-port",
                str(free_port()),
                # what this process found (check_launch asked already): the node launcher need not import
                # torch (seconds) to count them again before it execs the trainer, which imports it anyway
                "--gpus-per-node",
                str(detect_gpus()),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
        )

    def launch(self, spec: JobSpec) -> LocalHandle:
        check_launch(spec, [detect_gpus()])  # before anything is written or started
        spec_path = spec.write(Path(spec.work_dir) / "job.json")
        return LocalHandle(spec, spec_path, self._start(spec_path))

    def wait(self, handle: LocalHandle) -> TrainResult:
        log_path = Path(handle.spec.work_dir) / "trainer.log"
        while True:
            with log_path.open("a") as log_file:
                assert handle.process.stdout is not None  # started with stdout=PIPE
                for line in handle.process.stdout:
                    log_file.write(line)
                    handle.tail.append(line.rstrip())
                    if handle.bad_input is None:
                        handle.bad_input = parse_bad_input(line.rstrip())
                    self.on_line(line.rstrip())
            code = handle.process.wait()
            if code == 0:
                result = TrainResult.model_validate_json((Path(handle.spec.work_dir) / RESULT_FILE).read_text())
                return result.model_copy(update={"restarts": handle.restarts})
            if handle.cancelled:
                raise TrainingFailed("training was cancelled")
            # Bad input (a bad spec, a reward that gives unusable scores) fails the same way every time; a superseded
            # attempt (a newer one owns the checkpoint store: trainer/fence.py) must not come back to take it over.
            if code in NOT_RELAUNCHED or handle.restarts >= self.max_restarts:
                why = {
                    EXIT_BAD_INPUT: " (bad input: not relaunched)",
                    EXIT_SUPERSEDED: " (superseded by a newer attempt on the same checkpoint store: not relaunched)",
                }.get(code, "")
                reason = handle.bad_input if code == EXIT_BAD_INPUT else None
                raise (BadTrainingInput if code == EXIT_BAD_INPUT else TrainingFailed)(
                    (f"{reason}\n" if reason else "")
                    + f"trainer exited with code {code}{why} after {handle.restarts} restart(s); log: {log_path}\n"
                    + "\n".join(handle.tail)
                )
            handle.restarts += 1
            handle.bad_input = None  # a reason belongs to the attempt that printed it
            log.warning("trainer exited with code %d; relaunching (%d/%d)", code, handle.restarts, self.max_restarts)
            handle.process = self._start(handle.spec_path)

    def cancel(self, handle: LocalHandle, grace_s: float = 60) -> None:
        """SIGTERM lets the trainer checkpoint; SIGKILL after the grace period."""
        handle.cancelled = True
        handle.process.send_signal(signal.SIGTERM)
        try:
            handle.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            handle.process.kill()


KIND = LauncherKind(
    build=lambda train, on_line, on_status: LocalLauncher(train.max_restarts, on_line=on_line),
    gpus_per_node=lambda train: [detect_gpus()],  # this machine's
    check=lambda train, mlflow_uri: check_store(train),  # the trainer writes its checkpoints from here
)
