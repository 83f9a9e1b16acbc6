"""Trainer callbacks: push each checkpoint to the store in the background, stop cleanly on SIGTERM, and
report validation rewards on stdout for a parent that prunes on them (hyperparameter search)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from transformers import TrainerCallback

from trainer.checkpoints import Store, checkpoint_name, prune
from trainer.spec import progress_line
from trainer.tracking import CommittedMetrics

log = logging.getLogger(__name__)


def _snapshot(src: Path, dest: Path) -> Path:
    """Hard-link a checkpoint aside, so HF's rotation can delete the original while we upload."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, copy_function=_link_or_copy)
    return dest


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class CheckpointSync(TrainerCallback):
    """After HF writes `checkpoint-N`, upload it (manifest last) on a background thread, then log the
    metrics it covers to MLflow, then prune old checkpoints."""

    def __init__(self, store: Store, keep: int, staging: Path, metrics: CommittedMetrics | None = None):
        self.store, self.keep, self.staging, self.metrics = store, keep, staging, metrics
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._pending: list[Future] = []

    def _upload(self, snapshot: Path, step: int, entries: list) -> None:
        self.store.put(snapshot, checkpoint_name(step), step)
        if self.metrics:
            self.metrics.commit(entries)
        prune(self.store, self.keep)
        shutil.rmtree(snapshot, ignore_errors=True)
        log.info("checkpoint %d complete in %r", step, self.store)

    def on_save(self, args, state, control, **kwargs):
        self.raise_failures()
        step = state.global_step
        name = checkpoint_name(step)
        snapshot = _snapshot(Path(args.output_dir) / name, self.staging / name)
        entries = self.metrics.take(step) if self.metrics else []
        CommittedMetrics.write(entries, snapshot)
        self._pending.append(self._pool.submit(self._upload, snapshot, step, entries))

    def raise_failures(self) -> None:
        for future in [f for f in self._pending if f.done()]:
            self._pending.remove(future)
            future.result()  # re-raises an upload error in the training thread

    def wait(self) -> None:
        """Block until every checkpoint is in the store."""
        for future in self._pending:
            future.result()
        self._pending.clear()


class StopOnSigterm(TrainerCallback):
    """SIGTERM (a spot preemption notice, a cancel) saves a checkpoint at the end of the current step and stops."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        log.warning("SIGTERM: saving a checkpoint after this step, then exiting")
        self.received = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.received:
            control.should_save = True
            control.should_training_stop = True
        return control


class FirstStepTimer(TrainerCallback):
    """Seconds from the job's start to its first completed step: what a (re)start costs before work resumes."""

    def __init__(self, started: float):
        self.started, self.seconds = started, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started


class ReportValidation(TrainerCallback):
    """Print each validation reward as one tagged JSON line on stdout.

    Stdout is what every launcher already carries back to the parent: the local launcher's pipe, and
    SkyPilot's log tail of a managed job (a file in the node's work dir would not reach a parent that
    watches a spot node). The hyperparameter search reads these lines to report to Optuna and prune.
    """

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero and metrics and "eval_reward" in metrics:
            # flushed: stdout is a pipe
            print(progress_line(state.global_step, float(metrics["eval_reward"])), flush=True)
