"""The A/B request log and feedback store on SQLite (a file in tmp_path): written once per request, joined by id,
read back as what the decision takes; a second process sees what the first committed."""

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from grpo_pipeline.configs.ab import ABConfig
from grpo_pipeline.tasks.serve.ab import decide
from grpo_pipeline.tasks.serve.ab_log import LogStoreError, RequestLog, RequestRow, UnknownRequest, masked

ROOT = Path(__file__).resolve().parents[2]


def row(i: int, arm: str = "champion", version: str = "1", **kw) -> RequestRow:
    return RequestRow(
        id=f"cmpl-{i}",
        arm=arm,
        version=version,
        latency_s=kw.pop("latency_s", 0.2),
        prompt_tokens=12,
        completion_tokens=kw.pop("completion_tokens", 30),
        error=kw.pop("error", False),
        **kw,
    )


@pytest.fixture
def log(tmp_path):
    store = RequestLog.open(f"sqlite:///{tmp_path / 'ab.sqlite'}")
    yield store
    store.close()


def test_a_request_is_logged_once_however_often_it_is_written(log):
    assert log.record(row(1)) is True
    assert log.record(row(1)) is False  # a retried write: the id is the key, no second row
    assert log.counts() == {"champion": {"1": {"requests": 1, "errors": 0, "feedback": 0}}}


def test_feedback_joins_by_id_and_refuses_unknown_ids_and_non_finite_scores(log):
    log.record(row(1))
    log.feedback("cmpl-1", 1.0)
    log.feedback("cmpl-1", 0.0)  # a label arriving later replaces the thumbs: one outcome per request
    with pytest.raises(UnknownRequest, match="cmpl-404"):
        log.feedback("cmpl-404", 1.0)
    for bad in (float("nan"), float("inf"), "1.0", True, None):
        with pytest.raises(ValueError, match="finite"):
            log.feedback("cmpl-1", bad)
    champion, _, _ = log.samples("1", "2")
    assert list(champion.scores) == [0.0]
    assert log.counts()["champion"]["1"]["feedback"] == 1


def test_the_decision_reads_each_arms_current_version_from_the_log(log):
    started = datetime.now(UTC) - timedelta(hours=3)
    for i in range(240):  # 120 per arm: past ab.guardrails.min_requests
        arm, version = ("challenger", "2") if i % 2 else ("champion", "1")
        log.record(
            row(
                i,
                arm,
                version,
                created_at=started + timedelta(seconds=i),
                latency_s=0.6 if arm == "challenger" else 0.2,
                error=(i % 50 == 0),
            )
        )
        log.feedback(f"cmpl-{i}", 1.0 if arm == "challenger" else 0.0)
    log.record(row(1000, "challenger", "1"))  # an older challenger version: not this test's
    champion, challenger, hours = log.samples("1", "2")
    assert (champion.requests, challenger.requests) == (120, 120)
    assert challenger.scores.sum() == 120 and champion.scores.sum() == 0
    assert champion.error.sum() == 5 and 2.9 < hours < 3.1
    decision = decide(champion, challenger, ABConfig(), hours)
    assert decision.action == "rollback" and decision.breaches == ["latency_p95_ratio"]  # 3x slower


def test_what_one_process_committed_another_reads(tmp_path):
    url = f"sqlite:///{tmp_path / 'ab.sqlite'}"
    code = (
        f"from grpo_pipeline.tasks.serve.ab_log import RequestLog, RequestRow; log = RequestLog.open({url!r}); "
        "log.record(RequestRow(id='cmpl-x', arm='challenger', version='7', latency_s=0.1, prompt_tokens=1, "
        "completion_tokens=2, error=False, assignment='ab12'))"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        check=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    reader = RequestLog.open(url)
    assert reader.counts() == {"challenger": {"7": {"requests": 1, "errors": 0, "feedback": 0}}}
    reader.close()


def test_an_unreachable_store_is_named_with_its_password_hidden(tmp_path):
    with pytest.raises(LogStoreError, match=r"127\.0\.0\.1:1/ab.*fix:") as caught:
        RequestLog.open("postgresql+psycopg2://ab:hunter2@127.0.0.1:1/ab")
    assert "hunter2" not in str(caught.value)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(LogStoreError, match="unreachable"):  # its folder cannot be made
        RequestLog.open(f"sqlite:///{tmp_path / 'a-file' / 'ab.sqlite'}")
    fresh = RequestLog.open(f"sqlite:///{tmp_path / 'new' / 'dir' / 'ab.sqlite'}")  # the default's folder is made
    assert fresh.counts() == {}
    fresh.close()
    assert masked("sqlite:///x.db") == "sqlite:///x.db"


def test_a_database_whose_tables_are_not_the_logs_is_refused_naming_it_and_left_as_it_was(tmp_path):
    from sqlalchemy import create_engine, inspect, text

    url = f"sqlite:///{tmp_path / 'other.sqlite'}"
    other = create_engine(url)
    with other.begin() as c:
        c.execute(text("CREATE TABLE ab_requests (id TEXT PRIMARY KEY, payload TEXT)"))  # another application's
    with pytest.raises(LogStoreError, match="has a table ab_requests that is not the A/B log's") as caught:
        RequestLog.open(url)
    assert str(tmp_path / "other.sqlite") in str(caught.value) and "created_at" in str(caught.value)
    assert set(inspect(other).get_table_names()) == {"ab_requests"}  # nothing created or added there
    assert {c["name"] for c in inspect(other).get_columns("ab_requests")} == {"id", "payload"}
    other.dispose()
