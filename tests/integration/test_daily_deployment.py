"""Daily retraining as a team runs it: `grpo-pipeline deploy` with no --config (the `daily-retrain` deployment runs
its own recipe, configs/daily-cpu.yaml), a process worker, the local stack (PostgreSQL, S3, MLflow and Prefect
servers), and a source folder that grows by one dated JSONL file a day. Four runs of the deployment:

- day 1, no champion yet: a cold run from the base (said in the summary and the flow run's log), promoted;
- day 2, a new file: continues day 1's version on the new rows plus a replayed share, promoted; its version names
  day 1's as its parent;
- day 3, no new file: skipped, with the reason, nothing registered;
- day 4, a file half of whose lines are broken: the run fails naming the file (data.max_malformed_per_file), though
  the whole folder's dropped share stays under data.max_dropped_fraction; nothing registered, day 2's champion kept.

The tiny random Llama and a lenient gate, as tests/integration/test_daily_flow.py: what is checked is the schedule's
mechanics (what each day starts from, trains on, records and decides), not what the model learns. The table the
test prints (`pytest -s`) is the one docs/operations.md shows.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from grpo_pipeline.tasks.data.demo_task import make_row
from grpo_pipeline.tasks.data.splits import split_of
from tests.conftest import TINY_TRAIN
from tests.integration.test_ops import _flow_run_logs, prefect_api

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "daily-adapter"
PAIRS = [(a, b) for a in range(10) for b in range(10)]
DAYS = {"2026-12-05": PAIRS[:40], "2026-12-06": PAIRS[40:64]}
BROKEN_DAY = "2026-12-08"  # 10 good rows, 10 broken lines
REWARD = "tests.integration.daily_rewards:completion_length"  # gives the random model's groups a gradient


def _write_day(folder: Path, day: str, pairs, broken: int = 0) -> None:
    lines = [json.dumps(make_row(a, b)) for a, b in pairs] + ['{"prompt": "cut off mid-line'] * broken
    (folder / f"{day}.jsonl").write_text("".join(line + "\n" for line in lines))


@pytest.fixture(scope="module")
def world(local_stack, mlflow_server_uri, tiny_model, tmp_path_factory):
    """The stack, `grpo-pipeline deploy` as a user runs it (the tiny model and this test's folder pinned with --set),
    and a worker in the checkout (where a process worker runs the flows: the pull step)."""
    local_stack.up()
    work = tmp_path_factory.mktemp("daily-deploy")
    source = work / "daily"
    source.mkdir()
    env = {
        **os.environ,
        **local_stack.env(),
        "PREFECT_HOME": str(work / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # the test reward's module, for the flow run and the trainer it starts
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    pins = [
        f"data_dir={work / 'data'}",
        f"data.source={source}",
        "data.key_column=key",
        f"model.base={tiny_model}",
        *TINY_TRAIN,
        "train.grpo.max_steps=4",
        f"train.rewards=[{REWARD}]",
        "train.dynamic_sampling.enabled=false",  # the random model's skill is 0 in every group
        "check.enabled=false",  # the same: a random model's task is too_hard
        "evaluate.max_new_tokens=6",
        "evaluate.batch_size=4",
        "tracking.experiment=daily-deploy",
        f"tracking.registered_model={MODEL}",
        "promote.min_samples=1",
        "promote.min_effect=-10",
        "promote.reward_tolerance=10",
        "promote.guardrails={}",
    ]
    deployed = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "deploy", *sum((["--set", p] for p in pins), [])],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert deployed.returncode == 0, deployed.stderr[-4000:]
    summary = json.loads(deployed.stdout)["deployments"]
    assert summary["daily-retrain"]["parameters"]["config_path"] == "configs/daily-cpu.yaml"  # its own recipe
    assert summary["manual"]["parameters"]["config_path"] == "configs/demo-cpu.yaml"
    log = work / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "grpo-process"],
            env={**env, "PREFECT_WORKER_QUERY_SECONDS": "2"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    yield {"env": env, "source": source, "log": log, "stack": local_stack}
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def _day(world) -> tuple:
    """One run of daily-retrain, as its schedule starts it (no parameters), on the worker -> (flow run, its summary
    from the MLflow parent run, or None when it failed before writing one)."""
    from prefect.deployments import run_deployment

    with prefect_api(world["env"]):
        flow_run = run_deployment("grpo-pipeline/daily-retrain", timeout=1800, poll_interval=3)
    client = mlflow.MlflowClient(world["env"]["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("daily-deploy")
    runs = (
        client.search_runs([experiment.experiment_id], f"tags.prefect_flow_run_id = '{flow_run.id}'")
        if experiment
        else []
    )
    summary = None
    if runs and any(f.path == "summary.json" for f in client.list_artifacts(runs[0].info.run_id)):
        local = mlflow.artifacts.download_artifacts(
            run_id=runs[0].info.run_id, artifact_path="summary.json", tracking_uri=world["env"]["MLFLOW_TRACKING_URI"]
        )
        summary = json.loads(Path(local).read_text())
    return flow_run, summary


def _row(day: str, flow_run, s: dict | None, champion: str = "") -> str:
    """One line of docs/operations.md's table."""
    minutes = f"{flow_run.total_run_time.total_seconds() / 60:.1f}"
    if s is None:
        return f"| {day} | - | - | {minutes} | - | failed: {flow_run.state.message[:120]} |"
    rows = s["data"]["rows_read"]
    if s["status"] == "skipped":
        return f"| {day} | {rows} read, none new | v{champion} (champion) | {minutes} | - | skipped: nothing new |"
    r = s["rows"]
    parent = f"v{s['warm_start']['version']}" if s["warm_start"] else "none (cold start)"
    accuracy = s["holdout"]["trained"].get("accuracy")
    accuracy = "-" if accuracy is None else f"{accuracy:.3f}"
    decided = "promoted" if s["decision"]["promote"] else "not promoted"
    return (
        f"| {day} | {r['new']} new + {r['replayed']} replayed | {parent} | {minutes} | "
        f"{accuracy} | {decided} v{s['registry']['candidate_version']} |"
    )


def test_three_days_of_the_daily_deployment_then_a_broken_day(world):
    table: list[str] = []
    try:
        _days(world, table)
    finally:  # the days that ran, as docs/operations.md shows them (`pytest -s`)
        print("\n| day | data rows | parent version | minutes | accuracy | decision |\n|---|---|---|---|---|---|")
        print("\n".join(table))


def _days(world, table: list[str]) -> None:
    env, source, log = world["env"], world["source"], world["log"]
    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    split = {f"{a}+{b}": split_of(f"{a}+{b}", 0.3, 0.1) for a, b in PAIRS}

    # day 1: the first file; no champion yet, so a cold run, which says so
    _write_day(source, "2026-12-05", DAYS["2026-12-05"])
    run1, one = _day(world)
    assert run1.state.is_completed(), f"{run1.state}\n{log.read_text()[-4000:]}"
    table.append(_row("2026-12-05", run1, one))
    v1 = one["registry"]["candidate_version"]
    assert one["warm_start"] is None and "no champion in registered model 'daily-adapter' yet" in one["cold_start"]
    assert "warm start: no champion" in _flow_run_logs(env, run1.id)  # the run's log says it too
    assert one["registry"]["aliases"]["champion"] == v1
    assert one["rows"]["new"] == sum(split[f"{a}+{b}"] == "train" for a, b in DAYS["2026-12-05"])
    assert one["rows"]["replayed"] == 0
    assert "parent_version" not in client.get_model_version(MODEL, v1).tags

    # day 2: a new file; continues day 1's version on its new rows plus a replayed share of day 1's
    _write_day(source, "2026-12-06", DAYS["2026-12-06"])
    run2, two = _day(world)
    assert run2.state.is_completed(), f"{run2.state}\n{log.read_text()[-4000:]}"
    table.append(_row("2026-12-06", run2, two))
    v2 = two["registry"]["candidate_version"]
    assert two["cold_start"] is None and two["warm_start"]["version"] == v1
    assert f"warm start: continuing v{v1}" in _flow_run_logs(env, run2.id)
    seen = sum(split[f"{a}+{b}"] == "train" for a, b in DAYS["2026-12-05"])
    rows = two["rows"]
    assert rows["incremental"] and rows["seen_before"] == seen
    assert rows["new"] == sum(split[f"{a}+{b}"] == "train" for a, b in DAYS["2026-12-06"])
    assert 0 < rows["replayed"] < seen  # data.replay_fraction (0.25) of day 1's train rows
    assert two["registry"]["decided_against"] == v1 and two["registry"]["aliases"]["champion"] == v2
    tags = client.get_model_version(MODEL, v2).tags
    assert tags["parent_version"] == v1 and tags["init_adapter"] == f"models:/{MODEL}/{v1}"

    # day 3: no new file; skipped with the reason, nothing trained or registered
    run3, three = _day(world)
    assert run3.state.is_completed(), f"{run3.state}\n{log.read_text()[-4000:]}"
    table.append(_row("2026-12-07", run3, three, champion=v2))
    assert three["status"] == "skipped" and three["train"] is None and three["registry"] is None
    assert f"champion v{v2}" in three["skipped_reason"] and "no new rows" in three["skipped_reason"]
    assert f"skipped: champion v{v2}" in _flow_run_logs(env, run3.id)

    # day 4: half the new file's lines are broken. The whole folder's dropped share (10 of 84) stays under
    # data.max_dropped_fraction (0.2), which alone would have trained on the rest; the file's own share (10 of 20)
    # passes data.max_malformed_per_file: the run fails naming the file, and day 2's champion stays
    good = PAIRS[64:74]
    _write_day(source, BROKEN_DAY, good, broken=10)
    run4, four = _day(world)
    table.append(_row(BROKEN_DAY, run4, four))
    assert run4.state.is_failed() and four is None
    said = f"{run4.state.message}\n{_flow_run_logs(env, run4.id)}"
    assert f"{source / BROKEN_DAY}.jsonl: 10 of 20 rows malformed (50.0%)" in said, said[-3000:]
    assert "data.max_malformed_per_file=0.2" in said
    assert 10 / (40 + 24 + 20) < 0.2
    assert client.get_registered_model(MODEL).aliases["champion"] == v2
    assert sorted(int(v.version) for v in client.search_model_versions(f"name = '{MODEL}'")) == [int(v1), int(v2)]
