"""The `ab-decide` flow under Prefect (ephemeral server, in a process of its own as a worker would run it) on a
request log filled through `RequestLog` and a SQLite MLflow registry: the decision moves the aliases and is
recorded as an MLflow run and a Prefect artifact."""

import json
import os
import subprocess
import sys
from datetime import timedelta
from typing import NamedTuple

import mlflow
import pytest

from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION, PREVIOUS, Registry
from grpo_pipeline.tasks.serve.ab_log import LOG_URL_ENV, RequestLog
from tests import ab_world
from tests.ab_world import NAME, make_registry, overrides

pytestmark = pytest.mark.integration

# Runs each world's flows in turn in one process (one Python start-up, one ephemeral server start), each world with
# its own request log, and reads the Prefect artifact back after each world's runs.
SCRIPT = """
import json, os, sys
from prefect.artifacts import Artifact
from grpo_pipeline.flows.ab import ab_decide
out = []
for world in json.loads(sys.argv[1]):
    os.environ[world["log_env"]] = world["log_url"]
    results = [ab_decide(overrides=world["overrides"]) for _ in range(world["times"])]
    artifact = Artifact.get("ab-decision")
    out.append({"runs": results, "artifact": artifact.data if artifact else None})
print("RESULT " + json.dumps(out))
"""


class World(NamedTuple):
    log: RequestLog
    registry: Registry
    client: mlflow.MlflowClient
    overrides: list[str]
    log_url: str


def make_world(folder, empty_db) -> World:
    """A registry with versions 1 (champion) and 2 (challenger), an empty request log, the flow's overrides."""
    folder.mkdir()
    uri, client = make_registry(folder, empty_db)
    url = f"sqlite:///{folder / 'ab.sqlite'}"
    return World(
        RequestLog.open(url), Registry(client, NAME), client, [f"data_dir={folder / 'data'}", *overrides(uri)], url
    )


def fill(log: RequestLog, challenger_score: float, challenger_latency: float = 0.2) -> None:
    """60 requests an arm, one a minute over the last two hours (the score-over-time table needs the spread)."""
    ab_world.fill(log, challenger_score, challenger_latency, per_arm=60, step=timedelta(minutes=1))


@pytest.fixture(scope="module")
def decided(tmp_path_factory):
    """Two worlds, each decided by the flow in one worker-like process: `better` (a clearly better challenger,
    one run) and `breach` (better scores but five times slower, two runs). -> {name: (world, flow output)}."""
    root = tmp_path_factory.mktemp("ab-flow")
    empty_db = root / "empty.db"  # MLflow's tables made once (its migrations take seconds), copied per world
    mlflow.MlflowClient(f"sqlite:///{empty_db}").search_registered_models()
    worlds = {"better": make_world(root / "better", empty_db), "breach": make_world(root / "breach", empty_db)}
    fill(worlds["better"].log, challenger_score=1.0)
    fill(worlds["breach"].log, challenger_score=1.0, challenger_latency=1.0)
    times = {"better": 1, "breach": 2}
    jobs = [
        {"log_env": LOG_URL_ENV, "log_url": w.log_url, "overrides": w.overrides, "times": times[name]}
        for name, w in worlds.items()
    ]
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop(LOG_URL_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(jobs)], env=env, capture_output=True, text=True, timeout=900
    )
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        outputs = json.loads(line.removeprefix("RESULT "))
        yield {name: (w, out) for (name, w), out in zip(worlds.items(), outputs, strict=True)}
    finally:
        for w in worlds.values():
            w.log.close()


def decision_runs(client: mlflow.MlflowClient) -> list:
    experiment = client.get_experiment_by_name("grpo-pipeline-ab")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def test_a_clearly_better_challenger_is_promoted_and_the_decision_recorded(decided):
    (_, registry, client, _, _), out = decided["better"]
    (result,) = out["runs"]
    assert result["action"] == "promote" and result["applied"] == "yes", result
    assert registry.aliases() == {CHAMPION: "2", CHALLENGER: None, PREVIOUS: "1"}
    assert result["moves"] == [
        "ab-test@previous-champion: (none) -> 1",
        "ab-test@champion: 1 -> 2",
        "ab-test@challenger: 2 -> (removed)",
    ]
    (run,) = decision_runs(client)
    assert run.info.run_id == result["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["ab_action"] == "promote" and run.data.tags["ab_applied"] == "yes"
    assert run.data.params["challenger_version"] == "2" and run.data.params["ab.min_samples"] == "40"
    metrics = run.data.metrics
    assert metrics["test/difference"] == pytest.approx(0.5) and metrics["test/interval_low"] > 0
    assert metrics["challenger/scored"] == 60 and metrics["champion/mean_score"] == pytest.approx(0.5)
    assert {"decision.json", "decision.md", "ab_scores.png"} <= {f.path for f in client.list_artifacts(run.info.run_id)}
    markdown = out["artifact"]
    assert markdown.startswith("# A/B decision: **promote**") and "ab-test@champion: 1 -> 2" in markdown
    assert "## Mean score over time" in markdown and "replaces the challenger" in markdown
    assert client.get_model_version("ab-test", "2").tags["ab_decision"] == "promote"


def test_a_guardrail_breach_rolls_back_and_the_next_run_finds_no_test(decided):
    (_, registry, client, _, _), out = decided["breach"]  # better scores, but five times slower
    first, second = out["runs"]
    assert first["action"] == "rollback" and first["breaches"] == ["latency_p95_ratio"], first
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: None, PREVIOUS: None}
    assert second["action"] is None and second["challenger"] is None  # quiet until the next canary
    (run,) = decision_runs(client)  # the quiet run records nothing
    assert run.data.tags["ab_action"] == "rollback" and run.data.tags["ab_breaches"] == "latency_p95_ratio"
