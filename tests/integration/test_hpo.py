"""The hyperparameter search through the CLI and Prefect on a tiny random model: four trials of two steps,
two at a time; one completes best, one is pruned, one crashes, one completes."""

import json
import os
import subprocess
import sys

import mlflow
import optuna
import pytest
import yaml

from configs.schema import load_config
from tasks.hpo import apply_best, open_storage, open_study, search
from tasks.job import build_job_spec
from tests.unit.test_hpo import _quick

pytestmark = pytest.mark.integration

ENQUEUED = [  # trial number -> parameters, and what must become of it
    {"lora_r": 8, "lora_alpha_ratio": 2, "learning_rate": 2e-3},  # reward 2.0: complete, the best
    {"lora_r": 4, "lora_alpha_ratio": 1, "learning_rate": 1e-4},  # reward 0.1 < prune_below: pruned at step 1
    {"lora_r": 4, "lora_alpha_ratio": 1, "learning_rate": -1.0},  # AdamW refuses it: the trainer exits 1
    {"lora_r": 4, "lora_alpha_ratio": 2, "learning_rate": 1e-3},  # reward 1.0: complete
]


@pytest.fixture
def hpo_yaml(tmp_path, tiny_model):
    cfg = {
        "data_dir": str(tmp_path / "data"),
        "data": {"demo": {"max_operand": 9, "n_train": 32, "n_val": 4, "n_holdout": 4}},
        "model": {"base": str(tiny_model)},
        "train": {
            "rewards": ["tests.integration.lr_reward:learning_rate_reward"],
            "grpo": {"num_generations": 4, "per_device_train_batch_size": 4, "max_completion_length": 6,
                     "logging_steps": 1, "lr_scheduler_type": "constant"},
            "lora": {"r": 4, "target_modules": "all-linear"},
        },
        "hpo": {
            "trials": 4, "concurrency": 2, "steps": 2, "eval_every": 1, "eval_generations": 2,
            "pruner": "threshold", "prune_below": 0.5, "study_name": "test-study",
            "space": {"lora_r": {"choices": [4, 8]}, "lora_alpha_ratio": {"choices": [1, 2]},
                      "learning_rate": {"low": 1e-5, "high": 1e-2}},
        },
    }
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_search_prunes_fails_one_trial_only_and_feeds_the_best_to_training(tmp_path, hpo_yaml, tiny_splits, busy_machine):
    """Run with both cores held busy by other processes: trials are slow, and none may be taken twice or
    marked stale while it runs."""
    cfg = load_config(hpo_yaml)
    study = open_study(cfg)  # the study the CLI will load: its first trials are fixed here
    for params in ENQUEUED:
        study.enqueue_trial(params)

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.run([sys.executable, "-m", "grpo_pipeline.cli", "hpo", "--config", str(hpo_yaml), "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["best_trial"] == 0 and result["best_value"] == pytest.approx(2.0)

    # The study is stored: reloaded from its database, each trial has the state its run earned.
    stored = optuna.load_study(study_name="test-study", storage=open_storage(cfg))
    states = {t.number: t.state for t in stored.trials}
    assert states == {0: optuna.trial.TrialState.COMPLETE, 1: optuna.trial.TrialState.PRUNED,
                      2: optuna.trial.TrialState.FAIL, 3: optuna.trial.TrialState.COMPLETE}
    assert stored.trials[1].intermediate_values == {1: pytest.approx(0.1)}
    assert "Invalid learning rate" in stored.trials[2].user_attrs["reason"]
    assert stored.trials[3].value == pytest.approx(1.0)

    # Each trial is an MLflow run nested under the search's run, with its parameters and validation rewards.
    client = mlflow.MlflowClient(result["mlflow_tracking_uri"])
    stage = client.get_run(result["mlflow_run_id"])
    trials = {r.info.run_name: r for r in client.search_runs(
        [stage.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{stage.info.run_id}'")}
    assert {name: r.info.status for name, r in trials.items()} == {
        "trial-0": "FINISHED", "trial-1": "KILLED", "trial-2": "FAILED", "trial-3": "FINISHED"}
    assert trials["trial-0"].data.params["train.grpo.learning_rate"] == "0.002"
    assert [m.step for m in client.get_metric_history(trials["trial-0"].info.run_id, "val_reward")] == [1, 2]
    assert trials["trial-1"].data.tags["optuna.state"] == "PRUNED"
    artifacts = {f.path for f in client.list_artifacts(stage.info.run_id)}
    assert {"trials.json", "best_params.json", "optimization_history.png", "intermediate_values.png"} <= artifacts

    # The best parameters reach the training job's spec.
    best = apply_best(cfg, result["overrides"])
    spec = build_job_spec(best.train, best.model, str(cfg.model.base), tiny_splits, tmp_path / "run")
    assert (spec.train.lora["r"], spec.train.lora["lora_alpha"], spec.train.grpo["learning_rate"]) == (8, 16, 2e-3)


def test_the_study_lives_in_postgresql_when_configured(tmp_path):
    from infra.services import postgres

    with postgres(tmp_path / "pg", "optuna") as url:
        c = load_config(None, [f"data_dir={tmp_path}", f"hpo.storage={url}", "hpo.study_name=pg", "hpo.trials=2"])
        result = search(c, "m", {}, tmp_path, run_one=_quick([0.4, 0.7]))  # no training: the storage is what is tested
        assert result.storage.startswith("postgresql") and result.best_value == 0.7
        assert len(optuna.load_study(study_name="pg", storage=url).trials) == 2
        assert not (tmp_path / "optuna.db").exists()
