"""Trainer callbacks: push each checkpoint to the store in the background, stop cleanly on SIGTERM,
report validation rewards on stdout for a parent that prunes on them (hyperparameter search), and print
each log as one line with its step for a parent that shows progress (`grpo_pipeline.tasks.job.TrainProgress`).

With several ranks, every rank runs these callbacks at the same points (HF calls them on each process), so
their collectives line up: the checkpoint's files are gathered to rank 0, which alone uploads, and the
decision to stop after a SIGTERM is taken by all ranks together."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.trainer.checkpoints import CheckpointStore, checkpoint_name, prune
from grpo_pipeline.trainer.distributed import Ranks
from grpo_pipeline.trainer.health import STATE_FILE, Monitor, decide, is_step_log, scale_learning_rate
from grpo_pipeline.trainer.spec import progress_line
from grpo_pipeline.trainer.tracking import CommittedMetrics

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

    from grpo_pipeline.configs.health import HealthConfig
    from grpo_pipeline.trainer.health import Ledger
    from grpo_pipeline.trainer.spec import HealthEvent

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


class CheckpointIncomplete(RuntimeError):
    pass


class CheckpointSync(TrainerCallback):
    """After HF writes `checkpoint-N`, upload it (manifest last) on a background thread, then log the
    metrics it covers to MLflow, then prune old checkpoints.

    With several ranks: each rank's files (its RNG state, its optimizer shards) are first gathered into rank
    0's copy, which must then hold an RNG state for every rank, so a checkpoint in the store is never missing
    a rank's part; the other ranks drop their copies.
    """

    def __init__(
        self,
        store: CheckpointStore,
        keep: int,
        staging: Path,
        metrics: CommittedMetrics | None = None,
        ranks: Ranks | None = None,
    ):
        self.store, self.keep, self.staging, self.metrics = store, keep, staging, metrics
        self.ranks = ranks or Ranks()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._pending: list[Future] = []

    def _upload(self, snapshot: Path, step: int, entries: list, best: int | None) -> None:
        try:
            self.store.put(snapshot, checkpoint_name(step), step)
        finally:  # a failed upload re-raises in the training thread; its staging copy must not stay behind
            shutil.rmtree(snapshot, ignore_errors=True)
        if self.metrics:
            self.metrics.commit(entries)
        prune_keeping_best(self.store, self.keep, best)
        log.info("checkpoint %d complete in %r", step, self.store)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.raise_failures()
        step = state.global_step
        name = checkpoint_name(step)
        written = Path(args.output_dir) / name
        if self.ranks.world > 1:
            self.ranks.gather_checkpoint(written)
            if not self.ranks.is_main:  # its part is in rank 0's copy now; no rotation runs on this rank
                shutil.rmtree(written, ignore_errors=True)
                return
            _check_every_rank(written, self.ranks.world)
        snapshot = _snapshot(written, self.staging / name)
        entries = self.metrics.take(step) if self.metrics else []
        CommittedMetrics.write(entries, snapshot)
        # HF has judged this step's evaluation before saving (state.best_global_step): the best so far stays
        self._pending.append(self._pool.submit(self._upload, snapshot, step, entries, state.best_global_step))

    def raise_failures(self) -> None:
        for future in [f for f in self._pending if f.done()]:
            self._pending.remove(future)
            future.result()  # re-raises an upload error in the training thread

    def wait(self) -> None:
        """Block until every checkpoint is in the store."""
        for future in self._pending:
            future.result()
        self._pending.clear()


def prune_keeping_best(store: CheckpointStore, keep: int, best: int | None) -> None:
    """The newest `keep` complete checkpoints, and the one with the best validation reward (HF's
    best_global_step) even when it is older: the published adapter is that one's (`grpo_pipeline.trainer.train._publish`)."""
    if best is None:
        prune(store, keep)
        return
    for step in store.complete_steps()[:-keep]:
        if step != best:
            store.delete(checkpoint_name(step))


def _check_every_rank(checkpoint: Path, world: int) -> None:
    """HF saves one RNG state per rank (unless it saves the model only); each must be in the checkpoint."""
    states = {p.name for p in checkpoint.glob("rng_state*.pth")}
    if not states:
        return
    missing = [r for r in range(world) if f"rng_state_{r}.pth" not in states]
    if missing:
        raise CheckpointIncomplete(f"{checkpoint} lacks the RNG state of rank(s) {missing}; not uploading it")


class StopOnSigterm(TrainerCallback):
    """SIGTERM (a spot preemption notice, a cancel) saves a checkpoint at the end of the current step and stops.

    With several ranks the signal may reach only one of them; at each step's end the ranks agree (one
    all-reduce), so all save the same checkpoint and all stop."""

    def __init__(self, ranks: Ranks | None = None):
        self.received = False
        self.ranks = ranks or Ranks()
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        log.warning("SIGTERM: saving a checkpoint after this step, then exiting")
        self.received = True

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if self.ranks.any(self.received):
            self.received = True
            control.should_save = True
            control.should_training_stop = True
        return control


class FirstStepTimer(TrainerCallback):
    """Seconds from the job's start to its first completed step: what a (re)start costs before work resumes."""

    def __init__(self, started: float):
        self.started = started
        self.seconds: float | None = None  # until the first step ends

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started


def skill_metric(rewards: RewardSet) -> str:
    """TRL's logged mean of the skill reward (`rewards/<name>/mean`; `eval_` before it on validation): what
    validation judges a step by: early stopping, the published checkpoint (HF's `metric_for_best_model`) and the
    search's rung checks; a total a format alone can raise would pick the step that printed the best format.

    >>> skill_metric(RewardSet(names=("correct_answer", "number_only")))
    'rewards/correct_answer/mean'
    """
    return f"rewards/{rewards.skill}/mean"


class ReportValidation(TrainerCallback):
    """Print each validation score, the skill reward's mean (`skill_metric`), as one tagged JSON line on stdout.

    Stdout is what every launcher already carries back to the parent: the local launcher's pipe, and
    SkyPilot's log tail of a managed job (a file in the node's work dir would not reach a parent that
    watches a spot node). The hyperparameter search reads these lines to report to Optuna and prune.
    """

    def __init__(self, metric: str):
        self.key = f"eval_{metric}"

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if state.is_world_process_zero and metrics and self.key in metrics:
            # flushed: stdout is a pipe
            print(progress_line(state.global_step, float(metrics[self.key])), flush=True)


def step_log_line(logs: dict, step: int, max_steps: int) -> str:
    """One HF log as HF's own printer writes it (a Python dict: `grpo_pipeline.tasks.job` reads it back with
    `ast.literal_eval`), with the global step and max_steps added; a non-finite value is written as a string,
    which literal_eval reads (a bare `nan` it cannot).

    >>> step_log_line({"loss": float("nan"), "reward": 0.5, "total_flos": 9.0}, 12, 40)
    "{'loss': 'nan', 'reward': 0.5, 'step': 12, 'max_steps': 40}"
    """
    shown = {
        k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in logs.items() if k != "total_flos"
    }  # total_flos: HF's printer drops it too
    return str({**shown, "step": step, "max_steps": max_steps})


class StepLog(TrainerCallback):
    """Print each log (one per `logging_steps`, plus evaluations and the final summary) as one line on
    stdout, on the main process only, with the global step and max_steps: a parent cannot count steps from
    lines after a resume or a lost line. It stands in for HF's own printing (`print_logs_once`)."""

    reader_gone = False

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if state.is_world_process_zero and logs and not self.reader_gone:
            from tqdm.auto import tqdm

            try:
                # tqdm.write: above the bar on a terminal, a plain line otherwise; flushed, since stdout is a pipe
                tqdm.write(step_log_line(logs, state.global_step, state.max_steps), file=sys.stdout)
                sys.stdout.flush()
            except BrokenPipeError:
                # the parent that read this pipe is dead (its death signal, a SIGTERM, is on its way): the step's
                # checkpoint matters more than its progress line
                self.reader_gone = True


class BarWithoutLogs(ProgressCallback):
    """HF's tqdm bar, without its copy of each log."""

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        pass


def print_logs_once(trainer: Trainer) -> None:
    """Make StepLog the one printer of each log: HF prints it too, with PrinterCallback (no tqdm) or inside
    its tqdm bar (ProgressCallback), and on every node's local rank 0."""
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback):
        trainer.add_callback(BarWithoutLogs)
    trainer.add_callback(StepLog)


def interactive() -> bool:
    """Whether progress bars reach a person: tqdm and rich draw on stderr, and in a log (a launcher's pipe,
    a Prefect worker's, SkyPilot's) every redraw is one more garbled line."""
    return sys.stderr.isatty()


def hide_library_bars() -> None:
    """No tqdm bars from the libraries that load models and data (datasets' splits and maps, checkpoint
    shards, hub downloads): for a log that is not a terminal."""
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging

    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


class HealthCallback(TrainerCallback):
    """Runs the health rules (`grpo_pipeline.trainer.health.Monitor`) on each step's log and acts on them.

    Rank 0 decides and every rank acts on its decision (one broadcast per logged step with several ranks), as
    with a SIGTERM: TRL's logged metrics are already averaged across ranks, and this makes the agreement hold
    by construction. Each event goes to the log (the trainer's output is relayed into the Prefect log), to
    MLflow at once (a tag and a metric at its step: an event must show even if no checkpoint follows) and
    into `events`. `stop` ends training after this step, with the save the step would make; `rollback` ends
    it without that save (the state may be poisoned) and leaves `rollback` set for `grpo_pipeline.trainer.train` to restart
    from the last healthy checkpoint, unless the ledger's rollbacks are spent: then it stops."""

    def __init__(
        self,
        settings: HealthConfig,
        ledger: Ledger,
        ranks: Ranks | None = None,
        client: MlflowClient | None = None,
        run_id: str | None = None,
        restored: dict | None = None,
        lr_factor: float = 1.0,
        rewards: RewardSet | None = None,
    ):
        self.settings, self.ledger, self.ranks = settings, ledger, ranks or Ranks()
        self.client, self.run_id = client, run_id
        self.monitor = Monitor(settings, rewards=rewards)  # the rewards' roles: for format_hacking
        self.restored = restored or {}
        self.lr_factor = lr_factor  # applied to the optimizer and scheduler once they are built (and resumed)
        self.rollback: HealthEvent | None = None  # the event that asks for a rollback, when one does
        self.stopped: HealthEvent | None = None  # the event that stopped training
        self.seconds = 0.0  # time spent in the rules, for the overhead figure

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        self.monitor.check_grad_norm = not args.fp16  # the fp16 GradScaler logs inf grad norms on steps it skips
        if self.restored:
            self.monitor.load(self.restored)
        if optimizer is not None:
            scale_learning_rate(optimizer, lr_scheduler, self.lr_factor)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainerControl:
        if not logs or not is_step_log(logs):
            return control
        started = time.perf_counter()
        events = self.monitor.observe(state.global_step, logs) if self.ranks.is_main else None
        self.seconds += time.perf_counter() - started
        events = self.ranks.broadcast(events)
        if not events:
            return control
        chosen = decide(events)
        for event in events:
            event.taken = "warned" if event is not chosen else None
        if chosen is not None:
            if chosen.action == "rollback" and self.ledger.rollbacks < self.settings.max_rollbacks:
                self.rollback = chosen  # `taken` is filled by the rollback itself, with the step it returns to
                control.should_save = False  # not this step's state: it is what the rule found unhealthy
            else:
                spent = chosen.action == "rollback"
                chosen.taken = (
                    f"stopped (rollbacks spent: {self.ledger.rollbacks} of {self.settings.max_rollbacks})"
                    if spent
                    else "stopped"
                )
                self.stopped = chosen
            control.should_training_stop = True
        for event in events:
            self.record(event)
        return control

    def record(self, event: HealthEvent) -> None:
        """The log line, the MLflow tag and metric (rank 0), and the ledger's copy."""
        what = event.taken or f"rolling back (rollback {self.ledger.rollbacks + 1} of {self.settings.max_rollbacks})"
        self.ledger.merge([event])
        if not self.ranks.is_main:  # every rank holds the event; one says it
            return
        log.warning("health: %s at step %d: %s -> %s", event.rule, event.step, event.message, what)
        if self.client and self.run_id:
            value = event.value if math.isfinite(event.value) else -1.0  # MLflow refuses NaN; -1: "not finite"
            self.client.log_metric(self.run_id, f"health/{event.rule}", value, step=event.step)
            self.client.set_tag(
                self.run_id,
                f"health/step-{event.step}/{event.rule}",
                f"{event.action}: {event.message} -> {what}"[:5000],
            )

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """The windows and the events so far, beside the checkpoint HF just wrote (rank 0's folder is the one
        uploaded; `CheckpointSync` runs after this callback)."""
        if not self.ranks.is_main:
            return
        folder = Path(args.output_dir) / checkpoint_name(state.global_step)
        if folder.is_dir():
            body = {
                **self.monitor.state(),
                "events": [e.model_dump(mode="json") for e in self.ledger.events],
                "rollbacks": self.ledger.rollbacks,
                "lr_scale": self.ledger.lr_scale,
            }
            (folder / STATE_FILE).write_text(json.dumps(body))
