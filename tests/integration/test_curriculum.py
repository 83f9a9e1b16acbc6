"""The curriculum on real training (tiny random Llama): prompts whose groups always score the same are drawn
less than TRL's sampler draws them, so fewer steps have no signal; the real trainer's zero-variance verdicts
are the ones the pure selection logic predicts, and the state travels in each checkpoint."""

import json

import mlflow
import pytest

from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.sampling import STATE_FILE, Curriculum
from grpo_pipeline.trainer.spec import JobSpec

pytestmark = pytest.mark.integration
REWARD = "tests.integration.curriculum_rewards:same_for_some"
KINDS = ["same", "varied", "same", "varied"]
STEPS = 12  # one prompt per step: three passes over the four prompts


def _train_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1), "kind": kind}
            )
            + "\n"
            for i, kind in enumerate(KINDS)
        )
    )
    return path


def _run(tmp_path, tiny_model, cfg, name, **extra):
    from grpo_pipeline.trainer.train import run

    work = tmp_path / name
    return run(
        JobSpec(
            model_path=str(tiny_model),
            model=model_load(cfg.model),
            train=train_settings(cfg.train),
            train_file=str(_train_file(tmp_path)),
            work_dir=str(work / "work"),
            checkpoint_uri=str(work / "ckpt"),
            adapter_dir=str(work / "adapter"),
            **extra,
        )
    )


@pytest.mark.slow  # two trainings side by side: make test-slow (the default run's 12-minute budget)
def test_prompts_that_always_score_the_same_are_drawn_less_and_fewer_steps_are_wasted(
    tmp_path, tiny_model, tiny_config
):
    sets = [f"train.grpo.max_steps={STEPS}", "train.checkpoint_every=6", f"train.rewards=[{REWARD}]"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    on = _run(tmp_path, tiny_model, tiny_config(*sets), "on", mlflow_tracking_uri=uri)
    off = _run(tmp_path, tiny_model, tiny_config(*sets, "train.curriculum.enabled=false"), "off")

    # TRL's sampler: every pass holds both "same" prompts, so half of the steps teach nothing
    assert (off.zero_signal.wasted_steps, off.zero_signal.logged_steps) == (STEPS // 2, STEPS)
    assert off.zero_signal.skipped_draws is None
    assert on.zero_signal.wasted_steps < off.zero_signal.wasted_steps and on.zero_signal.skipped_draws > 0
    # exactly what the pure selection logic draws, fed the verdicts the real rewards give; the data loader
    # draws one batch ahead of the step it yields, so a verdict reaches the draw after next
    expected = Curriculum(
        n=len(KINDS), batch_size=1, seed=42, settings=train_settings(tiny_config(*sets).train).curriculum
    )
    wasted = steps = 0
    for epoch in range(STEPS):
        if steps == STEPS:  # HF stops at max_steps: no later epoch is begun
            break
        chunks = expected.epoch_chunks(epoch)
        current = next(chunks, None)
        while current is not None and steps < STEPS:
            upcoming = next(chunks, None)
            (index,) = current
            wasted += KINDS[index] == "same"
            expected.observe([(index, KINDS[index] == "same")])
            steps += 1
            current = upcoming
    assert on.zero_signal.wasted_steps == wasted < off.zero_signal.wasted_steps
    assert on.zero_signal.mean_fraction == pytest.approx(wasted / STEPS)
    assert on.zero_signal.skipped_draws == expected.skipped_total > 0
    # the state a resume restores, and the per-step figures in MLflow
    state = json.loads((tmp_path / "on" / "ckpt" / "checkpoint-12" / STATE_FILE).read_text())
    assert {int(i): v for i, v in state["streak"].items()} == expected.streak  # the "same" prompts, benched again
    assert set(expected.streak) == {i for i, k in enumerate(KINDS) if k == "same"}  # after the cap brought them back
    client = mlflow.MlflowClient(uri)
    zero = client.get_metric_history(on.mlflow_run_id, "frac_reward_zero_std")
    assert sum(m.value for m in zero) == wasted
    assert client.get_metric_history(on.mlflow_run_id, "curriculum/skipped_draws")
