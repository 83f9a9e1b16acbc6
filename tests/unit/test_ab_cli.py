"""`grpo-pipeline ab status|decide` against a SQLite request log and a SQLite MLflow registry (no server): the
decision read from the log, the aliases moved under the lock, the failures named with exit 2."""

import json
import shutil

import mlflow
import pytest
from typer.testing import CliRunner

from grpo_pipeline.cli import app
from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION, PREVIOUS, Registry
from grpo_pipeline.tasks.serve.ab_apply import NO_TEST, NOTHING_YET
from grpo_pipeline.tasks.serve.ab_log import LOG_URL_ENV, RequestLog, RequestRow
from tests.ab_world import NAME, fill, make_registry, overrides


@pytest.fixture(scope="module")
def empty_registry_db(tmp_path_factory):
    """An MLflow SQLite database with its tables made once (its migrations take seconds), copied per test."""
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_registered_models()
    return path


@pytest.fixture
def world(tmp_path, monkeypatch, empty_registry_db):
    """A registry with versions 1 (champion) and 2 (challenger), and an empty request log."""
    uri, client = make_registry(tmp_path, empty_registry_db)
    log_url = f"sqlite:///{tmp_path / 'ab.sqlite'}"
    monkeypatch.setenv(LOG_URL_ENV, log_url)
    log = RequestLog.open(log_url)
    yield log, Registry(client, NAME), [arg for o in overrides(uri) for arg in ("--set", o)]
    log.close()


def run(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["ab", *args, "--json"])
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


def test_status_shows_the_counts_and_the_estimate(world):
    log, _, args = world
    fill(log, challenger_score=1.0)
    code, out = run("status", *args)
    assert code == 0, out
    assert out["log"]["champion"]["1"] == {"requests": 50, "errors": 0, "feedback": 50}
    assert out["arms"]["challenger"]["mean_score"] == 1.0 and out["test"]["difference"] == pytest.approx(0.5)
    assert out["test"]["interval"][0] > 0 and 1.9 < out["elapsed_h"] < 2.1


def test_status_counts_the_requests_a_router_answered_while_the_store_was_down(world, tmp_path):
    from grpo_pipeline.tasks.serve.ab_spool import append, spool_path

    _, _, args = world
    for i in range(3):
        append(
            spool_path(tmp_path),
            RequestRow(
                id=f"spooled-{i}",
                arm="champion",
                version="1",
                latency_s=0.1,
                prompt_tokens=3,
                completion_tokens=4,
                error=False,
            ),
        )
    code, out = run("status", *args, "--set", f"data_dir={tmp_path}")
    assert code == 0 and out["unlogged"] == 3, out


def test_status_counts_the_engine_restarts_of_every_router(world):
    log, _, args = world
    code, out = run("status", *args)
    assert code == 0 and out["engine_restarts"] == {"count": 0, "last": None}, out
    log.engine_restarted("the engine exited with signal SIGKILL")
    log.engine_restarted("the engine did not answer /v1/models within 30 s (ReadTimeout)")
    code, out = run("status", *args)
    assert out["engine_restarts"]["count"] == 2 and "within 30 s" in out["engine_restarts"]["last"]["reason"]


def test_a_better_challenger_is_promoted_and_the_aliases_move(world):
    log, registry, args = world
    fill(log, challenger_score=1.0)
    code, out = run("decide", *args)
    assert code == 0 and out["action"] == "promote", out
    assert registry.aliases() == {CHAMPION: "2", CHALLENGER: None, PREVIOUS: "1"}
    assert out["moves"] == [
        "ab-test@previous-champion: (none) -> 1",
        "ab-test@champion: 1 -> 2",
        "ab-test@challenger: 2 -> (removed)",
    ]


def test_offline_promotion_tests_nothing_live_and_moves_nothing(world):
    """In promote.mode=offline the challenger alias is the candidate the offline gate rejected."""
    log, registry, args = world
    fill(log, challenger_score=1.0)
    code, out = run("decide", *args, "--set", "promote.mode=offline")
    assert code == 0 and out["action"] is None and "promote.mode is offline" in " ".join(out["reasons"]), out
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: "2", PREVIOUS: None}


@pytest.mark.parametrize("mode", ["offline", "canary"])
def test_a_fresh_registry_has_nothing_to_decide_yet_in_either_mode(tmp_path, monkeypatch, empty_registry_db, mode):
    """The hourly schedule on a fresh stack (no version registered, no aliases): it says plainly that there is
    nothing to decide, not that the challenger alias holds a rejected candidate."""
    shutil.copy(empty_registry_db, tmp_path / "mlflow.db")
    monkeypatch.setenv(LOG_URL_ENV, f"sqlite:///{tmp_path / 'ab.sqlite'}")
    settings = [*overrides(f"sqlite:///{tmp_path / 'mlflow.db'}"), f"promote.mode={mode}"]
    code, out = run("decide", *(arg for o in settings for arg in ("--set", o)))
    assert code == 0 and out["action"] is None and (out["champion"], out["challenger"]) == (None, None), out
    assert out["reasons"] == [NOTHING_YET] and "nothing to decide yet" in NOTHING_YET
    assert not any("offline gate" in reason for reason in out["reasons"])


def test_a_champion_without_a_challenger_runs_no_test_in_offline_mode_either(world):
    _, registry, args = world
    registry.client.delete_registered_model_alias(NAME, CHALLENGER)
    code, out = run("decide", *args, "--set", "promote.mode=offline")
    assert code == 0 and out["action"] is None and out["reasons"] == [NO_TEST], out


def test_a_slow_challenger_is_rolled_back_and_traffic_returns_to_the_champion(world):
    log, registry, args = world
    fill(log, challenger_score=1.0, challenger_latency=1.0)
    code, out = run("decide", *args)
    assert code == 0 and out["action"] == "rollback" and out["breaches"] == ["latency_p95_ratio"], out
    assert registry.aliases() == {CHAMPION: "1", CHALLENGER: None, PREVIOUS: None}
    code, out = run("decide", *args)  # the next hourly run: no test is running
    assert code == 0 and out["action"] is None


def test_too_little_data_continues_and_moves_nothing(world):
    log, registry, args = world
    fill(log, challenger_score=1.0, per_arm=20)
    code, out = run("decide", *args)
    assert code == 0 and out["action"] == "continue" and out["moves"] == []
    assert registry.aliases()[CHALLENGER] == "2"


def test_an_unreachable_log_store_or_a_bad_setting_exits_2_naming_it(world, monkeypatch):
    _, _, args = world
    code, out = run("decide", *args, "--set", "ab.challenger_fraction=2")
    assert code == 2 and "ab.challenger_fraction" in out["error"]
    monkeypatch.setenv(LOG_URL_ENV, "postgresql+psycopg2://ab:pw@127.0.0.1:1/ab")
    code, out = run("status", *args)
    assert code == 2 and out["status"] == "failed" and "127.0.0.1:1" in out["error"] and "pw@" not in out["error"]
