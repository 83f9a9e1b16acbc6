"""The pipeline flow under Prefect (ephemeral server) through the CLI, as a CI job would call it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

pytestmark = pytest.mark.integration


def _cli(*args, cwd, prefect_home, extra_env=None, timeout=900):
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def tiny_yaml(tmp_path, tiny_model):
    cfg = {
        "data_dir": str(tmp_path / "data"),
        "data": {"demo": {"max_operand": 9, "n_train": 32, "n_val": 4, "n_holdout": 6}},
        "model": {"base": str(tiny_model)},
        "train": {
            "checkpoint_every": 1,
            "grpo": {
                "max_steps": 2,
                "num_generations": 4,
                "per_device_train_batch_size": 4,
                "max_completion_length": 6,
                "logging_steps": 1,
            },
            "lora": {"r": 4, "target_modules": "all-linear"},
        },
        "evaluate": {"max_new_tokens": 6, "batch_size": 4},
        # a random model answers nothing right: too_hard, which would refuse the run; these tests train anyway
        "check": {"prompts": 2, "on_too_hard": "warn"},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tiny_yaml_base(path: Path) -> str:
    return yaml.safe_load(path.read_text())["model"]["base"]


def test_run_json_summary_and_mlflow_lineage(tmp_path, tiny_yaml):
    proc = _cli("run", "--config", str(tiny_yaml), "--json", cwd=tmp_path, prefect_home=tmp_path / "prefect")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    holdout = summary["holdout"]
    assert holdout["n"] == 6
    assert {"base_reward", "trained_reward"} <= holdout.keys()
    assert summary["train"]["global_step"] == 2
    # the random base is never right: too_hard, and check.on_too_hard=warn trained anyway, saying so
    assert summary["task_check"]["verdict"] == "too_hard" and summary["task_check"]["prompts"] == 2
    assert "training anyway (check.on_too_hard=warn)" in proc.stdout + proc.stderr

    client = mlflow.MlflowClient(summary["mlflow"]["tracking_uri"])
    parent = summary["mlflow"]["run_id"]
    children = client.search_runs(
        [summary["mlflow"]["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{parent}'"
    )
    by_name = {r.info.run_name: r for r in children}
    assert set(by_name) == {
        "data",
        "model",
        "task-check",
        "plan",
        "evaluate-base",
        "train",
        "evaluate-candidate",
        "decide",
        "register",
        "serving-check",
    }
    experiment = client.get_experiment(summary["mlflow"]["experiment_id"])
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the model-training view
    parent_run = client.get_run(parent)
    assert re.fullmatch(r"grpo-pipeline \d{4}-\d{2}-\d{2} \d{2}:\d{2} \w{1,8}", parent_run.info.run_name)
    params = parent_run.data.params
    assert params["base_model"] == str(tiny_yaml_base(tiny_yaml)) and params["quantization"] == "none"
    assert params["lora.r"] == "4" and params["grpo.max_steps"] == "2" and "grpo.learning_rate" in params
    assert params["dataset_fingerprint"] == summary["data"]["fingerprint"]
    assert {"holdout/candidate_reward", "holdout/base_reward", "holdout/gain"} <= parent_run.data.metrics.keys()
    # where the run's time went, stage by stage in the order they ran, in the summary and as the parent's metrics
    timings = summary["timings"]
    stages = ["setup", "data", "rows", "drift", "model", "task-check", "plan", "evaluate-base", "train"]
    assert list(timings)[: len(stages)] == stages and all(seconds >= 0 for seconds in timings.values())
    assert timings["train"] > 0 and {"evaluate-candidate", "register", "promote"} <= timings.keys()
    assert parent_run.data.metrics["seconds/train"] == timings["train"]
    assert "time by stage: setup " in proc.stdout + proc.stderr
    assert {d.dataset.name for d in by_name["train"].inputs.dataset_inputs} == {"train", "val"}
    # progress: step x/N with the time left, in the flow's log
    assert re.search(r"step 2/2 \(100%\)", proc.stderr + proc.stdout), proc.stderr[-3000:]
    # evaluation progress names the model and ends at its total; no tqdm bar redraws in a log
    assert re.search(r"evaluating base: 6/6 \(100%\)", proc.stderr + proc.stdout), proc.stderr[-3000:]
    assert re.search(r"evaluating candidate: 6/6 \(100%\)", proc.stderr + proc.stdout), proc.stderr[-3000:]
    assert "%|" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert "View run" not in proc.stdout + proc.stderr
    # the version holds an MLflow model on a base anyone can load, and it served as evaluated
    registered = summary["registry"]
    assert registered["serving_check"]["passed"], registered["serving_check"]
    assert registered["base_model"].startswith("runs:/")
    version = client.get_model_version(registered["model"], registered["candidate_version"])
    assert version.source.startswith("models:/m-") and version.tags["base_model"] == registered["base_model"]
    assert version.tags["serving_check"] == "passed"
    assert client.search_logged_models(experiment_ids=[experiment.experiment_id])  # MLflow's "Logged models"
    assert by_name["plan"].data.params["plan_pricing"] == "local"  # a CPU run is priced as the local machine
    assert summary["cost"] == {"cost_usd_estimated": 0.0, "cost_usd_actual": 0.0}
    assert "decision.json" in [f.path for f in client.list_artifacts(by_name["decide"].info.run_id)]
    train = by_name["train"]
    assert train.data.params["max_steps"] == "2"
    assert "reward" in train.data.metrics
    assert [f.path for f in client.list_artifacts(train.info.run_id, "adapter")]
    assert client.get_run(parent).data.metrics["holdout/trained_reward"] == pytest.approx(holdout["trained_reward"])
    assert {"summary.json", "report.md", "comparison.png"} <= {f.path for f in client.list_artifacts(parent)}
    decision = summary["decision"]
    assert decision["reasons"] and decision["stats"]["metric"] == "correct_answer"  # the skill, not the total
    assert summary["registry"]["decided_against"] is None  # no champion yet: the base model is the baseline
    alias = "champion" if decision["promote"] else "challenger"
    assert summary["registry"]["aliases"][alias] == summary["registry"]["candidate_version"]


def _samples(client, run, name):
    """A stage run's per-prompt rows, as `evaluate_stage` logged them (`<name>_samples.json`, a table)."""
    table = json.loads(Path(client.download_artifacts(run.info.run_id, f"{name}_samples.json")).read_text())
    return [dict(zip(table["columns"], values, strict=True)) for values in table["data"]]


@pytest.mark.slow
def test_the_next_run_reads_the_base_scores_from_the_cache_and_decides_alike(tmp_path, tiny_yaml):
    """Two runs against the same baseline (nothing promoted: the base stays it): the second's base evaluation
    comes from the cache the first filled, row for row, and its decision is the one fresh base scores give."""
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.promote.decide import PromotionDecision, decide_promotion

    strict = ["--set", "promote.min_effect=10"]
    # a generous deadline: two whole runs, on a machine that may be shared
    home = {"cwd": tmp_path, "prefect_home": tmp_path / "prefect", "timeout": 2400}
    runs = [_cli("run", "--config", str(tiny_yaml), "--json", *strict, **home) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-4000:]
    first, second = (json.loads(proc.stdout) for proc in runs)
    assert (first["holdout"]["base_cached"], second["holdout"]["base_cached"]) == (False, True)
    log = runs[1].stdout + runs[1].stderr
    assert "base's holdout scores come from the cache" in log, log[-3000:]
    assert "evaluating base:" not in log and "evaluating candidate: 6/6" in log  # the base was not generated again
    assert first["holdout"]["base"] == second["holdout"]["base"]

    client = mlflow.MlflowClient(second["mlflow"]["tracking_uri"])
    stages = []
    for summary in (first, second):
        children = client.search_runs(
            [summary["mlflow"]["experiment_id"]],
            filter_string=f"tags.mlflow.parentRunId = '{summary['mlflow']['run_id']}'",
        )
        stages.append({r.info.run_name: r for r in children})
    tags = [s["evaluate-base"].data.tags for s in stages]
    assert [t["baseline.cached"] for t in tags] == ["false", "true"]
    assert tags[0]["baseline.cache_key"] == tags[1]["baseline.cache_key"]
    fresh_base = _samples(client, stages[0]["evaluate-base"], "base")
    assert _samples(client, stages[1]["evaluate-base"], "base") == fresh_base  # each prompt's scores, in order

    cfg = load_config(str(tiny_yaml), ["promote.min_effect=10"])
    candidate = _samples(client, stages[1]["evaluate-candidate"], "candidate")
    against_fresh = decide_promotion(candidate, fresh_base, cfg.promote, cfg.train.reward_set())
    decided = PromotionDecision.model_validate(second["decision"])
    assert decided.model_dump_json() == against_fresh.model_dump_json()


@pytest.mark.slow
def test_second_run_decides_against_the_champion_and_rollback_restores_it(tmp_path, tiny_yaml):
    # A permissive policy, so the tiny random model's candidates are promoted and the aliases move.
    lenient = [
        "--set",
        "promote.min_effect=-10",
        "--set",
        "promote.reward_tolerance=10",
        "--set",
        "promote.guardrails={}",
    ]
    home = {"cwd": tmp_path, "prefect_home": tmp_path / "prefect"}
    first = _cli("run", "--config", str(tiny_yaml), "--json", *lenient, **home)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _cli(
        "run",
        "--config",
        str(tiny_yaml),
        "--json",
        "--fail-on-reject",
        *lenient,
        "--set",
        "merge.enabled=true",
        "--set",
        "evaluate.samples_k=3",
        **home,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    v1 = json.loads(first.stdout)["registry"]["candidate_version"]
    summary = json.loads(second.stdout)
    assert summary["registry"]["decided_against"] == v1
    assert "champion_reward" in summary["holdout"]
    assert 0 <= summary["holdout"]["trained"]["pass_at_3"] <= 1
    assert summary["merge"]["max_logit_difference"] <= 1e-3
    v2 = summary["registry"]["candidate_version"]
    assert summary["registry"]["aliases"] == {"champion": v2, "challenger": None, "previous-champion": v1}
    merged = summary["registry"]["merged_version"]  # the merged model is registered, its alias moved with v2's
    assert merged and summary["registry"]["merged_aliases"]["champion"] == merged

    strict = _cli(
        "run", "--config", str(tiny_yaml), "--json", "--fail-on-reject", "--set", "promote.min_effect=10", **home
    )
    assert strict.returncode == 3, strict.stderr[-3000:]  # not promoted, and CI asked to fail on that
    assert json.loads(strict.stdout)["decision"]["promote"] is False

    rollback = _cli("rollback", "--config", str(tiny_yaml), "--reason", "regression seen in production", **home)
    assert rollback.returncode == 0, rollback.stderr[-2000:]
    assert f"grpo-adapter@champion: {v2} -> {v1}" in rollback.stdout  # every alias it moved
    assert "grpo-adapter-merged@champion" in rollback.stdout  # v1 has no merged model: its alias goes
    status = _cli("registry", "--config", str(tiny_yaml), **home)
    aliases = json.loads(status.stdout)
    assert aliases["champion"] == v1 and aliases["previous-champion"] == v2
    v3 = json.loads(strict.stdout)["registry"]["candidate_version"]
    assert aliases["challenger"] == v3  # offline: the rejected candidate is the challenger

    # promote.mode=canary: a candidate that passes the offline gate becomes the challenger (replacing v3, whose
    # test restarts on it) and the champion is left to the online decision (flows/ab.py)
    canary = _cli("run", "--config", str(tiny_yaml), "--json", *lenient, "--set", "promote.mode=canary", **home)
    assert canary.returncode == 0, canary.stderr[-3000:]
    summary = json.loads(canary.stdout)
    v4 = summary["registry"]["candidate_version"]
    assert summary["decision"]["promote"] and summary["registry"]["decided_against"] == v1
    assert summary["registry"]["aliases"] == {"champion": v1, "challenger": v4, "previous-champion": v2}
    client = mlflow.MlflowClient(summary["mlflow"]["tracking_uri"])
    assert client.get_model_version("grpo-adapter", v4).tags["promote_mode"] == "canary"
    assert client.get_model_version("grpo-adapter", v3).tags["ab_decision"] == "replaced"


@pytest.mark.slow
def test_search_before_training_feeds_the_best_parameters_to_training(tmp_path, tiny_yaml):
    proc = _cli(
        "run",
        "--config",
        str(tiny_yaml),
        "--json",
        "--set",
        "hpo.enabled=true",
        "--set",
        "hpo.trials=2",
        "--set",
        "hpo.steps=2",
        "--set",
        "hpo.eval_every=1",
        "--set",
        "hpo.pruner=none",
        # the tiny split has 4 val rows: too few for greedy scores at a known noise; the trainer's own
        # validation reward ranks the trials, and the best is applied without the configured control
        "--set",
        "hpo.trial_score=trainer",
        "--set",
        "hpo.keep_configured=false",
        "--set",
        "hpo.budget_fraction=2",
        cwd=tmp_path,
        prefect_home=tmp_path / "prefect",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    best = summary["hpo"]["overrides"]
    assert best and len(summary["hpo"]["study"]) > 0
    client = mlflow.MlflowClient(summary["mlflow"]["tracking_uri"])
    children = client.search_runs(
        [summary["mlflow"]["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{summary['mlflow']['run_id']}'"
    )
    by_name = {r.info.run_name: r for r in children}
    trials = client.search_runs(
        [summary["mlflow"]["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{by_name['hpo'].info.run_id}'"
    )
    assert len(trials) == 2
    spec = json.loads((Path(summary["run_dir"]) / "train" / "job.json").read_text())
    for path, value in best.items():  # the training job ran with the search's best values
        _, stage, key = path.split(".")
        assert spec["train"][stage][key] == value, (path, spec["train"][stage])


def _in_process(*args):
    """The CLI in this process (typer's runner): a refusal before the flow starts needs no Python start-up of
    its own to show its exit code and output; the over-budget test below runs the real process."""
    from typer.testing import CliRunner

    from grpo_pipeline.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.grpo.lerning_rate=1", "did you mean 'learning_rate'"),
        ("model.base=/no/such/model", "/no/such/model does not exist"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, tiny_yaml, override, message):
    result = _in_process("run", "--config", str(tiny_yaml), "--set", override)
    assert result.exit_code == 2
    assert message in result.stderr
    assert not (tmp_path / "data").exists()


def test_unreachable_s3_store_fails_before_any_work(tmp_path, tiny_yaml):
    result = _in_process(
        "run",
        "--config",
        str(tiny_yaml),
        "--json",
        "--set",
        "train.checkpoint_uri=s3://ckpt/run",
        "--set",
        "train.s3_endpoint_url=http://127.0.0.1:9",
    )
    assert result.exit_code == 2, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1])["status"] == "failed"
    assert "cannot write to s3://ckpt/run at http://127.0.0.1:9" in result.stderr
    assert not (tmp_path / "data" / "runs").exists()


def test_a_run_over_budget_is_refused_before_any_work(tmp_path, tiny_yaml):
    proc = _cli(
        "run",
        "--config",
        str(tiny_yaml),
        "--set",
        "train.launcher=sky",
        "--set",
        "plan.budget_usd=0.1",
        "--set",
        "train.grpo.max_steps=200000",
        cwd=tmp_path,
        prefect_home=tmp_path / "p",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "exceeds plan.budget_usd = $0.10" in proc.stderr
    assert not (tmp_path / "data" / "runs").exists()


@pytest.mark.slow
def test_sky_launcher_without_a_cloud_stops_at_preflight(tmp_path, tiny_yaml, s3_endpoint):
    from grpo_pipeline.infra.launch.skypilot import sky_python

    home = tmp_path / "home"  # SkyPilot keeps its state and API server under ~/.sky: keep them out of $HOME
    env = {"HOME": str(home)}
    try:
        proc = _cli(
            "run",
            "--config",
            str(tiny_yaml),
            "--set",
            "train.launcher=sky",
            "--set",
            "train.checkpoint_uri=s3://ckpt/sky",
            "--set",
            f"train.s3_endpoint_url={s3_endpoint}",
            "--set",
            "tracking.mlflow_tracking_uri=http://127.0.0.1:9",
            cwd=tmp_path,
            prefect_home=tmp_path / "p",
            extra_env=env,
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "SkyPilot has no cloud enabled: run `sky check`" in proc.stderr
        assert not (tmp_path / "data" / "runs").exists()
    finally:
        subprocess.run(
            [str(sky_python().parent / "sky"), "api", "stop"],  # SkyPilot's own environment (.venv-sky)
            env={**os.environ, **env},
            capture_output=True,
            timeout=120,
        )


RETRY_SCRIPT = """
import json, sys
import grpo_pipeline.flows.pipeline as pipeline
import grpo_pipeline.flows.stages.promote as promote
from grpo_pipeline.infra.launch.local import LocalLauncher
from prefect import get_client
from prefect.runtime import flow_run

launches, decisions = [], []
launch = LocalLauncher.launch
LocalLauncher.launch = lambda self, spec: launches.append(spec) or launch(self, spec)
decide = promote.decide_promotion

def fail_once_after_training(*args, **kwargs):
    decisions.append(1)
    if len(decisions) == 1:
        raise RuntimeError("injected failure after training")
    return decide(*args, **kwargs)

promote.decide_promotion = fail_once_after_training
state = pipeline.grpo_pipeline.with_options(retries=1, retry_delay_seconds=0)(
    config_path=sys.argv[1], return_state=True)
with get_client(sync_client=True) as client:
    runs = client.read_task_runs()
    states = {}
    for run in runs:
        states.setdefault(run.name.rsplit("-", 1)[0], []).append(run.state.name)
print(json.dumps({"summary": state.result().model_dump(mode="json"), "launches": len(launches), "decisions": len(decisions),
                  "task_states": states}))
"""


@pytest.mark.slow
def test_a_retried_flow_run_resumes_after_training(tmp_path, tiny_yaml):
    """A failure after training, then the flow run's retry: nothing before the failure runs again."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", RETRY_SCRIPT, str(tiny_yaml)],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["decisions"] == 2  # the injected failure happened, and the retry got past it
    assert out["launches"] == 1  # the trainer was not launched again
    assert out["summary"]["status"] == "completed"
    assert "Cached" in out["task_states"]["train"] and "Cached" in out["task_states"]["evaluate"]

    client = mlflow.MlflowClient(out["summary"]["mlflow"]["tracking_uri"])
    experiment = out["summary"]["mlflow"]["experiment_id"]
    parents = client.search_runs([experiment], filter_string="tags.pipeline = 'grpo-pipeline'")
    assert len(parents) == 1  # the retry continued the same MLflow run
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    names = sorted(r.info.run_name for r in children)
    assert names == sorted(set(names)), names  # one run per stage, however many attempts
    versions = client.search_model_versions(f"name = '{out['summary']['registry']['model']}'")
    assert len(versions) == 1
