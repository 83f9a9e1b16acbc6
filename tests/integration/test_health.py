"""The health rules on real training (tiny random Llama, a few steps): a reward that gives every completion the
same score stops the run on the zero-variance rule; a reward that pays for length stops it on the length rule;
a run killed and resumed keeps its rule windows; two processes agree on a stop; a NaN at a known step rolls
back to the last healthy checkpoint at half the learning rate and the run finishes; every event is in the
result and in MLflow."""

import json
import os
import subprocess
import sys
import time

import mlflow
import pytest
import torch

from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.checkpoints import LocalStore
from grpo_pipeline.trainer.health import STATE_FILE
from grpo_pipeline.trainer.spec import JobSpec, TrainResult

pytestmark = pytest.mark.integration
REWARDS = "tests.integration.health_rewards"


def _spec(tmp_path, tiny_model, tiny_splits, cfg, **extra) -> JobSpec:
    return JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
        **extra,
    )


def test_same_score_for_every_completion_stops_on_zero_variance(tmp_path, tiny_model, tiny_splits, tiny_config):
    from grpo_pipeline.trainer.train import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(
        "train.grpo.max_steps=20",
        "train.checkpoint_every=2",
        f"train.rewards=[{REWARDS}:same_score]",
        "train.health.zero_variance.action=stop",
        "train.health.zero_variance.window=2",
    )
    result = run(_spec(tmp_path, tiny_model, tiny_splits, cfg, mlflow_tracking_uri=uri))

    assert (result.global_step, result.stopped_early) == (2, True)
    assert result.adapter_dir is not None  # stopped, not failed: the flow evaluates what exists
    event = next(e for e in result.health if e.rule == "zero_variance")
    assert (event.step, event.value, event.threshold, event.action, event.taken) == (2, 1.0, 0.9, "stop", "stopped")
    assert result.stopped_by.startswith("health rule zero_variance at step 2")
    saved = TrainResult.model_validate_json((tmp_path / "work" / "result.json").read_text())
    assert saved.health == result.health
    run_ = mlflow.MlflowClient(uri).get_run(result.mlflow_run_id)
    assert run_.data.tags["health/step-2/zero_variance"].startswith("stop: ")
    assert run_.data.tags["health_stopped"] == result.stopped_by
    assert run_.data.metrics["health/zero_variance"] == 1.0
    # the windows travel with the checkpoint: what a resume restores
    state = json.loads((tmp_path / "ckpt" / "checkpoint-2" / STATE_FILE).read_text())
    assert state["tracks"]["zero_variance"]["values"] == [1.0, 1.0] and state["events"][0]["rule"] == "zero_variance"


def test_nan_at_a_known_step_rolls_back_to_the_last_healthy_checkpoint_and_finishes(
    tmp_path, tiny_model, tiny_splits, tiny_config, monkeypatch
):
    from grpo_pipeline.trainer.train import run

    monkeypatch.setenv("HEALTH_TEST_POISON", str(tmp_path / "poisoned"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(
        "train.grpo.max_steps=5",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=3",
        f"train.rewards=[{REWARDS}:nan_weights_once]",
    )
    assert cfg.train.health.non_finite.action == "rollback"  # the default
    result = run(_spec(tmp_path, tiny_model, tiny_splits, cfg, mlflow_tracking_uri=uri))

    assert (tmp_path / "poisoned").exists()
    assert (result.global_step, result.stopped_early, result.rollbacks) == (5, False, 1)
    event = next(e for e in result.health if e.rule == "non_finite")
    assert (event.step, event.action) == (3, "rollback")
    assert event.taken.startswith("rolled back to step 2 (learning rate x0.5")
    assert LocalStore(tmp_path / "ckpt").complete_steps() == [2, 4, 5]  # 4 and 5 trained after the rollback
    state = json.loads((tmp_path / "ckpt" / "checkpoint-4" / STATE_FILE).read_text())
    assert (state["rollbacks"], state["lr_scale"]) == (1, 0.5)
    client = mlflow.MlflowClient(uri)
    run_ = client.get_run(result.mlflow_run_id)
    assert "rolled back to step 2" in run_.data.tags["health/step-3/non_finite"]
    assert [m.value for m in client.get_metric_history(result.mlflow_run_id, "health/rollbacks")] == [1.0]
    # the learning rate after the rollback is half what the schedule gives at the same step without one
    lrs = {int(m.step): m.value for m in client.get_metric_history(result.mlflow_run_id, "learning_rate")}
    assert lrs[4] == pytest.approx(0.5 * 1e-3 * (1 - 3 / 5), rel=1e-6)


def test_with_a_validation_split_the_best_steps_adapter_is_published_and_kept(
    tmp_path, tiny_model, tiny_splits, tiny_config
):
    from grpo_pipeline.trainer.train import run

    cfg = tiny_config(
        "train.grpo.max_steps=4",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1",
        "train.early_stopping_patience=5",
        f"train.rewards=[{REWARDS}:worse_with_steps]",
    )
    spec = _spec(tmp_path, tiny_model, tiny_splits, cfg, val_file=str(tiny_splits["val"]))
    result = run(spec)

    assert (result.global_step, result.best_step) == (4, 2)  # evaluations at 2 (1/3) and 4 (1/5)
    assert result.best_val_reward == pytest.approx(1 / 3, abs=0.011)
    assert LocalStore(tmp_path / "ckpt").complete_steps() == [2, 4]  # keep 1, and the best though older
    published = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert published == (tmp_path / "ckpt" / "checkpoint-2" / "adapter_model.safetensors").read_bytes()
    assert published != (tmp_path / "ckpt" / "checkpoint-4" / "adapter_model.safetensors").read_bytes()
    assert not (tmp_path / "adapter" / "optimizer.pt").exists()


@pytest.fixture(scope="module")
def short_model(tiny_model, tmp_path_factory):
    """The tiny model made to end its answers early (about 2.3 tokens on average, few cut at 6),
    so that a reward can lengthen them: one hidden dimension is the same for every token's embedding (its
    logit contribution is then the same for every token, no change), except the end token's, which is larger
    there, so every position leans to ending. Its weights stay trainable like any others."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path_factory.mktemp("short-llama")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight  # tied: the output layer's too
        embeddings[:, 0] = 1.0
        embeddings[tokenizer.eos_token_id, 0] = 1.5
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def test_a_reward_that_pays_for_length_trips_the_length_rule_and_stops(tmp_path, short_model, tiny_splits, tiny_config):
    from grpo_pipeline.trainer.train import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(
        "train.grpo.max_steps=12",
        "train.checkpoint_every=4",
        "train.grpo.per_device_train_batch_size=8",
        "train.grpo.learning_rate=1e-2",
        "train.grpo.max_completion_length=12",  # room to grow: the model starts at about 2.5 tokens
        f"train.rewards=[{REWARDS}:longer_is_better]",
        "train.health.length_drift.action=stop",
        "train.health.length_drift.window=2",
        "train.health.length_drift.threshold=1.5",
        "train.health.clipped_completions.window=2",  # warn, the default action
    )
    spec = _spec(tmp_path, tiny_model=short_model, tiny_splits=tiny_splits, cfg=cfg, mlflow_tracking_uri=uri)
    result = run(spec)

    client = mlflow.MlflowClient(uri)
    lengths = {int(m.step): m.value for m in client.get_metric_history(result.mlflow_run_id, "completions/mean_length")}
    event = next(e for e in result.health if e.rule == "length_drift")
    # the lengths grew from the first window's to 1.5 times it, and the run ended on that step
    assert event.value >= 1.5 and event.action == "stop" and event.taken == "stopped"
    first = (lengths[1] + lengths[2]) / 2
    assert (lengths[event.step] + lengths[event.step - 1]) / 2 == pytest.approx(event.value * first)
    assert first < 12 / 1.5  # it started short: the growth is the reward's doing, not a model born at the limit
    assert result.stopped_early and result.global_step == event.step < 12
    assert result.stopped_by.startswith(f"health rule length_drift at step {event.step}")
    assert result.adapter_dir is not None
    # where the team looks: the summary the flow reads, and MLflow's tag and metric at the step it fired
    saved = TrainResult.model_validate_json((tmp_path / "work" / "result.json").read_text())
    assert saved.health == result.health and saved.stopped_by == result.stopped_by
    run_ = client.get_run(result.mlflow_run_id)
    assert run_.data.tags[f"health/step-{event.step}/length_drift"].startswith("stop: mean completion length")
    assert run_.data.tags["health_stopped"] == result.stopped_by
    [metric] = client.get_metric_history(result.mlflow_run_id, "health/length_drift")
    assert (metric.step, metric.value) == (event.step, pytest.approx(event.value))


@pytest.mark.slow  # a trainer to its first checkpoint, killed, and a resume: about two minutes on 2 cores
def test_a_resumed_run_keeps_its_rule_windows(tmp_path, tiny_model, tiny_splits, tiny_config):
    """Killed after step 2's checkpoint (window 4: two values in it), the resumed run fires at step 4, where the
    uninterrupted run fires; windows restarted on resume would fire at step 6."""
    from grpo_pipeline.trainer.train import run
    from tests.integration.health_rewards import HALT_ENV

    cfg = tiny_config(
        "train.grpo.max_steps=10",
        "train.checkpoint_every=2",
        f"train.rewards=[{REWARDS}:same_score_halting]",
        "train.health.zero_variance.action=stop",
        "train.health.zero_variance.window=4",
    )
    spec = _spec(tmp_path, tiny_model, tiny_splits, cfg)
    halted = tmp_path / "halted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_pipeline.trainer", "--spec", str(spec.write(tmp_path / "job.json"))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, HALT_ENV: str(halted)},
    )
    deadline = time.monotonic() + 600  # a bound on a hung trainer, not a timing assumption
    while not halted.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()  # a preemption without notice, while step 3 is being scored
    out, _ = proc.communicate(timeout=60)
    assert halted.exists(), out[-3000:]
    assert LocalStore(tmp_path / "ckpt").complete_steps() == [2]
    saved = json.loads((tmp_path / "ckpt" / "checkpoint-2" / STATE_FILE).read_text())
    assert saved["tracks"]["zero_variance"]["values"] == [1.0, 1.0] and saved["events"] == []

    result = run(spec)  # the relaunch, without the halt

    assert result.resumed_from_step == 2
    event = next(e for e in result.health if e.rule == "zero_variance")
    assert (event.step, event.action, event.taken) == (4, "stop", "stopped")
    assert (result.global_step, result.stopped_early) == (4, True)


@pytest.mark.slow  # two training processes (torchrun, gloo) on 2 cores: a minute or more
@pytest.mark.timeout(900)
def test_two_processes_agree_on_a_stop(tmp_path, tiny_model, tiny_splits, tiny_config, monkeypatch):
    """Rank 0 decides, rank 1 acts on its decision: both end after step 2, neither scores step 3's completions,
    and the job ends by itself (no rank left waiting on the other in a collective)."""
    from grpo_pipeline.infra.launch.local import LocalLauncher
    from tests.integration.health_rewards import CALLS_ENV

    monkeypatch.setenv(CALLS_ENV, str(tmp_path / "calls"))
    cfg = tiny_config(
        "train.grpo.max_steps=10",
        "train.checkpoint_every=2",
        "train.grpo.per_device_train_batch_size=2",
        "train.distributed.processes_per_node=2",
        "train.distributed.timeout_s=120",
        f"train.rewards=[{REWARDS}:same_score_recorded]",
        "train.health.zero_variance.action=stop",
        "train.health.zero_variance.window=2",
    )
    launcher = LocalLauncher(max_restarts=0)
    result = launcher.wait(launcher.launch(_spec(tmp_path, tiny_model, tiny_splits, cfg)))

    assert (result.world_size, result.global_step, result.stopped_early) == (2, 2, True)
    assert result.stopped_by.startswith("health rule zero_variance at step 2")
    for rank in (0, 1):  # each rank scored steps 1 and 2 (the state's step is 0 and 1 then), none after
        steps = {int(line.split()[0]) for line in (tmp_path / f"calls.rank{rank}").read_text().splitlines()}
        assert steps == {0, 1}, (rank, steps)
