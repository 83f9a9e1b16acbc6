"""Each metric reaches MLflow once per step: HF's closing summary log repeats the last step's number and its
`epoch`, and that step's own entry was committed with the last checkpoint."""

from __future__ import annotations

from mlflow import MlflowClient

from grpo_pipeline.trainer.tracking import STEP_KEY, CommittedMetrics


def test_the_final_step_is_logged_once(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("once")).info.run_id
    metrics = CommittedMetrics(uri, run_id)
    metrics.commit([(1, {"loss": 0.5, "epoch": 0.5}), (2, {"loss": 0.4, "epoch": 1.0})])  # with checkpoint 2
    metrics.commit([(2, {"train_runtime": 9.0, "train_loss": 0.45, "epoch": 1.0})])  # the closing summary
    history = {
        name: [m.step for m in client.get_metric_history(run_id, name)]
        for name in ("loss", "epoch", STEP_KEY, "train_runtime")
    }
    assert history == {"loss": [1, 2], "epoch": [1, 2], STEP_KEY: [1, 2], "train_runtime": [2]}
    resumed = CommittedMetrics(uri, run_id)  # a relaunch: steps MLflow holds are skipped
    resumed.commit([(2, {"loss": 0.41}), (3, {"loss": 0.3})])
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
