"""The router supervises its engine: a real engine process (the stand-in vLLM server, started by the router's
own `Engine` with vLLM's command line) that is killed (SIGKILL), hung (SIGSTOP) or crashes at every start, behind
the router as `serve` runs it (`router.run`: uvicorn, the supervisor, the alias follower), over a real SQLite log.

- a killed engine is restarted with every adapter it held (a draining old version too); meanwhile requests get a
  fast 503 with Retry-After and are in no arm's rows; /ready is 503 then 200, /health 200 throughout; the restart
  is in the log for `ab status`;
- a hung engine (no answer to /v1/models within ab.serve.probe_timeout_s) is killed and restarted;
- an engine that crashes at every start: the router gives up at ab.serve.restart_limit and `run` raises the
  error with the engine log's tail (the CLI's exit 1); it does not loop;
- a client that retries at once on Retry-After gets 503s and nothing piles up (no request in flight, no row).
"""

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import text

from grpo_pipeline.configs.ab import ServeConfig
from grpo_pipeline.tasks.serve.ab_log import RequestLog
from grpo_pipeline.tasks.serve.api import CHALLENGER, CHAMPION
from grpo_pipeline.tasks.serve.engine import EngineError
from tests.engine_python import STAND_IN_VLLM
from tests.serve_world import adapter_at, replica, wait_for

pytestmark = pytest.mark.integration

BODY = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(STAND_IN_VLLM))
    monkeypatch.setenv("STAND_IN_ENGINE_START_S", "1")  # a start-up long enough to be seen restarting


@pytest.fixture
def request_log(tmp_path):
    log = RequestLog.open(f"sqlite:///{tmp_path / 'ab.sqlite'}")
    yield log
    log.close()


def arms(tmp_path):
    return {
        CHAMPION: adapter_at(tmp_path / "adapters", "champion", "1"),
        CHALLENGER: adapter_at(tmp_path / "adapters", "challenger", "2"),
    }


def logged(request_log) -> list[dict]:
    with request_log.engine.connect() as c:
        return [dict(r._mapping) for r in c.execute(text("SELECT id, arm, error FROM ab_requests"))]


def engine_models(r) -> set[str]:
    answer = httpx.get(f"{r.router.engine.url}/v1/models", headers=r.router.engine.headers, timeout=10)
    return {m["id"] for m in answer.json()["data"]}


def test_a_killed_engine_is_restarted_with_its_adapters_and_requests_meanwhile_get_a_fast_503(
    tmp_path, request_log, stand_in
):
    cfg = ServeConfig(probe_s=0.2, probe_timeout_s=5, retry_after_s=2)
    with replica(tmp_path / "r", request_log, arms(tmp_path), cfg) as r, httpx.Client(base_url=r.url, timeout=30) as c:
        draining = adapter_at(tmp_path / "adapters", "champion", "0")  # an old version still draining its requests
        r.router.loaded[draining.engine_name] = draining.path
        assert c.post("/v1/chat/completions", json=BODY).status_code == 200
        assert c.get("/ready").status_code == 200
        old_pid = r.engine_pid
        os.kill(old_pid, signal.SIGKILL)
        statuses = []
        while (answer := c.post("/v1/chat/completions", json=BODY | {"user": f"u{len(statuses)}"})).status_code != 200:
            assert answer.status_code == 503, answer.text
            assert answer.headers["Retry-After"] == "2" and "restarting" in answer.json()["error"]["message"]
            statuses.append(answer.status_code)
            if len(statuses) == 1:
                wait_for(lambda: r.router.restarting, 30, "the restart")
                ready = c.get("/ready")
                assert ready.status_code == 503 and ready.json()["reason"] == "the engine is restarting"
                assert c.get("/health").status_code == 200
            assert len(statuses) < 100_000
        assert statuses, "no request saw the restart"
        assert r.engine_pid != old_pid and r.router.restarts == 1
        assert c.get("/ready").status_code == 200 and c.get("/health").json()["restarts"] == 1
        assert engine_models(r) >= {"champion-v1", "challenger-v2", "champion-v0"}
        for user in ("a", "b", "c", "d", "e", "f"):  # both arms answer from the restarted engine
            assert c.post("/v1/chat/completions", json=BODY | {"user": user}).status_code == 200
    rows = logged(request_log)
    assert len(rows) == 8 and not any(row["error"] for row in rows)  # the 503s are in no arm's rows
    restarts = request_log.restarts()
    assert restarts["count"] == 1 and "signal SIGKILL" in restarts["last"]["reason"]


def test_a_hung_engine_is_killed_and_restarted(tmp_path, request_log, stand_in):
    cfg = ServeConfig(probe_s=0.2, probe_timeout_s=1)
    with replica(tmp_path / "r", request_log, arms(tmp_path), cfg) as r, httpx.Client(base_url=r.url, timeout=30) as c:
        hung = r.engine_pid
        os.kill(hung, signal.SIGSTOP)  # alive, and silent
        wait_for(lambda: r.router.restarts == 1, 60, "the hung engine's restart")
        assert r.engine_pid != hung
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert "did not answer /v1/models within 1 s" in request_log.restarts()["last"]["reason"]


def test_an_engine_that_crashes_at_every_start_stops_at_the_limit_with_its_logs_tail(tmp_path, request_log, stand_in):
    cfg = ServeConfig(probe_s=0.2, probe_timeout_s=5, restart_limit=2)
    served = arms(tmp_path)
    with replica(tmp_path / "r", request_log, served, cfg) as r:
        shutil.rmtree(served[CHAMPION].path)  # the adapter is gone: every start fails, as vLLM's does
        os.kill(r.engine_pid, signal.SIGKILL)
        r.thread.join(120)
        assert not r.thread.is_alive(), "the router kept retrying"
        (error,) = r.error
        assert isinstance(error, EngineError)
        message = str(error)
        assert "after 2 starts (ab.serve.restart_limit)" in message
        assert f"no adapter found at {served[CHAMPION].path}" in message  # the engine log's tail
        assert r.router.engine.exit_status() is not None
    assert request_log.restarts()["count"] == 0


def test_a_client_retrying_at_once_on_retry_after_gets_503s_and_nothing_piles_up(
    tmp_path, request_log, stand_in, monkeypatch
):
    monkeypatch.setenv("STAND_IN_ENGINE_START_S", "3")
    cfg = ServeConfig(probe_s=0.2, probe_timeout_s=5)
    with replica(tmp_path / "r", request_log, arms(tmp_path), cfg) as r:
        os.kill(r.engine_pid, signal.SIGKILL)
        wait_for(lambda: r.router.restarting, 30, "the restart")

        def hammer(user: int) -> list[int]:
            with httpx.Client(base_url=r.url, timeout=30) as c:
                return [
                    c.post("/v1/completions", json={"prompt": "x", "user": f"u{user}"}).status_code for _ in range(25)
                ]

        with ThreadPoolExecutor(8) as pool:
            statuses = [s for batch in pool.map(hammer, range(8)) for s in batch]
        assert set(statuses) <= {503, 200} and 503 in statuses
        assert sum(r.router.inflight.values()) == 0
        assert len(logged(request_log)) == statuses.count(200)
