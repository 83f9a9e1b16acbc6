"""One GRPO training job: TRL's GRPOTrainer with a PEFT LoRA adapter, resumable from the checkpoint store.

Run it alone on any node: `python -m grpo_pipeline.trainer --spec job.json`. Exit codes: 0 finished (max_steps or
early stop), 75 interrupted by SIGTERM after a checkpoint (relaunch to resume), 2 bad input (a bad spec, or
a reward that cannot be resolved or gives unusable scores, `RewardError`: a relaunch would fail the same
way), 1 any other failure, a reward's outage included (`RewardUnavailable`: its service down after its
retries, a timeout, out of memory): a relaunch may succeed, and resumes from the last checkpoint.

Under torchrun (`python -m grpo_pipeline.trainer.launch`) each rank runs this same code; rank 0 alone uploads checkpoints
(with every rank's files in them), commits MLflow metrics, publishes `final` and writes the result file;
every rank resumes from the same checkpoint, and a SIGTERM to any rank stops all of them after one more
checkpoint (`grpo_pipeline.trainer.distributed`).

One module, just past the ~600 lines a module is cut at: one job's life in the order it runs (arguments, the
attempt, a rollback, publishing `final`, `main` and its exit table); its parts with a life of their own are the
modules beside it (checkpoints, fence, health, callbacks, generation, loading).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_pipeline.configs.health import NON_FINITE
from grpo_pipeline.trainer import distributed, sampling
from grpo_pipeline.trainer import health as health_state
from grpo_pipeline.trainer.checkpoints import (
    FINAL,
    MANIFEST,
    METRICS_FILE,
    CheckpointCorrupt,
    CheckpointStore,
    ResumePoint,
    checkpoint_name,
    choose_resume,
    collect_final,
    fetch_init_adapter,
    open_store,
    read_checkpoint_json,
)
from grpo_pipeline.trainer.cuts import Cuts
from grpo_pipeline.trainer.distributed import Ranks
from grpo_pipeline.trainer.fence import FencedStore, StoreTaken, Superseded, claim_store
from grpo_pipeline.trainer.health import LEDGER, Ledger, healthy_checkpoint
from grpo_pipeline.trainer.launch import rank_lifeline
from grpo_pipeline.trainer.loading import adapter_mismatch, keep_adapter_fp32, load_model, read_adapter_config
from grpo_pipeline.trainer.precision import cpu_has_native_bf16, node_default_bf16, slow_bf16_reason
from grpo_pipeline.trainer.rewards import RewardError, RewardUnavailable, resolve_rewards
from grpo_pipeline.trainer.spec import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_SUPERSEDED,
    RESULT_FILE,
    HealthEvent,
    JobSpec,
    TrainResult,
    bad_input_line,
)
from grpo_pipeline.trainer.tracking import CommittedMetrics, numeric

# torch, transformers, TRL, datasets, MLflow, and the modules that import them at their top (callbacks, step),
# load inside the functions that run them: `main` answers a bad spec (exit 2) and a lost torchrun before they load.
if TYPE_CHECKING:
    from transformers.trainer_utils import TrainOutput
    from trl import GRPOConfig, GRPOTrainer

    from grpo_pipeline.trainer.callbacks import FirstStepTimer, HealthCallback, StopOnSigterm
    from grpo_pipeline.trainer.step import StepTrainer

log = logging.getLogger(__name__)


class Refused(Exception):
    """Bad input the trainer finds before it trains (the spec's precision or adapter, a warm start's files that
    differ from the spec's pins): every attempt would find it again."""


# How an attempt that fails ends, by the first entry the exception is an instance of: its exit code (trainer/spec.py;
# the launchers relaunch on 1 only) and the lead of its log line. Anything else is exit 1 and raised, traceback and all.
EXITS: tuple[tuple[type[BaseException], int, str], ...] = (
    (Refused, EXIT_BAD_INPUT, "bad input"),
    # before RewardError, which it is: the reward's service or the node's memory, not the input
    (RewardUnavailable, EXIT_FAILED, "reward unavailable (exit 1: a relaunch resumes from the last checkpoint)"),
    (RewardError, EXIT_BAD_INPUT, "bad input"),  # the reward or the data is at fault, not the node
    # another job's store: every recovery would fight it for the store
    (StoreTaken, EXIT_BAD_INPUT, "bad input"),
    # a relaunch runs elsewhere and owns the store: stop here
    (Superseded, EXIT_SUPERSEDED, f"superseded (exit {EXIT_SUPERSEDED})"),
)


def grpo_args(spec: JobSpec, output_dir: Path) -> GRPOConfig:
    """GRPOConfig from the spec: the user's passthrough fields plus what resume and the store require."""
    import torch
    from trl import GRPOConfig

    from grpo_pipeline.trainer.callbacks import interactive, skill_metric

    user = dict(spec.train.grpo)
    user.setdefault(
        "bf16", node_default_bf16()
    )  # unset: bf16 where this node computes it fast (grpo_pipeline.trainer.precision)
    if not torch.cuda.is_available():
        # TRL turns gradient checkpointing on by default: each decoder layer's forward runs again inside the
        # backward, about a fifth of a CPU step (bench.step_profile), to save activation memory that a CPU
        # node's RAM does not miss. A GPU node keeps TRL's default or the planner's choice; set it to keep it.
        user.setdefault("gradient_checkpointing", False)
    user.setdefault("report_to", [])  # MLflow is logged by CommittedMetrics, once per step across restarts
    user.setdefault("disable_tqdm", not interactive())  # no bar redraws in a launcher's or a worker's log
    user.setdefault("ddp_timeout", spec.train.distributed.timeout_s)  # no collective waits longer for a lost rank
    if not torch.cuda.is_available() and (distributed.current().world > 1 or user["bf16"]):
        # Several ranks: else accelerate takes them for unconnected processes. bf16: transformers accepts
        # bf16 without a GPU only with use_cpu (then accelerate autocasts on the CPU).
        user.setdefault("use_cpu", True)
    if os.environ.get(distributed.VLLM_HOST_ENV):  # vllm_mode=server: where the node launcher started it
        user.setdefault("vllm_server_host", os.environ[distributed.VLLM_HOST_ENV])
    if spec.train.health.rule(NON_FINITE).action != "off":
        # HF's default hides a NaN/inf loss in the logged average; the non_finite rule must see it
        user.setdefault("logging_nan_inf_filter", False)
    if spec.train.early_stopping_patience:
        user.setdefault("eval_strategy", "steps")
        user.setdefault("eval_steps", spec.train.checkpoint_every)
        user.setdefault("metric_for_best_model", skill_metric(spec.train.rewards))  # the skill, not the total
        user.setdefault("greater_is_better", True)
        user.setdefault("per_device_eval_batch_size", user.get("num_generations", 8))
        # The patience counter lives in the checkpoint; a resumed job must not start it afresh.
        user.setdefault("restore_callback_states_from_checkpoint", True)
    return GRPOConfig(
        output_dir=str(output_dir),
        save_strategy="steps",
        save_steps=spec.train.checkpoint_every,
        save_total_limit=spec.train.keep_checkpoints,
        reward_weights=list(spec.train.rewards.weights),  # in the order of the reward functions
        **user,
    )


def _ensure_mlflow_run(spec: JobSpec) -> str | None:
    """The run this job logs into: the launcher's (so a relaunch continues it) or a new one."""
    if not spec.mlflow_tracking_uri:
        return None
    from mlflow import MlflowClient

    if spec.mlflow_run_id:
        return spec.mlflow_run_id
    client = MlflowClient(spec.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name(spec.mlflow_experiment)
    exp_id = experiment.experiment_id if experiment else client.create_experiment(spec.mlflow_experiment)
    return client.create_run(exp_id, run_name="train").info.run_id


def _report(spec: JobSpec, result: TrainResult) -> TrainResult:
    Path(spec.work_dir).mkdir(parents=True, exist_ok=True)
    (Path(spec.work_dir) / RESULT_FILE).write_text(result.model_dump_json(indent=1))
    return result


def _already_finished(
    spec: JobSpec, store: CheckpointStore, metrics: CommittedMetrics | None, ranks: Ranks
) -> TrainResult:
    """A relaunch after the job finished (killed between its last upload and its exit): report, don't retrain."""
    if not ranks.is_main:  # rank 0 alone copies the adapter out and reports
        final = store.fetch(FINAL, distributed.rank_work_dir(spec.work_dir, ranks.rank) / "fetched")
        return TrainResult.model_validate_json((final / RESULT_FILE).read_text())
    result, final = collect_final(spec, store)
    if metrics:
        metrics.commit(CommittedMetrics.read(final))
    return _report(spec, result)


def run(spec: JobSpec, started: float | None = None) -> TrainResult:
    """Train to max_steps (or an early or health stop), resuming from the store; after a health rollback,
    train again from the last healthy checkpoint at a lower learning rate (`_roll_back`), in this process."""
    from datasets import load_dataset

    from grpo_pipeline.trainer.callbacks import FirstStepTimer, StopOnSigterm

    started = started or time.monotonic()
    stop = StopOnSigterm()  # first: a SIGTERM during model loading must not kill the job uncleanly
    ranks = stop.ranks = distributed.init(spec.train.distributed.timeout_s)
    work = distributed.rank_work_dir(spec.work_dir, ranks.rank)
    opened = open_store(spec.checkpoint_uri, spec.train.s3_endpoint_url)
    store: CheckpointStore = opened  # the other ranks only read from it
    if ranks.is_main:
        opened.check()
        store = claim_store(opened)  # from here on, every write checks no newer attempt has claimed it
    run_id = ranks.broadcast(_ensure_mlflow_run(spec) if ranks.is_main else None)
    # a run id only comes with a tracking URI (_ensure_mlflow_run); rank 0 alone commits metrics
    metrics = (
        CommittedMetrics(spec.mlflow_tracking_uri, run_id)
        if run_id and spec.mlflow_tracking_uri and ranks.is_main
        else None
    )
    if ranks.broadcast(store.has(FINAL) if ranks.is_main else None):
        return _already_finished(spec, store, metrics, ranks)
    train_ds = load_dataset("json", data_files=spec.train_file, split="train")
    val_ds = load_dataset("json", data_files=spec.val_file, split="train") if spec.val_file else None
    if spec.train.early_stopping_patience and val_ds is None:
        raise ValueError("train.early_stopping_patience needs a validation split (val_file)")
    saved = ranks.broadcast(_read_ledger(store, work) if ranks.is_main else None)
    ledger = Ledger.from_json(saved) if saved else Ledger()
    timer = FirstStepTimer(started)
    while True:
        attempt = _attempt(
            spec, store, ranks, work, run_id, metrics, stop, timer, ledger, saved is not None, train_ds, val_ds
        )
        if attempt.health.rollback is None:
            break
        _roll_back(spec, store, ranks, work, metrics, ledger, attempt.health.rollback)
        saved = ledger.to_json()
        del attempt  # the model and its optimizer: the next attempt loads both afresh
        _free_memory()

    state = attempt.trainer.state
    finished = state.global_step >= state.max_steps
    interrupted = stop.received and not finished
    stopped = attempt.health.stopped
    stopped_by = f"health rule {stopped.rule} at step {stopped.step}: {stopped.message}" if stopped else None
    result = TrainResult(
        adapter_dir=None if interrupted else spec.adapter_dir,
        global_step=state.global_step,
        max_steps=state.max_steps,
        resumed_from_step=attempt.point.step,
        interrupted=interrupted,
        stopped_early=not stop.received and not finished,
        mlflow_run_id=run_id,
        train_runtime_s=time.monotonic() - started,
        first_step_s=timer.seconds,
        precision="bf16" if attempt.trainer.args.bf16 else "fp16" if attempt.trainer.args.fp16 else "fp32",
        metrics=numeric(attempt.output.metrics),
        world_size=ranks.world,
        health=ledger.events,
        stopped_by=stopped_by,
        rollbacks=ledger.rollbacks,
        best_step=state.best_global_step,
        best_val_reward=state.best_metric if state.best_global_step is not None else None,
        zero_signal=sampling.summarize(state.log_history, attempt.trainer.curriculum),
    )
    if metrics and stopped_by:
        metrics.client.set_tag(metrics.run_id, "health_stopped", stopped_by[:5000])
    if not interrupted:
        _publish(spec, attempt.trainer, store, result, metrics, ranks)
    return _report(spec, result) if ranks.is_main else result


class _Attempt:
    """One training pass: its trainer (for the state and the adapter), where it resumed, HF's output, and
    the health callback (for a rollback or a stop)."""

    def __init__(self, trainer: StepTrainer, point: ResumePoint, output: TrainOutput, health: HealthCallback) -> None:
        self.trainer, self.point, self.output, self.health = trainer, point, output, health


def _attempt(
    spec: JobSpec,
    store: CheckpointStore,
    ranks: Ranks,
    work: Path,
    run_id: str | None,
    metrics: CommittedMetrics | None,
    stop: StopOnSigterm,
    timer: FirstStepTimer,
    ledger: Ledger,
    from_store: bool,
    train_ds: Any,  # datasets.Dataset (the datasets library has no types)
    val_ds: Any,
) -> _Attempt:
    """Resume from the newest verified checkpoint and train until the end, a stop or a rollback request."""
    from peft import LoraConfig
    from transformers import EarlyStoppingCallback

    from grpo_pipeline.trainer.callbacks import (
        CheckpointSync,
        HealthCallback,
        ReportValidation,
        hide_library_bars,
        print_logs_once,
        skill_metric,
    )
    from grpo_pipeline.trainer.step import StepTrainer

    point, restored, baked = _resume(store, ranks, work, metrics, ledger, from_store)
    resume = point.directory
    args = grpo_args(spec, work / "hf")
    if metrics:
        metrics.client.log_param(metrics.run_id, "precision", "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")
    if args.disable_tqdm:  # nor the bars of loading the model and the data
        hide_library_bars()
    # a warm start continues the adapter's own weights (trainable); the optimizer, scheduler and step are fresh
    model, tokenizer = load_model(spec.model_path, spec.model, adapter=spec.init_adapter, trainable=True)
    sync = CheckpointSync(store, spec.train.keep_checkpoints, work / "staging", metrics, ranks)
    health = HealthCallback(
        spec.train.health,
        ledger,
        ranks,
        metrics.client if metrics else None,
        run_id,
        restored,
        lr_factor=ledger.lr_scale / baked,
        rewards=spec.train.rewards,
    )
    # health before sync: its on_save writes health.json into the checkpoint that sync then uploads
    report = ReportValidation(skill_metric(spec.train.rewards))  # validation judged by the skill reward
    callbacks = [health, sync, stop, timer, report, keep_adapter_fp32(model)] + ([metrics] if metrics else [])
    if spec.train.early_stopping_patience:
        callbacks.append(EarlyStoppingCallback(spec.train.early_stopping_patience))

    trainer = StepTrainer(
        model=model,
        reward_funcs=resolve_rewards(
            spec.train.rewards.names, spec.train.rewards.args, max_completion_length=args.max_completion_length
        ),
        args=args,
        train_dataset=train_ds,
        eval_dataset=val_ds,
        processing_class=tokenizer,
        # a warm start passes a PeftModel holding its adapter, and TRL takes no peft_config with one
        peft_config=None if spec.init_adapter else LoraConfig(task_type="CAUSAL_LM", **spec.train.lora),
        callbacks=callbacks,
        cuts=Cuts.of(spec.train),
        curriculum_state=read_checkpoint_json(resume, sampling.STATE_FILE),
        skill=spec.train.rewards.skill,
    )
    print_logs_once(trainer)  # one line per log, with its step, for the parent's progress
    try:
        output = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except RewardError as exc:
        if run_id and not isinstance(exc, RewardUnavailable):  # an outage is retried: the run goes on
            _ended_by_bad_input(spec, run_id, metrics, str(exc))
        raise
    sync.wait()  # the newest checkpoint must be in the store before we report, roll back or exit
    if ranks.is_main and health.seconds:
        log.info("health rules: %.3f ms per logged step", 1000 * health.seconds / max(trainer.state.global_step, 1))
    return _Attempt(trainer, point, output, health)


def _resume(
    store: CheckpointStore, ranks: Ranks, work: Path, metrics: CommittedMetrics | None, ledger: Ledger, from_store: bool
) -> tuple[ResumePoint, dict, float]:
    """The newest verified checkpoint (the same on every rank), its health state, and the learning-rate scale its
    optimizer and scheduler hold; `ledger` takes the checkpoint's record where the store holds none."""
    point = choose_resume(store, work / "resume")  # verified; newer ones that do not verify are moved aside
    resume = point.directory
    if point.reason and metrics:
        metrics.client.set_tag(metrics.run_id, "resume_fallback", point.reason[:5000])
    if resume:
        if metrics:  # in case the kill came between the checkpoint's manifest and its MLflow commit
            metrics.commit(CommittedMetrics.read(resume))
    _same_resume_point(ranks, resume)
    restored = read_checkpoint_json(resume, health_state.STATE_FILE)
    baked = float(restored.get("lr_scale", 1.0))  # the scale the checkpoint's optimizer and scheduler hold
    if not from_store:  # no rollback recorded in the store: the checkpoint's own record is the whole story
        ledger.lr_scale = baked
        ledger.rollbacks = int(restored.get("rollbacks", 0))
    ledger.merge([HealthEvent.model_validate(e) for e in restored.get("events", [])])
    return point, restored, baked


def _read_ledger(store: CheckpointStore, work: Path) -> str | None:
    """The health ledger's JSON from the store, or None when no rollback has happened in this job."""
    if not store.has(LEDGER):
        return None
    return (store.fetch(LEDGER, work / "fetched") / "ledger.json").read_text()


def _roll_back(
    spec: JobSpec,
    store: CheckpointStore,
    ranks: Ranks,
    work: Path,
    metrics: CommittedMetrics | None,
    ledger: Ledger,
    event: HealthEvent,
) -> None:
    """Return to the newest checkpoint written before the steps the rule's window looked at: newer ones are
    moved aside (`corrupt/`, with the reason), so this attempt and any relaunch resume from it; the learning
    rate is scaled by train.health.rollback_lr_factor, and the ledger (rollbacks, scale, events) goes into the
    store first, so a preemption from here on keeps both."""
    health = spec.train.health
    window = health.rule(event.rule).window
    target = None
    if ranks.is_main:
        steps = store.complete_steps()
        target = healthy_checkpoint(steps, event, window)
        for step in steps:
            if target is None or step > target:
                store.move_aside(
                    checkpoint_name(step), f"health rollback: {event.rule} fired at step {event.step} ({event.message})"
                )
    target = ranks.broadcast(target)
    ledger.rollbacks += 1
    ledger.lr_scale *= health.rollback_lr_factor
    event.taken = (
        f"rolled back to step {target or 0} (learning rate x{ledger.lr_scale:g} of the configured; "
        f"rollback {ledger.rollbacks} of {health.max_rollbacks})"
    )
    ledger.merge([event])
    for mine in ledger.events:  # the ledger may hold a copy (merged before `taken` was known)
        if (mine.rule, mine.step, mine.action) == (event.rule, event.step, event.action):
            mine.taken = event.taken
    if ranks.is_main:
        log.warning("health: %s at step %d -> %s", event.rule, event.step, event.taken)
        folder = work / "ledger"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "ledger.json").write_text(ledger.to_json())
        store.put(folder, LEDGER, event.step)
        if metrics:
            metrics.take()  # the rolled-back steps not yet committed: the steps recomputed from here stand
            metrics.client.set_tag(
                metrics.run_id,
                f"health/step-{event.step}/{event.rule}",
                f"{event.action}: {event.message} -> {event.taken}"[:5000],
            )
            metrics.client.log_metric(metrics.run_id, "health/rollbacks", ledger.rollbacks, step=event.step)
    shutil.rmtree(work / "hf", ignore_errors=True)  # HF's local checkpoints of the abandoned steps
    ranks.barrier()


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _ended_by_bad_input(spec: JobSpec, run_id: str, metrics: CommittedMetrics | None, message: str) -> None:
    """Bad input ends the job for good (exit 2): its MLflow run ends FAILED and says why. Whichever rank's
    reward failed does it (each rank scores its own completions, and a failure on rank 1 leaves rank 0 in a
    collective until torchrun stops it), so the rank that knows the reason writes it."""
    from mlflow import MlflowClient

    client = metrics.client if metrics else MlflowClient(spec.mlflow_tracking_uri)
    client.set_tag(run_id, "failure", message[:5000])
    client.set_terminated(run_id, "FAILED")


def _same_resume_point(ranks: Ranks, resume: Path | None) -> None:
    """Every rank must start from the same checkpoint; ranks that chose differently (a store that changed
    between their reads) fail the job, and the relaunch chooses again, rather than train apart."""
    step = None
    if resume is not None:
        step = json.loads((Path(resume) / "trainer_state.json").read_text())["global_step"]
    chosen = ranks.all_gather(step)
    if len(set(chosen)) > 1:
        raise RuntimeError(f"ranks chose different checkpoints to resume from (steps by rank: {chosen})")


def _publish(
    spec: JobSpec,
    trainer: GRPOTrainer,
    store: CheckpointStore,
    result: TrainResult,
    metrics: CommittedMetrics | None,
    ranks: Ranks,
) -> None:
    """Save the adapter, log it, and store it as the `final` entry (with the result and last metrics)."""
    from transformers.trainer import TRAINING_ARGS_NAME

    if ranks.is_main:
        shutil.rmtree(spec.adapter_dir, ignore_errors=True)
    ranks.barrier()
    # an older step than the last with the best validation reward: its adapter is published, not the last's
    best = result.best_step if result.best_step != result.global_step else None
    if ranks.broadcast(best is not None and not store.has(checkpoint_name(best)) if ranks.is_main else None):
        log.warning(
            "the best validation reward's checkpoint (step %d) is no longer in the store; publishing the "
            "last step's adapter",
            best,
        )
        result.best_step = result.best_val_reward = None
        best = None
    if best is not None:
        # the best validation reward's checkpoint, not the last step's model; every rank takes the same branch
        if not ranks.is_main:
            return
        _adapter_from_checkpoint(store, best, Path(spec.work_dir) / "best", Path(spec.adapter_dir))
        log.info(
            "published the adapter of step %d (best validation reward %.4g), not the last step's (%d)",
            best,
            result.best_val_reward,
            result.global_step,
        )
    else:
        trainer.save_model(spec.adapter_dir)  # every rank: under FSDP / ZeRO-3 it gathers the shards; rank 0 writes
    if not ranks.is_main:
        return
    assert isinstance(store, FencedStore), "rank 0's store is fenced (run claims it)"
    store.check_owner()  # before the adapter reaches MLflow: a superseded attempt publishes nothing
    # HF also pickles its TrainingArguments beside the adapter; the published adapter holds safetensors and
    # JSON only (nothing a consumer could unpickle), and the arguments are the train run's MLflow params.
    (Path(spec.adapter_dir) / TRAINING_ARGS_NAME).unlink(missing_ok=True)
    if metrics:
        metrics.client.log_artifacts(metrics.run_id, spec.adapter_dir, "adapter")
    final = Path(spec.work_dir) / "final"
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(spec.adapter_dir, final)
    (final / RESULT_FILE).write_text(result.model_dump_json(indent=1))
    tail = metrics.take() if metrics else []
    CommittedMetrics.write(tail, final)
    store.put(final, FINAL, result.global_step)
    if metrics:
        metrics.commit(tail)
        metrics.client.set_terminated(metrics.run_id)


# What a checkpoint holds beside the adapter and its tokenizer: training state, not part of a published adapter.
_TRAINING_STATE = ("optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", "training_args.bin")


def _adapter_from_checkpoint(store: CheckpointStore, step: int, scratch: Path, dest: Path) -> None:
    """The adapter files (and the tokenizer HF saved with them) of a stored checkpoint, copied to `dest`."""
    source = store.fetch(checkpoint_name(step), scratch)
    skip = {*_TRAINING_STATE, MANIFEST, METRICS_FILE, health_state.STATE_FILE, sampling.STATE_FILE}
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.name not in skip and not path.name.startswith("rng_state"):
            shutil.copy2(path, dest / path.name)


def _slow_bf16(spec: JobSpec) -> str | None:
    """A bf16 request this node would run far slower than float32 (a CPU without native bf16), or None."""
    import torch

    cuda = torch.cuda.is_available()
    return slow_bf16_reason(bool(spec.train.grpo.get("bf16")), cuda, cpu_has_native_bf16())


def _staged_init_adapter(spec: JobSpec) -> JobSpec:
    """The spec with its warm start's adapter on this node: fetched from the store's `init-adapter` entry into
    this rank's work folder and checked against the hashes the spec pins, when the launcher shipped it that way
    (`init_adapter_files`); the spec as it is otherwise (the adapter is a local directory)."""
    if not spec.init_adapter or spec.init_adapter_files is None:
        return spec
    store = open_store(spec.checkpoint_uri, spec.train.s3_endpoint_url)
    work = distributed.rank_work_dir(spec.work_dir, int(os.environ.get("RANK", "0")))  # each rank its own copy
    try:
        directory = fetch_init_adapter(store, spec.init_adapter_files, work / "init")
    except CheckpointCorrupt as exc:  # the same store would give the same files to every recovery: not retried
        raise Refused(str(exc)) from exc
    log.info(
        "warm start: the adapter from %r verified against the job spec's %d file hashes",
        store,
        len(spec.init_adapter_files),
    )
    return spec.model_copy(update={"init_adapter": str(directory)})


def _unfit_adapter(spec: JobSpec) -> str | None:
    """Why the spec's init_adapter cannot be trained with its train.lora (a hand-made spec too; the pipeline
    checked the base where it resolved the adapter), or None: refused before the model loads."""
    if not spec.init_adapter:
        return None
    try:
        problem = adapter_mismatch(read_adapter_config(spec.init_adapter), None, spec.train.lora)
    except ValueError as exc:
        problem = str(exc)
    return f"init_adapter {spec.init_adapter}: {problem}" if problem else None


def main(spec_path: str, started: float | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not rank_lifeline():  # first: a rank whose torchrun is gone must not start training alone
        log.error("torchrun, this rank's parent, is gone; exiting")
        return EXIT_FAILED
    try:
        spec = JobSpec.read(Path(spec_path))
    except (OSError, ValueError) as exc:
        log.error("bad job spec %s: %s", spec_path, exc)
        distributed.record("exit", EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    if spec.train.cpu_threads:  # before any torch work: the intra-op pool is sized on first use
        import torch

        torch.set_num_threads(spec.train.cpu_threads)
    try:
        spec = _staged_init_adapter(spec)
        if refused := _slow_bf16(spec) or _unfit_adapter(spec):
            raise Refused(refused)
        result = run(spec, started)
    except BaseException as exc:
        code, lead = next(((code, lead) for kind, code, lead in EXITS if isinstance(exc, kind)), (EXIT_FAILED, None))
        distributed.record("exit", code)
        if lead is None:  # the node, the store or the network: a relaunch resumes from the last checkpoint
            raise
        log.error("%s: %s", lead, exc)
        if code == EXIT_BAD_INPUT:  # the SkyPilot launcher cancels the job's recovery on this line
            print(bad_input_line(str(exc)), flush=True)
        return code
    code = EXIT_INTERRUPTED if result.interrupted else 0
    distributed.record("exit", code)
    if distributed.current().is_main:
        print(result.model_dump_json())  # last line of stdout: the result, for launchers and benchmarks
    distributed.finish()
    return code
