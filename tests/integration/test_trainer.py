"""The trainer on a tiny random Llama: real GRPO steps, real checkpoints, real process kills."""

import json
import re
import signal
import subprocess
import sys
import time

import mlflow
import pytest

from grpo_pipeline.tasks.job import TrainProgress, model_load, train_settings
from grpo_pipeline.trainer.checkpoints import FINAL, MANIFEST, LocalStore
from grpo_pipeline.trainer.spec import JobSpec, TrainResult

pytestmark = pytest.mark.integration


def _spec(tmp_path, tiny_model, tiny_splits, cfg, **extra) -> JobSpec:
    return JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        val_file=str(tiny_splits["val"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
        **extra,
    )


def _run_trainer(spec: JobSpec, tmp_path) -> subprocess.Popen:
    path = spec.write(tmp_path / "job.json")
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_pipeline.trainer", "--spec", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_trains_logs_to_mlflow_and_saves_a_loadable_adapter(tmp_path, tiny_model, tiny_splits, tiny_config):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_pipeline.trainer.train import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config("train.grpo.max_steps=3", "train.checkpoint_every=2")
    result = run(_spec(tmp_path, tiny_model, tiny_splits, cfg, mlflow_tracking_uri=uri))

    assert (result.global_step, result.resumed_from_step, result.interrupted) == (3, None, False)
    assert LocalStore(tmp_path / "ckpt").complete_steps() == [2, 3]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), result.adapter_dir)
    assert any("lora_A" in name for name, _ in model.named_parameters())

    client = mlflow.MlflowClient(uri)
    run_ = client.get_run(result.mlflow_run_id)
    assert run_.data.params["learning_rate"] == "0.001"
    assert len(client.get_metric_history(run_.info.run_id, "reward")) == 3
    assert "adapter/adapter_model.safetensors" in [f.path for f in client.list_artifacts(run_.info.run_id, "adapter")]


@pytest.mark.slow  # a killed trainer and its rerun (as docs/reliability.md says): make test-slow (the default run's 12-minute budget)
def test_sigkill_then_rerun_resumes_from_the_last_complete_checkpoint(tmp_path, tiny_model, tiny_splits, tiny_config):
    cfg = tiny_config("train.grpo.max_steps=40", "train.checkpoint_every=4", "train.keep_checkpoints=2")
    spec = _spec(tmp_path, tiny_model, tiny_splits, cfg)
    store = LocalStore(spec.checkpoint_uri)
    proc = _run_trainer(spec, tmp_path)
    deadline = time.monotonic() + 240
    while not store.complete_steps() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: a hard preemption
    proc.wait()
    steps = store.complete_steps()
    assert steps and steps[-1] < 40, "the kill should land mid-run"

    proc = _run_trainer(spec, tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    result = TrainResult.model_validate_json((tmp_path / "work" / "result.json").read_text())
    assert result.resumed_from_step == steps[-1]
    assert result.global_step == 40
    # the parent's progress, from the relaunch's own lines: from the resumed step on, each step once, no bars
    shown = [line for line in map(TrainProgress().update, out.splitlines()) if line]
    assert [int(re.match(r"step (\d+)/40 ", line)[1]) for line in shown] == list(range(steps[-1] + 1, 41)), shown[:3]
    assert "%|" not in out, out[-3000:]
    state = json.loads((tmp_path / "ckpt" / "checkpoint-40" / "trainer_state.json").read_text())
    assert state["global_step"] == 40


def test_resume_skips_a_checkpoint_whose_manifest_is_missing(tmp_path, tiny_model, tiny_splits, tiny_config):
    from grpo_pipeline.trainer.train import run

    cfg = tiny_config("train.grpo.max_steps=4", "train.checkpoint_every=2")
    spec = _spec(tmp_path, tiny_model, tiny_splits, cfg)
    run(spec)
    # As if killed while uploading checkpoint 4, before the final adapter was stored.
    LocalStore(spec.checkpoint_uri).delete(FINAL)
    (tmp_path / "ckpt" / "checkpoint-4" / MANIFEST).unlink()
    result = run(spec)
    assert result.resumed_from_step == 2
    assert result.global_step == 4


def test_sigterm_checkpoints_and_exits_with_the_retry_code(tmp_path, tiny_model, tiny_splits, tiny_config):
    from grpo_pipeline.trainer.spec import EXIT_INTERRUPTED

    cfg = tiny_config("train.grpo.max_steps=400", "train.checkpoint_every=1000")
    spec = _spec(tmp_path, tiny_model, tiny_splits, cfg)
    proc = _run_trainer(spec, tmp_path)
    log = tmp_path / "work" / "hf"
    deadline = time.monotonic() + 240
    while not log.exists() and time.monotonic() < deadline:  # the trainer is in its loop
        time.sleep(0.05)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_INTERRUPTED, out[-3000:]
    steps = LocalStore(spec.checkpoint_uri).complete_steps()
    assert len(steps) == 1 and 0 < steps[0] < 400


def test_bad_spec_exits_2(tmp_path, caplog):
    """The trainer's entry point in this process: a process of its own would pay torch's and TRL's imports
    again only to read a bad file (the tests above run `python -m grpo_pipeline.trainer` for real, exit codes
    included)."""
    from grpo_pipeline.trainer.train import main

    (tmp_path / "job.json").write_text('{"model_path": 1}')
    assert main(str(tmp_path / "job.json")) == 2
    assert "bad job spec" in caplog.text


def test_early_stopping_on_validation_reward(tmp_path, tiny_model, tiny_splits, tiny_config):
    from grpo_pipeline.trainer.train import run

    # A random tiny model never improves its validation reward: patience 1 stops at the second evaluation.
    cfg = tiny_config("train.grpo.max_steps=50", "train.checkpoint_every=2", "train.early_stopping_patience=1")
    result = run(_spec(tmp_path, tiny_model, tiny_splits, cfg))
    assert result.stopped_early
    assert result.global_step == 4
    assert result.adapter_dir is not None


def test_qlora_nf4_base_trains_and_resumes(tmp_path, tiny_model, tiny_splits, tiny_config):
    """bitsandbytes 4-bit loading and LoRA backward run on the CPU, so QLoRA is tested here too."""
    import bitsandbytes as bnb

    from grpo_pipeline.trainer.loading import load_model
    from grpo_pipeline.trainer.train import run

    cfg = tiny_config(
        "model.quantization=nf4", "model.double_quant=true", "train.grpo.max_steps=2", "train.checkpoint_every=1"
    )
    model, _ = load_model(str(tiny_model), model_load(cfg.model))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    first = run(_spec(tmp_path, tiny_model, tiny_splits, cfg))
    assert first.global_step == 2
    LocalStore(tmp_path / "ckpt").delete(FINAL)  # same store, longer job: resume instead of reporting done
    longer = cfg.model_copy(update={"train": cfg.train.model_copy(update={"grpo": {**cfg.train.grpo, "max_steps": 3}})})
    second = run(_spec(tmp_path, tiny_model, tiny_splits, longer))
    assert (second.resumed_from_step, second.global_step) == (2, 3)
