"""`promote.mode=canary` and the A/B round against a SQLite MLflow registry (no server): a candidate that passed
the offline gate becomes challenger and the champion stays; a newer one replaces a running challenger (the test
restarts: the old version's requests no longer count); with no champion yet it becomes champion; an operator's
`promote --force` still sets a champion; aliases that move between the decision and the lock move nothing."""

import json
import shutil
from datetime import UTC, datetime, timedelta

import mlflow
import pytest
from typer.testing import CliRunner

from grpo_pipeline.cli import app
from grpo_pipeline.configs.ab import ABConfig
from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION, PREVIOUS, Registry
from grpo_pipeline.tasks.serve.ab import AliasesMoved
from grpo_pipeline.tasks.serve.ab_apply import decide_round, settle_round
from grpo_pipeline.tasks.serve.ab_log import RequestLog, RequestRow
from grpo_pipeline.tasks.serve.ab_report import decision_metrics, read_outcomes, render_decision, series

PASSED = {"decision": "promote", "decision_reasons": "passed the offline gate"}


@pytest.fixture(scope="module")
def empty_registry_db(tmp_path_factory):
    """An MLflow SQLite database with its tables made once (its migrations take seconds), copied per test."""
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_registered_models()
    return path


@pytest.fixture
def registry(tmp_path, empty_registry_db):
    """`canary-test` with three versions and no alias yet."""
    shutil.copy(empty_registry_db, tmp_path / "mlflow.db")
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("canary-test")
    for _ in range(3):
        client.create_model_version("canary-test", source=str(tmp_path))
    return Registry(client, "canary-test")


def test_promote_mode_is_a_config_field_and_refuses_other_values():
    assert load_config(None, []).promote.mode == "offline"
    assert load_config(None, ["promote.mode=canary"]).promote.mode == "canary"
    with pytest.raises(ConfigError, match=r"promote\.mode: Input should be 'offline' or 'canary'"):
        load_config(None, ["promote.mode=live"])


def test_canary_makes_a_passing_candidate_challenger_and_leaves_the_champion(registry):
    registry.client.set_registered_model_alias("canary-test", CHAMPION, "1")
    moves = registry.settle("2", "1", promote=True, tags=PASSED, mode="canary")
    assert [m.describe() for m in moves] == ["canary-test@challenger: (none) -> 2"]
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: "2", PREVIOUS: None}
    assert registry.settle("2", "1", promote=True, tags=PASSED, mode="canary") == []  # a retried attempt
    # a newer candidate arrives while the canary runs: it replaces the challenger, which is told why
    moves = registry.settle("3", "1", promote=True, tags=PASSED, mode="canary")
    assert [m.describe() for m in moves] == ["canary-test@challenger: 2 -> 3"]
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: "3", PREVIOUS: None}
    replaced = registry.client.get_model_version("canary-test", "2").tags
    assert replaced["ab_decision"] == "replaced" and "version 3" in replaced["ab_reason"]


def test_a_rejected_candidate_gets_no_alias_in_canary_and_the_running_test_goes_on(registry):
    registry.client.set_registered_model_alias("canary-test", CHAMPION, "1")
    registry.client.set_registered_model_alias("canary-test", CHALLENGER, "2")
    assert registry.settle("3", "1", promote=False, tags={"decision": "reject"}, mode="canary") == []
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: "2", PREVIOUS: None}
    assert registry.client.get_model_version("canary-test", "3").tags["decision"] == "reject"
    # offline mode is unchanged: a rejected candidate becomes challenger
    registry.settle("3", "1", promote=False, tags={"decision": "reject"}, mode="offline")
    assert registry.aliases()[CHALLENGER] == "3"


def test_canary_with_no_champion_yet_makes_the_candidate_champion(registry):
    moves = registry.settle("1", None, promote=True, tags=PASSED, mode="canary")
    assert [m.describe() for m in moves] == ["canary-test@champion: (none) -> 1"]
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: None, PREVIOUS: None}
    assert registry.settle("1", None, promote=True, tags=PASSED, mode="canary") == []  # a retried attempt


def test_promote_force_still_sets_a_champion_by_hand_during_a_canary(registry, tmp_path):
    registry.client.set_registered_model_alias("canary-test", CHAMPION, "1")
    registry.client.set_registered_model_alias("canary-test", CHALLENGER, "2")
    args = [
        "--set",
        f"tracking.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "--set",
        "tracking.registered_model=canary-test",
        "--set",
        "promote.mode=canary",
    ]
    result = CliRunner().invoke(app, ["promote", "--version", "2", "--force", "--reason", "on-call", *args])
    assert result.exit_code == 0, result.output
    assert registry.aliases() == {CHAMPION: "2", CHALLENGER: None, PREVIOUS: "1"}


def fill(log: RequestLog, challenger_version: str, per_arm: int = 60) -> None:
    start = datetime.now(UTC) - timedelta(hours=2)
    for i in range(2 * per_arm):
        arm, version = ("challenger", challenger_version) if i % 2 else ("champion", "1")
        log.record(
            RequestRow(
                id=f"{challenger_version}-{i}",
                arm=arm,
                version=version,
                prompt_tokens=9,
                completion_tokens=30,
                latency_s=0.2,
                error=False,
                created_at=start + timedelta(minutes=i),
            )
        )
        log.feedback(f"{challenger_version}-{i}", 1.0 if arm == "challenger" else float(i // 2 % 2))


def test_a_replaced_challengers_requests_no_longer_count_and_a_stale_round_moves_nothing(registry, tmp_path):
    log = RequestLog.open(f"sqlite:///{tmp_path / 'ab.sqlite'}")
    ab = ABConfig(min_samples=40, guardrails={"min_requests": 40})
    registry.client.set_registered_model_alias("canary-test", CHAMPION, "1")
    registry.settle("2", "1", promote=True, tags=PASSED, mode="canary")
    fill(log, "2")
    found = decide_round(ab, log, registry)
    assert found.action == "promote" and found.decision.arms["challenger"].requests == 60
    # version 3 replaces 2 before the round settles: the round was about 2, so nothing moves
    registry.settle("3", "1", promote=True, tags=PASSED, mode="canary")
    with pytest.raises(AliasesMoved, match="run `grpo-pipeline ab decide` again"):
        settle_round(registry, found)
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: "3", PREVIOUS: None}
    # the restarted test counts version 3's requests only: none yet
    found = decide_round(ab, log, registry)
    assert found.action == "continue" and found.decision.arms["challenger"].requests == 0
    log.close()


def test_the_decision_report_has_the_statistics_the_rule_and_the_score_over_time(registry, tmp_path):
    log = RequestLog.open(f"sqlite:///{tmp_path / 'ab.sqlite'}")
    ab = ABConfig(min_samples=40, guardrails={"min_requests": 40})
    registry.client.set_registered_model_alias("canary-test", CHAMPION, "1")
    registry.client.set_registered_model_alias("canary-test", CHALLENGER, "2")
    fill(log, "2")
    found = settle_round(registry, decide_round(ab, log, registry))
    outcomes = read_outcomes(log, "1", "2")
    log.close()
    points = series(outcomes, ab, points=6)
    assert [p.n["challenger"] for p in points] == [10, 20, 30, 40, 50, 60]  # one score a minute per arm
    assert points[-1].mean["challenger"] == 1.0 and points[-1].difference_interval[0] > 0
    metrics = decision_metrics(found)
    assert metrics["test/difference"] == pytest.approx(0.5) and metrics["champion/requests"] == 60
    markdown = render_decision(found, points, outcomes.start)
    assert markdown.startswith("# A/B decision: **promote**")
    assert "replaces the challenger and the test restarts" in markdown
    assert "canary-test@champion: 1 -> 2" in markdown and markdown.count("\n| ") >= 2 + 1 + 6
    assert json.loads(json.dumps(found.as_json()))["moves"] == found.moves
