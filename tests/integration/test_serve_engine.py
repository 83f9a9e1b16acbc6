"""`grpo-pipeline serve` end to end: the router process in front of a real vLLM CPU engine (from `.venv-serve`,
built by `make serve-env`), a tiny random Llama (head_dim 64, which the CPU attention kernels take) and random
LoRA adapters registered as the pipeline registers them (MLflow models, SQLite registry, the base copied to
the artifact store). One engine start-up per router start (minutes on two cores), so: slow.

- 1,000 requests from 200 users: the challenger's share of users within the binomial 99 % interval, one arm
  per user, each answered request in the log exactly once with its arm and version;
- the arms answer differently (two adapters);
- the challenger alias moves while requests flow: none fails, later requests are served by the new adapter;
  an adapter of another base is refused and the old one keeps serving;
- a streamed answer relayed with the arm's id and model in every chunk and logged before its `[DONE]`;
- `kill -9` of the router while requests flow: every answered request is in the log, once; the engine died
  with it (its port closes); a restarted router serves again.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlflow
import pytest
from scipy.stats import binom
from sqlalchemy import create_engine, text

from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.tasks.promote import serving
from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION, AliasMove, Registry
from grpo_pipeline.trainer.launch import free_port
from tests.engine_python import ENGINE_PYTHON, engine_gone, skip_without_engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = "serve-adapter"
FRACTION = 0.3
PROMPT = [{"role": "user", "content": "What is 3 + 4? Reply with just the number."}]

skip_without_engine()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A registry with champion v1, challenger v2 (same base), v3 (same base, other weights), v4 (another base)."""
    from tests.tiny_model import create_random_adapter, create_random_model

    root = tmp_path_factory.mktemp("serve")
    base = create_random_model(root / "base", hidden_size=256, seed=0)
    other_base = create_random_model(root / "other-base", hidden_size=256, seed=1)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    cfg = load_config(None, ["evaluate.max_new_tokens=4"])
    base_exp = client.create_experiment(serving.BASE_EXPERIMENT, artifact_location=str(root / "artifacts-base"))
    mlflow.set_experiment(
        experiment_id=client.create_experiment("serve-tests", artifact_location=str(root / "artifacts"))
    )
    registry = Registry(client, NAME)
    versions = []
    for i, on in enumerate([base, base, base, other_base]):
        reference = serving.base_reference(client, str(on), base_exp, on.name)
        adapter = create_random_adapter(on, root / f"adapter-{i}", seed=10 + i)
        with mlflow.start_run() as run:
            model_uri, model_id = serving.log_adapter_model(
                str(adapter), reference, cfg.model, cfg.evaluate, "What is 1 + 1?", root / f"work-{i}"
            )
        versions.append(
            registry.register(model_uri, run.info.run_id, {"base_model": reference.reference}, model_id=model_id)
        )
    registry.apply([AliasMove(CHAMPION, versions[0]), AliasMove(CHALLENGER, versions[1])])
    return {
        "root": root,
        "uri": uri,
        "registry": registry,
        "versions": versions,
        "log_url": f"sqlite:///{root / 'ab.sqlite'}",
    }


class Server:
    def __init__(self, world, port: int):
        self.world, self.port = world, port
        self.url = f"http://127.0.0.1:{port}"
        self.output = world["root"] / f"router-{port}.log"
        env = {
            **os.environ,
            "GRPO_AB_LOG_URL": world["log_url"],
            "GRPO_SERVE_API_KEY": "test-key",
            "GRPO_MODEL_CACHE": str(world["root"] / "model-cache"),
        }
        with open(self.output, "ab") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "grpo_pipeline.cli",
                    "serve",
                    "--port",
                    str(port),
                    "--set",
                    f"tracking.mlflow_tracking_uri={world['uri']}",
                    "--set",
                    f"tracking.registered_model={NAME}",
                    "--set",
                    f"data_dir={world['root'] / 'data'}",
                    "--set",
                    f"ab.challenger_fraction={FRACTION}",
                    "--set",
                    "promote.mode=canary",
                    "--set",
                    "ab.serve.poll_s=2",
                    "--set",
                    f"ab.serve.engine_python={ENGINE_PYTHON}",
                    "--set",
                    "ab.serve.max_model_len=256",
                    "--set",
                    "ab.serve.max_lora_rank=8",
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=world["root"],
            )
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": "Bearer test-key"}, timeout=120)

    def wait_ready(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the router exited:\n{self.output.read_text()[-3000:]}"
            try:
                if self.client.get("/v1/models").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise AssertionError(f"the router was not ready in {timeout_s} s:\n{self.output.read_text()[-3000:]}")

    def ask(self, user: str, max_tokens: int = 2) -> httpx.Response:
        return self.client.post(
            "/v1/chat/completions", json={"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "user": user}
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.client.close()


def logged(world) -> dict[str, tuple[str, str, int]]:
    """{id: (arm, version, rows with that id)} from the log file itself."""
    engine = create_engine(world["log_url"])
    with engine.connect() as c:
        rows = c.execute(text("SELECT id, arm, version, COUNT(*) FROM ab_requests GROUP BY id, arm, version")).all()
    engine.dispose()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


@pytest.fixture(scope="module")
def server(world):
    s = Server(world, free_port())
    s.wait_ready()
    yield s
    s.stop()


def test_1000_requests_from_200_users_split_sticky_and_logged_once(server, world):
    users = [f"user-{i % 200}" for i in range(1000)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(server.ask, users))
    assert [a.status_code for a in answers] == [200] * 1000
    arms: dict[str, set[str]] = {}
    for user, a in zip(users, answers, strict=True):
        arms.setdefault(user, set()).add(a.headers["X-GRPO-Arm"])
        assert a.json()["model"] == f"{a.headers['X-GRPO-Arm']}-v{a.headers['X-GRPO-Version']}"
    assert all(len(seen) == 1 for seen in arms.values())
    challenger_users = sum(CHALLENGER in seen for seen in arms.values())
    low, high = binom.interval(0.99, 200, FRACTION)
    assert low <= challenger_users <= high
    log = logged(world)
    for a in answers:
        arm, version, copies = log[a.json()["id"]]
        assert (arm, version, copies) == (a.headers["X-GRPO-Arm"], a.headers["X-GRPO-Version"], 1)
    feedback = server.client.post("/v1/feedback", json={"id": answers[0].json()["id"], "score": 1.0})
    assert feedback.status_code == 200


def arm_text(server, arm: str, max_tokens: int = 8) -> tuple[str, str]:
    """(version, greedy text) of the first of a set of users that lands on `arm`."""
    for i in range(200):
        a = server.ask(f"probe-{i}", max_tokens)
        if a.headers["X-GRPO-Arm"] == arm:
            return a.headers["X-GRPO-Version"], a.json()["choices"][0]["message"]["content"]
    raise AssertionError(f"no probe user landed on {arm}")


def test_the_arms_answer_differently(server):
    assert arm_text(server, CHAMPION)[1] != arm_text(server, CHALLENGER)[1]


def test_an_alias_move_while_requests_flow_fails_none_and_the_new_adapter_serves(server, world):
    v1, v2, v3, v4 = world["versions"]
    before = arm_text(server, CHALLENGER)
    stop, statuses = threading.Event(), []

    def flow():
        i = 0
        while not stop.is_set():
            statuses.append(server.ask(f"flow-{i % 50}").status_code)
            i += 1

    threads = [threading.Thread(target=flow) for _ in range(4)]
    for t in threads:
        t.start()
    world["registry"].apply([AliasMove(CHALLENGER, v3)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(m["version"] == v3 for m in server.client.get("/v1/models").json()["data"]):
            break
        time.sleep(1)
    time.sleep(3)  # requests keep flowing across the unload of the old adapter
    stop.set()
    for t in threads:
        t.join()
    assert statuses and set(statuses) == {200}
    after = arm_text(server, CHALLENGER)
    assert after[0] == v3 and after[1] != before[1]

    world["registry"].apply([AliasMove(CHALLENGER, v4)])  # trained on another base
    time.sleep(8)  # several polls
    assert arm_text(server, CHALLENGER)[0] == v3
    assert "trained on base" in server.output.read_text()


def test_a_stream_from_the_engine_is_relayed_and_logged_before_its_done(server, world):
    import json

    body = {"messages": PROMPT, "max_tokens": 6, "temperature": 0, "user": "streamer", "stream": True}
    chunks, at_done = [], None
    with server.client.stream("POST", "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        arm, version = answer.headers["X-GRPO-Arm"], answer.headers["X-GRPO-Version"]
        for line in answer.iter_lines():
            if line == "data: [DONE]":
                at_done = logged(world)  # read the instant [DONE] arrives
                break
            if line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
    (request_id,) = {c["id"] for c in chunks}
    assert at_done[request_id] == (arm, version, 1)
    assert {c["model"] for c in chunks} == {f"{arm}-v{version}"}
    assert not [c for c in chunks if "usage" in c]  # asked of the engine for the log, not passed on unasked
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    engine = create_engine(world["log_url"])
    with engine.connect() as c:
        completion, tokens = c.execute(
            text("SELECT completion, completion_tokens FROM ab_requests WHERE id = :i"), {"i": request_id}
        ).one()
    engine.dispose()
    assert completion == streamed and 1 <= tokens <= 6
    whole = server.ask("streamer", 6)  # greedy: the same user, the same adapter, the same answer
    assert whole.headers["X-GRPO-Arm"] == arm and whole.json()["choices"][0]["message"]["content"] == streamed


def test_kill_9_loses_no_answered_request_and_a_restart_serves(server, world):
    answered, stop = [], threading.Event()

    def flow(n):
        client = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer test-key"}, timeout=60)
        i = 0
        while not stop.is_set():
            try:
                a = client.post(
                    "/v1/completions", json={"prompt": "What is 2 + 2?", "max_tokens": 2, "user": f"kill-{n}-{i}"}
                )
            except httpx.HTTPError:
                break  # the router is gone
            if a.status_code == 200:
                answered.append(a.json()["id"])
            i += 1

    threads = [threading.Thread(target=flow, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    while len(answered) < 100:
        time.sleep(0.1)
    engine_port = int(
        next(line for line in server.output.read_text().splitlines() if "starting the engine" in line)
        .split("http://127.0.0.1:")[1]
        .split()[0]
    )
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    stop.set()
    for t in threads:
        t.join()
    log = logged(world)
    assert all(log[i][2] == 1 for i in answered), "an answered request is missing from the log or there twice"
    assert engine_gone(f"http://127.0.0.1:{engine_port}", 120), (
        f"the engine on port {engine_port} outlived its killed router"
    )

    again = Server(world, free_port())
    try:
        again.wait_ready()
        assert again.ask("after-restart").status_code == 200
        assert all(logged(world)[i][2] == 1 for i in answered)
    finally:
        again.stop()
