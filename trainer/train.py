"""One GRPO training job: TRL's GRPOTrainer with a PEFT LoRA adapter, resumable from the checkpoint store.

Run it alone on any node: `python -m trainer --spec job.json`. Exit codes: 0 finished (max_steps or
early stop), 75 interrupted by SIGTERM after a checkpoint (relaunch to resume), 2 bad spec, 1 failure.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from trainer.checkpoints import FINAL, checkpoint_name, collect_final, open_store
from trainer.spec import RESULT_FILE, JobSpec, TrainResult
from trainer.tracking import CommittedMetrics, numeric

log = logging.getLogger(__name__)
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: try again


def grpo_args(spec: JobSpec, output_dir: Path):
    """GRPOConfig from the spec: the user's passthrough fields plus what resume and the store require."""
    import torch
    from trl import GRPOConfig

    user = dict(spec.train.grpo)
    user.setdefault("bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    user.setdefault("report_to", [])  # MLflow is logged by CommittedMetrics, once per step across restarts
    if spec.train.early_stopping_patience:
        user.setdefault("eval_strategy", "steps")
        user.setdefault("eval_steps", spec.train.checkpoint_every)
        user.setdefault("metric_for_best_model", "reward")
        user.setdefault("greater_is_better", True)
        user.setdefault("per_device_eval_batch_size", user.get("num_generations", 8))
        # The patience counter lives in the checkpoint; a resumed job must not start it afresh.
        user.setdefault("restore_callback_states_from_checkpoint", True)
    return GRPOConfig(
        output_dir=str(output_dir),
        save_strategy="steps",
        save_steps=spec.train.checkpoint_every,
        save_total_limit=spec.train.keep_checkpoints,
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


def _already_finished(spec: JobSpec, store, metrics: CommittedMetrics | None) -> TrainResult:
    """A relaunch after the job finished (killed between its last upload and its exit): report, don't retrain."""
    result, final = collect_final(spec, store)
    if metrics:
        metrics.commit(CommittedMetrics.read(final))
    return _report(spec, result)


def run(spec: JobSpec, started: float | None = None) -> TrainResult:
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import EarlyStoppingCallback
    from trl import GRPOTrainer

    from trainer.callbacks import CheckpointSync, FirstStepTimer, ReportValidation, StopOnSigterm
    from trainer.loading import load_model
    from trainer.rewards import resolve_reward

    started = started or time.monotonic()
    stop = StopOnSigterm()  # first: a SIGTERM during model loading must not kill the job uncleanly
    work = Path(spec.work_dir)
    store = open_store(spec.checkpoint_uri, spec.train.s3_endpoint_url)
    store.check()
    run_id = _ensure_mlflow_run(spec)
    metrics = CommittedMetrics(spec.mlflow_tracking_uri, run_id) if run_id else None
    if store.has(FINAL):
        return _already_finished(spec, store, metrics)
    steps = store.complete_steps()
    resume = store.fetch(checkpoint_name(steps[-1]), work / "resume") if steps else None
    if resume:
        log.info("resuming from step %d in %r", steps[-1], store)
        if metrics:  # in case the kill came between the checkpoint's manifest and its MLflow commit
            metrics.commit(CommittedMetrics.read(resume))

    args = grpo_args(spec, work / "hf")
    model, tokenizer = load_model(spec.model_path, spec.model)
    train_ds = load_dataset("json", data_files=spec.train_file, split="train")
    val_ds = load_dataset("json", data_files=spec.val_file, split="train") if spec.val_file else None
    sync = CheckpointSync(store, spec.train.keep_checkpoints, work / "staging", metrics)
    timer = FirstStepTimer(started)
    callbacks = [sync, stop, timer, ReportValidation()] + ([metrics] if metrics else [])
    if spec.train.early_stopping_patience:
        if val_ds is None:
            raise ValueError("train.early_stopping_patience needs a validation split (val_file)")
        callbacks.append(EarlyStoppingCallback(spec.train.early_stopping_patience))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[resolve_reward(name) for name in spec.train.rewards],
        args=args,
        train_dataset=train_ds,
        eval_dataset=val_ds,
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", **spec.train.lora),
        callbacks=callbacks,
    )
    output = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    sync.wait()  # the newest checkpoint must be in the store before we report or exit

    state = trainer.state
    finished = state.global_step >= state.max_steps
    interrupted = stop.received and not finished
    result = TrainResult(
        adapter_dir=None if interrupted else spec.adapter_dir,
        global_step=state.global_step,
        max_steps=state.max_steps,
        resumed_from_step=steps[-1] if resume else None,
        interrupted=interrupted,
        stopped_early=not stop.received and not finished,
        mlflow_run_id=run_id,
        train_runtime_s=time.monotonic() - started,
        first_step_s=timer.seconds,
        metrics=numeric(output.metrics),
    )
    if not interrupted:
        _publish(spec, trainer, store, result, metrics)
    return _report(spec, result)


def _publish(spec: JobSpec, trainer, store, result: TrainResult, metrics: CommittedMetrics | None) -> None:
    """Save the adapter, log it, and store it as the `final` entry (with the result and last metrics)."""
    from transformers.trainer import TRAINING_ARGS_NAME

    shutil.rmtree(spec.adapter_dir, ignore_errors=True)
    trainer.save_model(spec.adapter_dir)
    # HF also pickles its TrainingArguments beside the adapter; the published adapter holds safetensors and
    # JSON only (nothing a consumer could unpickle), and the arguments are the train run's MLflow params.
    (Path(spec.adapter_dir) / TRAINING_ARGS_NAME).unlink(missing_ok=True)
    if metrics:
        metrics.client.log_artifacts(result.mlflow_run_id, spec.adapter_dir, "adapter")
    final = Path(spec.work_dir) / "final"
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(spec.adapter_dir, final)
    (final / RESULT_FILE).write_text(result.model_dump_json(indent=1))
    tail = metrics.take() if metrics else []
    CommittedMetrics.write(tail, final)
    store.put(final, FINAL, result.global_step)
    if metrics:
        metrics.commit(tail)
        metrics.client.set_terminated(result.mlflow_run_id)


def main(spec_path: str, started: float | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = JobSpec.read(Path(spec_path))
    except (OSError, ValueError) as exc:
        log.error("bad job spec %s: %s", spec_path, exc)
        return 2
    result = run(spec, started)
    print(result.model_dump_json())  # last line of stdout: the result, for launchers and benchmarks
    return EXIT_INTERRUPTED if result.interrupted else 0
