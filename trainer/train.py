"""One GRPO training job: TRL's GRPOTrainer with a PEFT LoRA adapter, resumable from the checkpoint store.

Run it alone on any node: `python -m trainer --spec job.json`. Exit codes: 0 finished (max_steps or
early stop), 75 interrupted by SIGTERM after a checkpoint (relaunch to resume), 2 bad input (a bad spec, or
a reward that cannot be resolved or gives unusable scores, `RewardError`: a relaunch would fail the same
way), 1 any other failure, a reward's outage included (`RewardUnavailable`: its service down after its
retries, a timeout, out of memory): a relaunch may succeed, and resumes from the last checkpoint.

Under torchrun (`python -m trainer.launch`) each rank runs this same code; rank 0 alone uploads checkpoints
(with every rank's files in them), commits MLflow metrics, publishes `final` and writes the result file;
every rank resumes from the same checkpoint, and a SIGTERM to any rank stops all of them after one more
checkpoint (`trainer.distributed`).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from trainer import distributed
from trainer.checkpoints import FINAL, choose_resume, collect_final, open_store
from trainer.distributed import Ranks
from trainer.spec import RESULT_FILE, JobSpec, TrainResult, bad_input_line
from trainer.tracking import CommittedMetrics, numeric

log = logging.getLogger(__name__)
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: try again
EXIT_BAD_INPUT = 2  # the same job fails the same way again: never relaunched
EXIT_FAILED = 1  # anything else, a reward's outage included: relaunched, resumed from the last checkpoint


def grpo_args(spec: JobSpec, output_dir: Path):
    """GRPOConfig from the spec: the user's passthrough fields plus what resume and the store require."""
    import os

    import torch
    from trl import GRPOConfig

    from trainer.callbacks import interactive
    from trainer.precision import node_default_bf16

    user = dict(spec.train.grpo)
    user.setdefault("bf16", node_default_bf16())  # unset: bf16 where this node computes it fast (trainer.precision)
    user.setdefault("report_to", [])  # MLflow is logged by CommittedMetrics, once per step across restarts
    user.setdefault("disable_tqdm", not interactive())  # no bar redraws in a launcher's or a worker's log
    user.setdefault("ddp_timeout", spec.train.distributed.timeout_s)  # no collective waits longer for a lost rank
    if not torch.cuda.is_available() and (distributed.current().world > 1 or user["bf16"]):
        # Several ranks: else accelerate takes them for unconnected processes. bf16: transformers accepts
        # bf16 without a GPU only with use_cpu (then accelerate autocasts on the CPU).
        user.setdefault("use_cpu", True)
    if os.environ.get(distributed.VLLM_HOST_ENV):  # vllm_mode=server: where the node launcher started it
        user.setdefault("vllm_server_host", os.environ[distributed.VLLM_HOST_ENV])
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


def _already_finished(spec: JobSpec, store, metrics: CommittedMetrics | None, ranks: Ranks) -> TrainResult:
    """A relaunch after the job finished (killed between its last upload and its exit): report, don't retrain."""
    if not ranks.is_main:  # rank 0 alone copies the adapter out and reports
        final = store.fetch(FINAL, distributed.rank_work_dir(spec.work_dir, ranks.rank) / "fetched")
        return TrainResult.model_validate_json((final / RESULT_FILE).read_text())
    result, final = collect_final(spec, store)
    if metrics:
        metrics.commit(CommittedMetrics.read(final))
    return _report(spec, result)


def run(spec: JobSpec, started: float | None = None) -> TrainResult:
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import EarlyStoppingCallback
    from trl import GRPOTrainer

    from trainer.callbacks import (CheckpointSync, FirstStepTimer, ReportValidation, StopOnSigterm, hide_library_bars,
                                   print_logs_once)
    from trainer.loading import load_model
    from trainer.rewards import RewardError, RewardUnavailable, resolve_rewards

    started = started or time.monotonic()
    stop = StopOnSigterm()  # first: a SIGTERM during model loading must not kill the job uncleanly
    ranks = stop.ranks = distributed.init(spec.train.distributed.timeout_s)
    work = distributed.rank_work_dir(spec.work_dir, ranks.rank)
    store = open_store(spec.checkpoint_uri, spec.train.s3_endpoint_url)
    if ranks.is_main:  # the others only read from the store
        store.check()
    run_id = ranks.broadcast(_ensure_mlflow_run(spec) if ranks.is_main else None)
    metrics = CommittedMetrics(spec.mlflow_tracking_uri, run_id) if run_id and ranks.is_main else None
    if ranks.broadcast(store.has(FINAL) if ranks.is_main else None):
        return _already_finished(spec, store, metrics, ranks)
    point = choose_resume(store, work / "resume")  # verified; newer ones that do not verify are moved aside
    resume = point.directory
    if point.reason and metrics:
        metrics.client.set_tag(run_id, "resume_fallback", point.reason[:5000])
    if resume:
        if metrics:  # in case the kill came between the checkpoint's manifest and its MLflow commit
            metrics.commit(CommittedMetrics.read(resume))
    _same_resume_point(ranks, resume)

    args = grpo_args(spec, work / "hf")
    if metrics:
        metrics.client.log_param(run_id, "precision", "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")
    if args.disable_tqdm:  # nor the bars of loading the model and the data
        hide_library_bars()
    # a warm start continues the adapter's own weights (trainable); the optimizer, scheduler and step are fresh
    model, tokenizer = load_model(spec.model_path, spec.model, adapter=spec.init_adapter, trainable=True)
    train_ds = load_dataset("json", data_files=spec.train_file, split="train")
    val_ds = load_dataset("json", data_files=spec.val_file, split="train") if spec.val_file else None
    sync = CheckpointSync(store, spec.train.keep_checkpoints, work / "staging", metrics, ranks)
    timer = FirstStepTimer(started)
    callbacks = [sync, stop, timer, ReportValidation()] + ([metrics] if metrics else [])
    if spec.train.early_stopping_patience:
        if val_ds is None:
            raise ValueError("train.early_stopping_patience needs a validation split (val_file)")
        callbacks.append(EarlyStoppingCallback(spec.train.early_stopping_patience))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=resolve_rewards(spec.train.rewards, spec.train.reward_args,
                                     max_completion_length=args.max_completion_length),
        args=args,
        train_dataset=train_ds,
        eval_dataset=val_ds,
        processing_class=tokenizer,
        # a warm start passes a PeftModel holding its adapter, and TRL takes no peft_config with one
        peft_config=None if spec.init_adapter else LoraConfig(task_type="CAUSAL_LM", **spec.train.lora),
        callbacks=callbacks,
    )
    print_logs_once(trainer)  # one line per log, with its step, for the parent's progress
    try:
        output = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except RewardError as exc:
        if run_id and not isinstance(exc, RewardUnavailable):  # an outage is retried: the run goes on
            _ended_by_bad_input(spec, run_id, metrics, str(exc))
        raise
    sync.wait()  # the newest checkpoint must be in the store before we report or exit

    state = trainer.state
    finished = state.global_step >= state.max_steps
    interrupted = stop.received and not finished
    result = TrainResult(
        adapter_dir=None if interrupted else spec.adapter_dir,
        global_step=state.global_step,
        max_steps=state.max_steps,
        resumed_from_step=point.step,
        interrupted=interrupted,
        stopped_early=not stop.received and not finished,
        mlflow_run_id=run_id,
        train_runtime_s=time.monotonic() - started,
        first_step_s=timer.seconds,
        precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        metrics=numeric(output.metrics),
        world_size=ranks.world,
    )
    if not interrupted:
        _publish(spec, trainer, store, result, metrics, ranks)
    return _report(spec, result) if ranks.is_main else result


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
        import json

        step = json.loads((Path(resume) / "trainer_state.json").read_text())["global_step"]
    chosen = ranks.all_gather(step)
    if len(set(chosen)) > 1:
        raise RuntimeError(f"ranks chose different checkpoints to resume from (steps by rank: {chosen})")


def _publish(spec: JobSpec, trainer, store, result: TrainResult, metrics: CommittedMetrics | None,
             ranks: Ranks) -> None:
    """Save the adapter, log it, and store it as the `final` entry (with the result and last metrics)."""
    from transformers.trainer import TRAINING_ARGS_NAME

    if ranks.is_main:
        shutil.rmtree(spec.adapter_dir, ignore_errors=True)
    ranks.barrier()
    trainer.save_model(spec.adapter_dir)  # every rank: under FSDP / ZeRO-3 it gathers the shards; rank 0 writes
    if not ranks.is_main:
        return
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


def _slow_bf16(spec: JobSpec) -> str | None:
    """A bf16 request this node would run far slower than float32 (a CPU without native bf16), or None."""
    import torch

    from trainer.precision import cpu_has_native_bf16, slow_bf16_reason

    cuda = torch.cuda.is_available()
    return slow_bf16_reason(bool(spec.train.grpo.get("bf16")), cuda, cpu_has_native_bf16())


def _unfit_adapter(spec: JobSpec) -> str | None:
    """Why the spec's init_adapter cannot be trained with its train.lora (a hand-made spec too; the pipeline
    checked the base where it resolved the adapter), or None: refused before the model loads."""
    if not spec.init_adapter:
        return None
    from trainer.loading import adapter_mismatch, read_adapter_config

    try:
        problem = adapter_mismatch(read_adapter_config(spec.init_adapter), None, spec.train.lora)
    except ValueError as exc:
        problem = str(exc)
    return f"init_adapter {spec.init_adapter}: {problem}" if problem else None


def main(spec_path: str, started: float | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = JobSpec.read(Path(spec_path))
    except (OSError, ValueError) as exc:
        log.error("bad job spec %s: %s", spec_path, exc)
        distributed.record("exit", EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    from trainer.rewards import RewardError, RewardUnavailable

    refused = _slow_bf16(spec) or _unfit_adapter(spec)
    if refused:
        log.error("bad input: %s", refused)
        print(bad_input_line(refused), flush=True)
        distributed.record("exit", EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    try:
        result = run(spec, started)
    except RewardUnavailable as exc:  # the reward's service or the node's memory, not the input: relaunch
        log.error("reward unavailable (exit 1: a relaunch resumes from the last checkpoint): %s", exc)
        distributed.record("exit", EXIT_FAILED)
        return EXIT_FAILED
    except RewardError as exc:  # the reward or the data is at fault, not the node: launchers must not retry it
        log.error("bad input: %s", exc)
        print(bad_input_line(str(exc)), flush=True)  # the SkyPilot launcher cancels the job's recovery on it
        distributed.record("exit", EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    except BaseException:
        distributed.record("exit", EXIT_FAILED)
        raise
    code = EXIT_INTERRUPTED if result.interrupted else 0
    distributed.record("exit", code)
    if distributed.current().is_main:
        print(result.model_dump_json())  # last line of stdout: the result, for launchers and benchmarks
    distributed.finish()
    return code
