"""bf16 mixed precision through the real trainer on the tiny model: it trains, and says in what precision."""

import mlflow
import pytest

from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.spec import JobSpec

pytestmark = pytest.mark.integration


def test_bf16_trains_and_is_in_the_result_and_the_run(tmp_path, tiny_model, tiny_splits, tiny_config):
    from grpo_pipeline.trainer.train import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config("train.grpo.max_steps=2", "train.checkpoint_every=2", "train.grpo.bf16=true")
    spec = JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
        mlflow_tracking_uri=uri,
    )
    result = run(spec)  # run() itself, past main()'s refusal of slow bf16: the code path, not the speed

    assert result.global_step == 2 and result.precision == "bf16"
    assert mlflow.MlflowClient(uri).get_run(result.mlflow_run_id).data.params["precision"] == "bf16"
