"""One trial: a short GRPO training job through the run's launcher, its rung rewards reported to Optuna, and a
cancel when the pruner says so."""

from __future__ import annotations

import logging
import queue
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from pydantic import BaseModel, ConfigDict

from grpo_pipeline.configs.schema import (
    ConfigError,
    HPOConfig,
    ModelConfig,
    TrainConfig,
)
from grpo_pipeline.tasks.hpo.space import rung_checks, suggest, to_overrides, trial_train
from grpo_pipeline.tasks.hpo.study import CONFIGURED, WORKER, _this_worker
from grpo_pipeline.tasks.job import build_job_spec
from grpo_pipeline.trainer.spec import TrainingFailed, parse_progress

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)


# Builds the launcher a trial runs on (`grpo_pipeline.infra.launch.make_launcher`): passed in by the flow, which owns the
# launch; called with the trial's `train` section and a callback for each line of the trainer's output.
LauncherFactory = Callable[[TrainConfig, Callable[[str], None]], Any]


class TrialFailed(RuntimeError):
    """One trial crashed; Optuna marks it FAIL and the study goes on."""


class TrialOutcome(BaseModel):
    value: float | None  # sampled validation reward at the last rung; None when pruned
    pruned_at: int | None = None
    steps: int  # the last step that reported a validation reward (without rung checks: the last step trained)
    adapter_dir: str | None = None  # what the trainer left, for greedy scoring


def _reason(exc: BaseException) -> str:
    """The first line of an error and, for a trainer crash, the exception in its log's tail (the last line that
    names an error; else the last line: a progress bar may be printed after the traceback).

    >>> _reason(RuntimeError("trainer exited with code 1; log: x\\nTraceback ...\\nValueError: boom\\n 50%|#  | 1/2"))
    'trainer exited with code 1; log: x ... ValueError: boom'
    """
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) == 1:
        return lines[0]
    named = [line for line in lines[1:] if re.match(r"\s*[\w.]*(Error|Exception)\b", line)]
    return f"{lines[0]} ... {(named or lines)[-1].strip()}"


class Tracking(BaseModel):
    """Where trial runs go in MLflow: nested under the stage run."""

    tracking_uri: str
    experiment_id: str
    stage_run_id: str

    def client(self) -> MlflowClient:
        from mlflow import MlflowClient

        return MlflowClient(self.tracking_uri)


class TrialJob(BaseModel):
    """What every trial of one search runs with, less its own parameters: the search's settings, the train section
    each trial overrides, the base model (its config and resolved path), the splits (`val`: the rung prompts), the
    run's folder, where trial runs go in MLflow (None: nowhere), and the warm start's local adapter directory every
    trial continues (None: a fresh adapter)."""

    model_config = ConfigDict(frozen=True)

    hpo: HPOConfig
    train: TrainConfig
    model: ModelConfig
    model_path: str
    splits: dict[str, Path]
    run_dir: Path
    tracking: Tracking | None = None
    init_adapter: str | None = None


# Runs one trial of a search (`run_trial` with a launcher, as a Prefect task in the flow; a stand-in in tests).
RunOne = Callable[[optuna.Trial, TrialJob], TrialOutcome]


def run_trial(trial: optuna.Trial, job: TrialJob, launcher_for: LauncherFactory) -> TrialOutcome:
    """One short GRPO run of `job` with the trial's parameters; reports each validation reward and cancels the job
    when the pruner says so. Raises TrialFailed when the job crashes; the launcher's bad-input failure (a
    `TrainingFailed` that is a `ConfigError`, `grpo_pipeline.infra.launch.BadTrainingInput`: the trainer exited 2, e.g. a
    reward that returns NaN) is raised as it is, since every other trial would fail the same way."""
    from mlflow.entities import Param

    configured = bool(trial.user_attrs.get(CONFIGURED))
    overrides = {} if configured else to_overrides(suggest(trial, job.hpo.space), job.train.lora)
    try:
        trial_section = trial_train(job.train, job.hpo, overrides)
    except ValueError as exc:  # parameters the training config refuses (enqueued by hand, or an older study's
        # warm start): this trial's, so this trial fails; the space itself is checked before any trial
        refused = " ".join(str(exc).split())  # pydantic's lines: the field, the value, the fix
        trial.set_user_attr("reason", refused)
        raise TrialFailed(f"trial {trial.number}: {refused}") from exc
    tracking = job.tracking
    client = tracking.client() if tracking else None
    run_id = None
    if client and tracking:
        run_id = client.create_run(
            tracking.experiment_id,
            run_name=f"trial-{trial.number}",
            tags={
                "mlflow.parentRunId": tracking.stage_run_id,
                "optuna.trial": str(trial.number),
                "optuna.configured": str(configured).lower(),
            },
        ).info.run_id
    trial.set_user_attr("overrides", overrides)
    trial.set_user_attr(WORKER, _this_worker())
    # Unique across runs: build_job_spec names the run's checkpoint prefix after this folder.
    trial_dir = job.run_dir / "hpo" / f"{job.run_dir.name}-trial-{trial.number:03d}"
    spec = build_job_spec(
        trial_section,
        job.model,
        job.model_path,
        job.splits,
        trial_dir,
        mlflow_tracking_uri=tracking.tracking_uri if tracking else None,  # the trainer logs into the trial's run
        mlflow_run_id=run_id,
        init_adapter=job.init_adapter,
    )
    spec = spec.model_copy(update={"val_file": str(Path(job.splits["val"]).resolve())})

    reports: queue.Queue = queue.Queue()

    def on_line(line: str) -> None:
        if report := parse_progress(line):
            reports.put(report)

    launcher = launcher_for(trial_section, on_line)
    state, reason, outcome = "FAILED", None, None
    try:
        handle = launcher.launch(spec)
        outcome = _follow(
            trial,
            launcher,
            handle,
            reports,
            client,
            run_id,
            job.hpo.steps,
            prunable=not configured,
            rungs=rung_checks(job.hpo),
        )
        state = "KILLED" if outcome.pruned_at is not None else "FINISHED"
        return outcome
    except TrainingFailed as exc:
        reason = _reason(exc)
        trial.set_user_attr("reason", reason)
        if isinstance(exc, ConfigError):  # bad input: not this trial's parameters, so not Optuna's to catch
            raise
        raise TrialFailed(f"trial {trial.number}: {reason}") from exc
    except Exception as exc:  # a launch that failed (no cloud capacity, a bad YAML): this trial only
        reason = f"{type(exc).__name__}: {_reason(exc)}"
        trial.set_user_attr("reason", reason)
        raise TrialFailed(f"trial {trial.number}: {reason}") from exc
    finally:
        if client and run_id:
            # Logged last: the trainer logs its own (GRPOConfig) params only into a run that has none yet.
            logged = {"optuna.trial": trial.number, **overrides}
            client.log_batch(run_id, params=[Param(k, str(v)) for k, v in logged.items()])
            client.set_tag(run_id, "optuna.state", {"FINISHED": "COMPLETE", "KILLED": "PRUNED"}.get(state, "FAIL"))
            if reason:
                client.set_tag(run_id, "optuna.fail_reason", reason[:5000])
            if outcome and outcome.value is not None:
                client.log_metric(run_id, "trial_value", outcome.value)
            client.set_terminated(run_id, state)


def _follow(
    trial: optuna.Trial,
    launcher: Any,
    handle: Any,
    reports: queue.Queue,
    client: MlflowClient | None,
    run_id: str | None,
    max_steps: int,
    prunable: bool = True,
    rungs: bool = True,
) -> TrialOutcome:
    """Wait for the job on a helper thread; here, report each rung's validation reward and prune (unless the
    trial is the configured values' control). Without `rungs` (`rung_checks`) the trainer evaluates nothing and
    the trial's value is its scorer's."""
    seen: dict[int, float] = {}
    pruned_at = None
    with ThreadPoolExecutor(1, thread_name_prefix=f"trial-{trial.number}-wait") as pool:
        waiting = pool.submit(launcher.wait, handle)
        try:
            while not (waiting.done() and reports.empty()):
                try:
                    report = reports.get(timeout=0.5)
                except queue.Empty:
                    continue
                step, value = int(report["step"]), float(report["val_reward"])
                if pruned_at is not None or step in seen:  # a resumed job repeats steps since its checkpoint
                    continue
                seen[step] = value
                trial.report(value, step)
                if client and run_id:
                    client.log_metric(run_id, "val_reward", value, step=step)
                if prunable and step < max_steps and trial.should_prune():
                    pruned_at = step
                    log.info("trial %d pruned at step %d (validation reward %.4g)", trial.number, step, value)
                    launcher.cancel(handle)
        except BaseException:
            launcher.cancel(handle)  # a cancelled search must not leave a trainer (or a rented GPU) running
            raise
        result = None
        try:
            result = waiting.result()
        except TrainingFailed:
            if pruned_at is None:
                raise
    if pruned_at is not None:
        trial.set_user_attr("reason", f"pruned at step {pruned_at} (validation reward {seen[pruned_at]:.4g})")
        return TrialOutcome(value=None, pruned_at=pruned_at, steps=pruned_at)
    adapter_dir = getattr(result, "adapter_dir", None)
    if not rungs:
        return TrialOutcome(value=None, steps=getattr(result, "global_step", max_steps), adapter_dir=adapter_dir)
    if not seen:
        raise TrainingFailed("the trainer finished without reporting a validation reward (is the val split empty?)")
    last = max(seen)
    return TrialOutcome(value=seen[last], steps=last, adapter_dir=adapter_dir)
