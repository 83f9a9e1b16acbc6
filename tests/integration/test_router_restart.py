"""A killed router is back in seconds, on the engine it left: the stack's router start (`Stack._start_router`: a
real supervisord) with a router process in place of `grpo-pipeline serve` (tests/router_program.py: `router.run`
with `ab.serve.reattach_engine`, as the stack's router runs) and the stand-in vLLM engine with a slow start-up.

- the router binds at once: /health answers while its engine starts, a request gets 503 + Retry-After, `stack
  status` says `starting`;
- killed (SIGKILL) while a client sends requests, supervisord starts it again and it attaches to the same engine
  process (no second engine start): the seconds from the kill to the next answer are printed, `stack status` says
  `up` with 1 restart, every answered request is in the log once;
- `stack down` stops the router and its engine, and the engine's record goes.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import create_engine, text

from grpo_pipeline.infra import services
from grpo_pipeline.infra import stack as stack_module
from grpo_pipeline.infra.stack import ServeOptions, Stack, engine_record
from grpo_pipeline.tasks.serve.engine import EngineRecord
from tests.engine_python import STAND_IN_VLLM
from tests.serve_world import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # an engine start-up of 30 s, a router restart

PROGRAM = Path(__file__).resolve().parents[1] / "router_program.py"
ENGINE_START_S = 30  # the stand-in's start-up: what a restart would cost were the engine started again
BODY = {"messages": [{"role": "user", "content": "hi"}]}


def runs(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def stack(tmp_path, monkeypatch):
    """A Stack whose router command is tests/router_program.py (PostgreSQL and MLflow recorded, not started: the
    router's start reads only their URLs)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STAND_IN_VLLM), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STAND_IN_ENGINE_START_S", str(ENGINE_START_S))
    monkeypatch.setattr(
        stack_module,
        "router_command",
        lambda options, port, tracking_uri, data_dir: [sys.executable, str(PROGRAM), str(data_dir), str(port)],
    )
    stack = Stack(tmp_path / "stack")
    for name in ("postgres", "mlflow"):
        record = services.Service(name, os.getpid(), "postgresql://u:@/postgres?host=/nowhere", str(tmp_path), "", 0.0)
        stack.state["services"][name] = record.to_dict()
    stack.state["serve_options"] = ServeOptions(None, sys.executable, startup_timeout_s=300).as_dict()
    yield stack
    stack.down()


def logged_ids(data_dir: Path) -> list[str]:
    engine = create_engine(f"sqlite:///{data_dir / 'ab.sqlite'}")
    with engine.connect() as c:
        ids = [row[0] for row in c.execute(text("SELECT id FROM ab_requests"))]
    engine.dispose()
    return ids


def test_a_killed_router_answers_again_within_seconds_on_the_engine_it_left(stack, tmp_path):
    work, port = stack.root / "serve", services.free_port()
    url = f"http://127.0.0.1:{port}"
    seen: dict[str, object] = {}

    def start() -> None:
        try:
            stack.state["services"]["serve"] = stack._start_router(work, port, stack._recorded("postgres")).to_dict()
        except BaseException as e:
            seen["error"] = e

    starting = threading.Thread(target=start)
    starting.start()
    # Bound before its engine answers: liveness at once, a request told to come back, `stack status` says starting.
    health = wait_for(lambda: services.http_answer(f"{url}/health")[1], 120, "the router's /health")
    assert health["engine"] == "starting", health
    early = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=30)
    assert early.status_code == 503 and early.headers["Retry-After"] == "1", early.text
    assert "the engine is starting" in early.json()["error"]["message"]
    not_ready = {"status": "not ready", "restarts": 0, "reason": "the engine is starting"}
    assert services.http_answer(f"{url}/ready") == (503, not_ready)
    starting.join(ENGINE_START_S + 300)
    assert "error" not in seen and not starting.is_alive(), seen
    status = stack.status()["serve"]
    assert (status["state"], status["restarts"], status["engine"], status["healthy"]) == ("up", 0, "up", True)
    record = engine_record(work)
    engine_pid = EngineRecord.load(record).pid

    # A client sending one request after another; the router is killed under it.
    outcomes: list[tuple[float, int | None, str | None]] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            i = 0
            while not stop.is_set():
                try:
                    answer = c.post("/v1/chat/completions", json=BODY | {"user": f"u{i}"})
                    ident = answer.json().get("id") if answer.status_code == 200 else None
                    outcomes.append((time.monotonic(), answer.status_code, ident))
                except httpx.HTTPError:
                    outcomes.append((time.monotonic(), None, None))  # refused or cut: no router on the port
                    time.sleep(0.05)
                i += 1

    traffic = threading.Thread(target=client)
    traffic.start()
    try:
        wait_for(lambda: sum(code == 200 for _, code, _ in outcomes) >= 20, 120, "answers before the kill")
        first_router = status["router_pid"]
        killed_at = time.monotonic()
        os.kill(first_router, signal.SIGKILL)
        back = wait_for(
            lambda: next((t for t, code, _ in outcomes if t > killed_at and code == 200), None), 300, "an answer"
        )
        wait_for(lambda: sum(t > back and code == 200 for t, code, _ in outcomes) >= 20, 120, "answers after")
    finally:
        stop.set()
        traffic.join(60)
    print(f"\nrouter SIGKILL -> next answer: {back - killed_at:.1f} s (the engine's start-up: {ENGINE_START_S} s)")

    after = stack.status()["serve"]
    assert (after["state"], after["restarts"], after["engine"]) == ("up", 1, "up"), after
    assert after["router_pid"] not in (None, first_router)
    assert EngineRecord.load(record).pid == engine_pid and runs(engine_pid)  # the same engine
    starts = (work / "data" / "serve" / "engine.log").read_text().count("stand-in engine serving")
    assert starts == 1, "the engine was started again"
    between = [code for t, code, _ in outcomes if killed_at < t < back]
    assert set(between) <= {None, 503}, between  # refused, or told to come back: never a wrong answer
    answered = [ident for _, code, ident in outcomes if code == 200]
    ids = logged_ids(work / "data")
    assert set(answered) <= set(ids) and len(ids) == len(set(ids))  # every answer logged, once

    stack.down()
    wait_for(lambda: not runs(engine_pid), 60, "the engine's stop")
    assert not record.exists()
