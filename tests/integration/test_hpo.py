"""The hyperparameter search through the CLI and Prefect on a tiny random model: the configured values' control
and four trials of two steps, two at a time; one completes best, one is pruned, one crashes, one completes.
Then the CLI's bad inputs (a target standard error the data cannot meet: exit 2; every trial failing: exit 1),
and a retried flow run resuming the study inside the same `hpo` MLflow run."""

import json
import os
import subprocess
import sys

import mlflow
import optuna
import pytest
import yaml

from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.tasks.hpo import apply_best
from grpo_pipeline.tasks.job import build_job_spec
from tests.unit.test_hpo import _quick, run_search, storage_of, study_of

pytestmark = pytest.mark.integration

# Trial 0 is the configured values (TRL's default learning rate, 1e-6: reward 0.001), never pruned: the control.
ENQUEUED = [  # trial number - 1 -> parameters, and what must become of it
    {"lora_r": 8, "lora_alpha_ratio": 2, "learning_rate": 2e-3},  # reward 2.0: complete, the best
    {"lora_r": 4, "lora_alpha_ratio": 1, "learning_rate": 1e-4},  # reward 0.1 < prune_below: pruned at step 1
    {"lora_r": 4, "lora_alpha_ratio": 1, "learning_rate": -1.0},  # the config refuses it: this trial fails
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
            "grpo": {
                "num_generations": 4,
                "per_device_train_batch_size": 4,
                "max_completion_length": 6,
                "logging_steps": 1,
                "lr_scheduler_type": "constant",
            },
            "lora": {"r": 4, "target_modules": "all-linear"},
        },
        "hpo": {
            "trials": 5,
            "start_trials": 0,  # the trials enqueued below, not a space-filling start, run first
            "concurrency": 2,
            "steps": 2,
            "eval_every": 1,
            "eval_generations": 2,
            "pruner": "threshold",
            "prune_below": 0.5,
            "study_name": "test-study",
            # the test reward is a function of the learning rate the trainer reports, which greedy scoring
            # after training cannot see: the trials are ranked on what the trainer reports
            "trial_score": "trainer",
            "space": {
                "lora_r": {"choices": [4, 8]},
                "lora_alpha_ratio": {"choices": [1, 2]},
                "learning_rate": {"low": 1e-5, "high": 1e-2},
            },
        },
    }
    path = tmp_path / "hpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_search_prunes_fails_one_trial_only_and_feeds_the_best_to_training(
    tmp_path, hpo_yaml, tiny_splits, busy_machine
):
    """Run with both cores held busy by other processes: trials are slow, and none may be taken twice or
    marked stale while it runs."""
    cfg = load_config(hpo_yaml)
    study = study_of(cfg)  # the study the CLI will load: its first trials are fixed here
    for params in ENQUEUED:
        study.enqueue_trial(params)

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "hpo", "--config", str(hpo_yaml), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["best_trial"] == 1 and result["best_value"] == pytest.approx(2.0)
    assert result["applied"] and result["configured_trial"] == 0 and "applied" in result["decision"]

    # The study is stored: reloaded from its database, each trial has the state its run earned.
    stored = optuna.load_study(study_name="test-study", storage=storage_of(cfg))
    states = {t.number: t.state for t in stored.trials}
    T = optuna.trial.TrialState
    assert states == {0: T.COMPLETE, 1: T.COMPLETE, 2: T.PRUNED, 3: T.FAIL, 4: T.COMPLETE}
    assert stored.trials[0].value == pytest.approx(0.001) and stored.trials[0].params == {}  # below prune_below
    assert stored.trials[2].intermediate_values == {1: pytest.approx(0.1)}
    assert "greater than 0 (got -1.0)" in stored.trials[3].user_attrs["reason"]
    assert stored.trials[4].value == pytest.approx(1.0)
    assert result["steps_spent"] == 2 + 2 + 1 + 0 + 2  # the crashed trial reported no step

    # Each trial is an MLflow run nested under the search's run, with its parameters and validation rewards.
    client = mlflow.MlflowClient(result["mlflow_tracking_uri"])
    stage = client.get_run(result["mlflow_run_id"])
    trials = {
        r.info.run_name: r
        for r in client.search_runs(
            [stage.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{stage.info.run_id}'"
        )
    }
    assert {name: r.info.status for name, r in trials.items()} == {
        "trial-0": "FINISHED",
        "trial-1": "FINISHED",
        "trial-2": "KILLED",
        "trial-4": "FINISHED",
    }  # trial 3 was refused before any run started: its reason is on the Optuna trial (above)
    assert trials["trial-0"].data.tags["optuna.configured"] == "true"
    assert trials["trial-1"].data.params["train.grpo.learning_rate"] == "0.002"
    assert [m.step for m in client.get_metric_history(trials["trial-1"].info.run_id, "val_reward")] == [1, 2]
    assert trials["trial-2"].data.tags["optuna.state"] == "PRUNED"
    assert stage.data.tags["hpo.applied"] == "true"
    artifacts = {f.path for f in client.list_artifacts(stage.info.run_id)}
    assert {"trials.json", "best_params.json", "optimization_history.png", "intermediate_values.png"} <= artifacts

    # The best parameters reach the training job's spec.
    best = apply_best(cfg, result["overrides"])
    spec = build_job_spec(best.train, best.model, str(cfg.model.base), tiny_splits, tmp_path / "run")
    assert (spec.train.lora["r"], spec.train.lora["lora_alpha"], spec.train.grpo["learning_rate"]) == (8, 16, 2e-3)


def test_the_study_lives_in_postgresql_when_configured(tmp_path):
    from grpo_pipeline.infra.services import postgres

    with postgres(tmp_path / "pg", "optuna") as url:
        from tests.unit.test_hpo import PLAIN

        c = load_config(
            None, [f"data_dir={tmp_path}", f"hpo.storage={url}", "hpo.study_name=pg", "hpo.trials=2", *PLAIN]
        )
        # no training: the storage is what is tested
        result = run_search(c, "m", {}, tmp_path, rewards=c.train.reward_set(), run_one=_quick([0.4, 0.7]))
        assert result.storage.startswith("postgresql") and result.best_value == 0.7
        assert len(optuna.load_study(study_name="pg", storage=url).trials) == 2
        assert not (tmp_path / "optuna.db").exists()


def _cli_hpo(tmp_path, hpo_yaml, *sets):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "hpo", "--config", str(hpo_yaml), "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # a search's flow to its refusal: make test-slow (the default run's 12-minute budget)
def test_a_target_standard_error_the_data_cannot_meet_exits_2_naming_the_prompts_needed(tmp_path, hpo_yaml):
    proc = _cli_hpo(tmp_path, hpo_yaml, "hpo.trial_score=greedy", "hpo.target_standard_error=0.1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = json.loads(proc.stdout)["error"]
    # one reward (the test's), so a per-prompt SD of at most 0.5: (0.5 / 0.1)^2 = 25 prompts, twice over
    assert "needs 25 validation prompts per scoring" in error and "50 in all" in error and "has 4" in error
    assert not (tmp_path / "data" / "runs").exists() or not list((tmp_path / "data" / "runs").rglob("trainer.log"))


@pytest.mark.slow
def test_a_space_whose_every_point_fails_exits_1_with_each_trials_reason(tmp_path, hpo_yaml):
    """Every learning rate fails (the test reward runs out of memory once a step has trained), the configured
    one too."""
    proc = _cli_hpo(
        tmp_path,
        hpo_yaml,
        "train.rewards=[tests.integration.oom_reward:oom_reward]",
        "hpo.trials=2",
        "hpo.concurrency=1",
        "hpo.study_name=all-fail",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = json.loads(proc.stdout)["error"]
    assert "no trial completed" in error and "not used silently" in error
    lines = [line for line in error.splitlines() if line.strip().startswith("trial ")]
    assert len(lines) == 2 and all("FAIL" in line and "out of memory" in line for line in lines), error


def test_a_retried_flow_run_resumes_the_study_inside_the_same_hpo_run(tmp_path):
    """The pipeline opens the stage with `grpo_pipeline.flows.runs.stage_run`; a retry of the flow run reopens it, and the
    study runs only what is left of its budget."""
    from grpo_pipeline.flows.runs import parent_run, setup_tracking, stage_run
    from grpo_pipeline.tasks.hpo import Tracking
    from tests.unit.test_hpo import PLAIN, _dies_after

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(
        None,
        [
            f"data_dir={tmp_path}",
            *PLAIN,
            "hpo.trials=3",
            "hpo.study_name=retried",
            f"tracking.mlflow_tracking_uri={uri}",
        ],
    )
    experiment = setup_tracking(uri, "retry", tmp_path / "artifacts")
    stage_ids = []
    for attempt, run_one in enumerate((_dies_after(1), _quick([0.9]))):
        try:
            with parent_run("flow-run-1", "grpo-pipeline") as parent, stage_run(parent.info.run_id, "hpo") as stage:
                stage_ids.append(stage.info.run_id)
                tracking = Tracking(tracking_uri=uri, experiment_id=experiment, stage_run_id=stage.info.run_id)
                result = run_search(
                    cfg, "m", {}, tmp_path, rewards=cfg.train.reward_set(), run_one=run_one, tracking=tracking
                )
        except KeyboardInterrupt:  # the first attempt dies inside its second trial
            assert attempt == 0
    assert stage_ids[0] == stage_ids[1] and result.mlflow_run_id == stage_ids[0]
    runs = mlflow.MlflowClient(uri).search_runs([experiment], filter_string="attributes.run_name = 'hpo'")
    assert len(runs) == 1
    assert [t.state for t in result.trials] == ["COMPLETE", "FAIL", "COMPLETE"] and result.best_trial == 2
