"""Preemption: the local launcher's trainer is SIGKILLed at three random points of a run that checkpoints
to a real S3 server; the run must still end at max_steps, recompute little, and log each step once."""

import random
import re
import threading
import time
from pathlib import Path

import mlflow
import pytest

from grpo_pipeline.infra.launch.local import LocalLauncher
from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.checkpoints import S3Store
from grpo_pipeline.trainer.spec import JobSpec

pytestmark = pytest.mark.integration
MAX_STEPS, INTERVAL, KILLS = 45, 5, 3


def slow_reward(completions, **_):
    """A reward that takes 0.3 s, so that a step of the tiny model outlasts a checkpoint upload as on a GPU."""
    time.sleep(0.3)
    return [0.0] * len(completions)


def _current_step(log: Path) -> int:
    # the trainer's one line per step (grpo_pipeline.trainer.callbacks.StepLog) names its global step
    found = re.findall(rf"'step': (\d+), 'max_steps': {MAX_STEPS}\}}", log.read_text()) if log.exists() else []
    return int(found[-1]) if found else 0


def _chaos(handle, store: S3Store, log: Path, kills: list, seed: int = 7) -> None:
    """Kill the trainer 1..INTERVAL-2 steps after each new complete checkpoint: a random point mid-interval.

    The step is read from the trainer's per-step log lines, which reach the log a step or so late; the
    margin of two steps keeps each kill inside the interval it aims at.
    """
    rng = random.Random(seed)
    seen = 0
    while len(kills) < KILLS:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            steps = store.complete_steps()
            if steps and steps[-1] > seen and handle.process.poll() is None:
                break
            time.sleep(0.05)
        checkpoint = steps[-1]
        target = checkpoint + rng.randint(1, INTERVAL - 2)
        while _current_step(log) < target and handle.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        handle.process.kill()
        kills.append((checkpoint, _current_step(log)))
        seen = checkpoint + INTERVAL  # the next kill waits for progress past the resumed run's first checkpoint


@pytest.mark.slow
def test_three_sigkills_lose_little_and_log_each_step_once(tmp_path, s3_endpoint, tiny_model, tiny_splits, tiny_config):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("preempt")).info.run_id
    cfg = tiny_config(
        f"train.grpo.max_steps={MAX_STEPS}",
        f"train.checkpoint_every={INTERVAL}",
        "train.max_restarts=5",
        f"train.s3_endpoint_url={s3_endpoint}",
        f"train.rewards=[correct_answer, {__name__}:slow_reward]",
    )
    spec = JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri="s3://ckpt/preempt",
        adapter_dir=str(tmp_path / "adapter"),
        mlflow_tracking_uri=uri,
        mlflow_run_id=run_id,
    )
    store = S3Store(spec.checkpoint_uri, endpoint_url=s3_endpoint)
    launcher = LocalLauncher(max_restarts=5)
    handle = launcher.launch(spec)
    kills: list = []
    chaos = threading.Thread(target=_chaos, args=(handle, store, tmp_path / "work" / "trainer.log", kills))
    chaos.start()
    result = launcher.wait(handle)
    chaos.join()

    assert len(kills) == KILLS and result.restarts == KILLS
    assert result.global_step == MAX_STEPS
    logged_steps = len(re.findall(r"^\{'loss'", (tmp_path / "work" / "trainer.log").read_text(), re.M))
    recomputed = logged_steps - MAX_STEPS
    assert 0 < recomputed <= KILLS * INTERVAL, (kills, recomputed)

    history = client.get_metric_history(run_id, "reward")
    assert sorted(m.step for m in history) == list(range(1, MAX_STEPS + 1))  # each step exactly once
    assert client.get_run(run_id).info.status == "FINISHED"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), result.adapter_dir)
