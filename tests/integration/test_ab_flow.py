"""The `ab-decide` flow under Prefect (ephemeral server, in a process of its own as a worker would run it) on a
request log filled through `RequestLog` and a SQLite MLflow registry: the decision moves the aliases and is
recorded as an MLflow run and a Prefect artifact."""

import json
import os
import subprocess
import sys
from datetime import timedelta

import mlflow
import pytest

from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION, PREVIOUS, Registry
from grpo_pipeline.tasks.serve.ab_log import LOG_URL_ENV, RequestLog
from tests import ab_world
from tests.ab_world import NAME, make_registry, overrides

pytestmark = pytest.mark.integration

# Runs the flow `times` times in one process (one ephemeral server start), then reads the Prefect artifact back.
SCRIPT = """
import json, sys
from prefect.artifacts import Artifact
from grpo_pipeline.flows.ab import ab_decide
results = [ab_decide(overrides=sys.argv[2:]) for _ in range(int(sys.argv[1]))]
artifact = Artifact.get("ab-decision")
print("RESULT " + json.dumps({"runs": results, "artifact": artifact.data if artifact else None}))
"""


@pytest.fixture
def world(tmp_path):
    """A registry with versions 1 (champion) and 2 (challenger), an empty request log, the flow's overrides."""
    uri, client = make_registry(tmp_path)
    url = f"sqlite:///{tmp_path / 'ab.sqlite'}"
    log = RequestLog.open(url)
    env = {
        **os.environ,
        LOG_URL_ENV: url,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    yield log, Registry(client, NAME), client, [f"data_dir={tmp_path / 'data'}", *overrides(uri)], env
    log.close()


def fill(log: RequestLog, challenger_score: float, challenger_latency: float = 0.2) -> None:
    """60 requests an arm, one a minute over the last two hours (the score-over-time table needs the spread)."""
    ab_world.fill(log, challenger_score, challenger_latency, per_arm=60, step=timedelta(minutes=1))


def run_flow(overrides: list[str], env: dict, times: int = 1) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(times), *overrides], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def decision_runs(client: mlflow.MlflowClient) -> list:
    experiment = client.get_experiment_by_name("grpo-pipeline-ab")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def test_a_clearly_better_challenger_is_promoted_and_the_decision_recorded(world):
    log, registry, client, overrides, env = world
    fill(log, challenger_score=1.0)
    out = run_flow(overrides, env)
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


def test_a_guardrail_breach_rolls_back_and_the_next_run_finds_no_test(world):
    log, registry, client, overrides, env = world
    fill(log, challenger_score=1.0, challenger_latency=1.0)  # better scores, but five times slower
    first, second = run_flow(overrides, env, times=2)["runs"]
    assert first["action"] == "rollback" and first["breaches"] == ["latency_p95_ratio"], first
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: None, PREVIOUS: None}
    assert second["action"] is None and second["challenger"] is None  # quiet until the next canary
    (run,) = decision_runs(client)  # the quiet run records nothing
    assert run.data.tags["ab_action"] == "rollback" and run.data.tags["ab_breaches"] == "latency_p95_ratio"
