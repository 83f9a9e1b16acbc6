"""The router's pure parts (assignment, validation, keys) and its HTTP surface where no engine is needed: a real
Starlette app over a real SQLite request log; a request the engine cannot answer (nothing listens on its port)
is logged as an error. The engine itself (vLLM) is exercised in tests/integration/test_serve_engine.py (slow)."""

import contextlib
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from scipy.stats import binom
from sqlalchemy import text
from starlette.testclient import TestClient

from grpo_pipeline.configs.ab import ABConfig
from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.tasks.serve import ab_spool
from grpo_pipeline.tasks.serve.ab_log import RequestLog, RequestRow, metadata
from grpo_pipeline.tasks.serve.adapters import Adapter, refusal
from grpo_pipeline.tasks.serve.api import (
    CHALLENGER,
    CHAMPION,
    BadRequest,
    api_key_policy,
    arm_for,
    assignment_hash,
    assignment_key,
    authorized,
    parse_object,
    validate_feedback,
    validate_generation,
)
from grpo_pipeline.tasks.serve.router import Router
from tests.serve_world import base_a_router


def share_in_interval(hits: int, n: int, p: float, level: float = 0.99) -> bool:
    low, high = binom.interval(level, n, p)
    return low <= hits <= high


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_the_challenger_share_of_1000_requests_from_200_users_is_binomial_and_each_user_sees_one_arm(fraction):
    seen: dict[str, set[str]] = {}
    requests = [f"user-{i % 200}" for i in range(1000)]  # 200 users, 5 requests each, interleaved
    for user in requests:
        seen.setdefault(user, set()).add(arm_for(assignment_hash(user), fraction))
    assert all(len(arms) == 1 for arms in seen.values())
    challenger_requests = sum(CHALLENGER in seen[u] for u in requests)
    challenger_users = sum(CHALLENGER in arms for arms in seen.values())
    # users are the independent draws (a user's 5 requests share one arm): the user share is binomial(200)
    assert share_in_interval(challenger_users, 200, fraction)
    assert challenger_requests == 5 * challenger_users
    # and over 1,000 distinct keys, binomial(1000)
    assert share_in_interval(
        sum(arm_for(assignment_hash(f"k{i}"), fraction) == CHALLENGER for i in range(1000)), 1000, fraction
    )


def test_the_fraction_bounds_send_everyone_to_one_arm():
    keys = [assignment_hash(f"u{i}") for i in range(500)]
    assert {arm_for(k, 0.0) for k in keys} == {CHAMPION}
    assert {arm_for(k, 1.0) for k in keys} == {CHALLENGER}


def test_raising_the_fraction_moves_users_to_the_challenger_only():
    keys = [assignment_hash(f"u{i}") for i in range(500)]
    before = {k for k in keys if arm_for(k, 0.1) == CHALLENGER}
    after = {k for k in keys if arm_for(k, 0.3) == CHALLENGER}
    assert before < after


def test_the_key_comes_from_the_header_then_safety_identifier_then_user():
    body = {"user": "u", "safety_identifier": "s"}
    assert assignment_key(body, {"x-assignment-key": "h"}) == "h"
    assert assignment_key(body, {}) == "s"
    assert assignment_key({"user": "u"}, {}) == "u"
    assert assignment_key({}, {}) is None


def test_fraction_outside_0_1_is_refused_by_the_config():
    with pytest.raises(ValueError, match="challenger_fraction"):
        ABConfig(challenger_fraction=1.5)
    with pytest.raises(ValueError, match="max_lora_rank=12 is not one vLLM takes"):
        ABConfig.model_validate({"serve": {"max_lora_rank": 12}})


@pytest.mark.parametrize(
    ("kind", "body", "reason"),
    [
        ("chat", {}, "messages must be a non-empty list"),
        ("chat", {"messages": [{"content": "no role"}]}, "messages must be a non-empty list"),
        ("chat", {"messages": "hi"}, "messages must be a non-empty list"),
        ("completions", {"prompt": 3}, "prompt must be a string"),
        ("completions", {"prompt": []}, "prompt must be a string"),
        ("completions", {"prompt": "x", "user": 7}, "user must be a string"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream must be true or false"),
        ("completions", {"prompt": "x", "stream": True, "stream_options": [1]}, "stream_options must be an object"),
    ],
)
def test_malformed_generation_bodies_are_refused_with_the_reason(kind, body, reason):
    with pytest.raises(BadRequest, match=reason):
        validate_generation(kind, body)


def test_well_formed_bodies_pass():
    assert validate_generation("completions", {"prompt": [[1, 2], "text"]})
    assert validate_generation("chat", {"messages": [{"role": "user", "content": "hi"}], "user": "u"})


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{", "not valid JSON"),
        (b"\xff", "not valid JSON"),
        (b'"a"', "must be a JSON object, got a str"),
    ],
)
def test_bodies_that_are_not_json_objects_are_refused(raw, reason):
    with pytest.raises(BadRequest, match=reason):
        parse_object(raw)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"score": 1}, "id must be"),
        ({"id": "", "score": 1}, "id must be"),
        ({"id": "x" * 65, "score": 1}, "id must be"),
        ({"id": "a"}, "needs a score .* or a reference"),
        ({"id": "a", "score": 1, "reference": "1"}, "score or reference, not both"),
        ({"id": "a", "reference": " "}, "reference must be a non-empty string"),
        ({"id": "a", "reference": ["1"]}, "reference must be a non-empty string"),
        ({"id": "a", "score": "1"}, "score must be a finite number"),
        ({"id": "a", "score": True}, "score must be a finite number"),
        ({"id": "a", "score": float("inf")}, "score must be a finite number"),
        ({"id": "a", "score": 1, "note": "x"}, "unknown fields"),
    ],
)
def test_feedback_bodies_are_checked(body, reason):
    with pytest.raises(BadRequest, match=reason):
        validate_feedback(body)


def test_the_api_key_is_required_off_loopback_and_checked():
    assert api_key_policy({"GRPO_SERVE_API_KEY": "k"}, "0.0.0.0") == "k"
    with pytest.raises(ValueError, match="set but empty"):
        api_key_policy({"GRPO_SERVE_API_KEY": " "}, "127.0.0.1")
    with pytest.raises(ValueError, match="needs an API key"):
        api_key_policy({}, "10.0.0.5")
    assert authorized("Bearer k", "k") and authorized("bearer k", "k")
    assert not authorized("Bearer x", "k") and not authorized(None, "k") and not authorized("k", "k")
    assert authorized(None, None)


def adapter(alias="champion", version="1", base="base-a", sha="aaa", rank=8) -> Adapter:
    return Adapter(alias, version, Path("/nowhere"), base, sha, rank)


def test_an_adapter_of_another_base_or_a_higher_rank_is_refused():
    assert refusal(adapter(), "base-a", "aaa", 16) is None
    assert "trained on base base-b" in refusal(adapter(base="base-b", sha="bbb"), "base-a", "aaa", 16)
    assert "rank 32" in refusal(adapter(rank=32), "base-a", "aaa", 16)
    assert refusal(adapter(sha=None), "base-a", None, 16) is None  # no hashes: the references decide


# ------------------------------------------------------------------------------------------------ the HTTP surface


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def make_router(tmp_path, request_log, fraction: float = 0.5, api_key=None, **kw) -> Router:
    """A router over `request_log` serving champion v1 and (with a fraction) challenger v2 on base-a."""
    router = base_a_router(request_log, tmp_path / "unlogged.jsonl", fraction=fraction, api_key=api_key, **kw)
    router.arms = {CHAMPION: adapter(), CHALLENGER: adapter("challenger", "2")} if fraction else {CHAMPION: adapter()}
    return router


def app_of(router: Router, engine_url: str):
    """The router's app with the lifespan `serve` gives it: the engine's HTTP client, here on `engine_url`."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async with httpx.AsyncClient(base_url=engine_url) as client:
            router.client = client
            yield

    return router.app(lifespan)


class StandInEngine(BaseHTTPRequestHandler):
    """A real HTTP server in vLLM's place speaking its OpenAI shapes: a whole answer or server-sent events (one
    word a chunk, `usage` last when `stream_options.include_usage`), the text naming the adapter asked for, so
    the arms answer differently. The prompt "forever" streams until the reader leaves; "fail" answers 500."""

    received: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append(body)
        chat = self.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "fail":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"engine crashed")
            return
        words = f"{body['model']} says the answer is 42".split(" ")  # the final number is the answer
        usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
        if not body.get("stream"):
            text = " ".join(words)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            )
            self._send(
                200, json.dumps({"id": "cmpl-engine", "model": body["model"], "choices": [choice], "usage": usage})
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for i in range(100_000 if prompt == "forever" else len(words)):
                word = words[i % len(words)] + " "
                choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                self._event({"id": "cmpl-engine", "model": body["model"], "choices": [choice], "usage": None})
                if prompt == "forever":
                    time.sleep(0.005)
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({"id": "cmpl-engine", "model": body["model"], "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router closed its stream

    def _event(self, chunk: dict) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()

    def _send(self, status: int, text: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(text.encode())))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def engine_url():
    StandInEngine.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInEngine)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def request_log(tmp_path):
    log = RequestLog.open(f"sqlite:///{tmp_path / 'ab.sqlite'}")
    yield log
    log.close()


@pytest.fixture
def served(tmp_path, request_log):
    """A router whose engine is absent (its port closed), over a real SQLite log, champion and challenger set."""
    router = make_router(tmp_path, request_log, api_key="secret")
    with TestClient(
        app_of(router, f"http://127.0.0.1:{closed_port()}"), headers={"Authorization": "Bearer secret"}
    ) as client:
        yield router, client, request_log


@contextlib.contextmanager
def live(router: Router, engine_url: str):
    """The router under uvicorn on a free loopback port, as `serve` runs it: real sockets, so a client can stream
    and hang up. Yields its URL."""
    import uvicorn

    port = closed_port()
    server = uvicorn.Server(
        uvicorn.Config(app_of(router, engine_url), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def rows(request_log) -> list[dict]:
    with request_log.engine.connect() as c:
        return [dict(r._mapping) for r in c.execute(text("SELECT * FROM ab_requests"))]


def test_requests_without_the_key_get_401(served):
    _, client, _ = served
    for path in ("/v1/models",):
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    answer = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": ""})
    assert answer.status_code == 401 and "GRPO_SERVE_API_KEY" in answer.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # load balancers probe without a key


def test_models_lists_the_served_aliases(served):
    _, client, _ = served
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["version"], m["engine_name"]) for m in models] == [
        ("champion", "1", "champion-v1"),
        ("challenger", "2", "challenger-v2"),
    ]


def test_malformed_bodies_get_400_with_the_reason_and_the_server_keeps_serving(served):
    _, client, request_log = served
    for raw in (b"{", b"[]", b'{"messages": 3}'):
        answer = client.post("/v1/chat/completions", content=raw)
        assert answer.status_code == 400 and answer.json()["error"]["message"]
    assert client.get("/v1/models").status_code == 200
    assert request_log.counts() == {}  # refused requests were never answered: not logged


def test_a_request_the_engine_cannot_answer_is_logged_as_an_error_with_its_arm(served):
    _, client, request_log = served
    answer = client.post("/v1/completions", json={"prompt": "hi", "user": "alice"})
    assert answer.status_code == 502
    arm, version = answer.headers["X-GRPO-Arm"], answer.headers["X-GRPO-Version"]
    assert (arm, version) == (
        (CHALLENGER, "2") if arm_for(assignment_hash("alice"), 0.5) == CHALLENGER else (CHAMPION, "1")
    )
    assert request_log.counts() == {arm: {version: {"requests": 1, "errors": 1, "feedback": 0}}}
    request_id = answer.json()["id"]
    with request_log.engine.connect() as c:
        stored = c.execute(text("SELECT assignment FROM ab_requests WHERE id = :i"), {"i": request_id}).scalar()
    assert stored == assignment_hash("alice")  # the key's hash, never the key


@pytest.mark.parametrize("engine_body", [b"null", b"[1, 2]", b"<html>busy</html>"])
def test_an_engine_answer_that_is_not_a_json_object_is_the_arms_502_and_is_logged(tmp_path, request_log, engine_body):
    """A real HTTP server in the engine's place answers 200 with something other than a completion object."""

    class Engine(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(engine_body)))
            self.end_headers()
            self.wfile.write(engine_body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    router = make_router(tmp_path, request_log, fraction=0.0)
    try:
        with TestClient(app_of(router, f"http://127.0.0.1:{server.server_address[1]}")) as client:
            answer = client.post("/v1/completions", json={"prompt": "hi", "user": "alice"})
        assert answer.status_code == 502
        assert "without a JSON object" in answer.json()["error"]["message"]
        assert request_log.counts() == {CHAMPION: {"1": {"requests": 1, "errors": 1, "feedback": 0}}}
    finally:
        server.shutdown()


def test_a_router_serves_nothing_before_its_lifespan_opens_the_engine_client(tmp_path):
    router = make_router(tmp_path, None)
    with pytest.raises(RuntimeError, match="opened by the lifespan"):
        _ = router.client


def test_feedback_joins_known_ids_and_refuses_the_rest(served):
    _, client, request_log = served
    request_log.record(
        RequestRow(
            id="grpo-known",
            arm="champion",
            version="1",
            latency_s=0.1,
            prompt_tokens=3,
            completion_tokens=4,
            error=False,
        )
    )
    assert client.post("/v1/feedback", json={"id": "grpo-known", "score": 1}).json()["status"] == "stored"
    assert client.post("/v1/feedback", json={"id": "grpo-unknown", "score": 1}).status_code == 404
    assert client.post("/v1/feedback", content=b'{"id": "grpo-known", "score": NaN}').status_code == 400
    assert client.post("/v1/feedback", content=b"nope").status_code == 400
    assert request_log.counts()["champion"]["1"]["feedback"] == 1


def test_a_store_failing_mid_run_keeps_serving_spools_the_rows_and_replays_them(served, tmp_path):
    router, client, request_log = served
    with request_log.engine.begin() as c:  # the store breaks: its table is gone
        c.execute(text("DROP TABLE ab_feedback"))
        c.execute(text("DROP TABLE ab_requests"))
    ids = [client.post("/v1/completions", json={"prompt": "hi"}).json()["id"] for _ in range(3)]
    assert router.unlogged == 3 and ab_spool.pending(router.spool) == 3
    assert [json.loads(line)["id"] for line in router.spool.read_text().splitlines()] == ids
    metadata.create_all(request_log.engine)  # the store is back
    fourth = client.post("/v1/completions", json={"prompt": "hi"}).json()["id"]
    with request_log.engine.connect() as c:
        logged = c.execute(text("SELECT id FROM ab_requests")).scalars().all()
    assert sorted(logged) == sorted([*ids, fourth])
    assert ab_spool.pending(router.spool) == 0 and router.unlogged == 0
    assert ab_spool.replay(router.spool, request_log) == 0  # replaying again writes nothing twice


def test_an_alias_move_to_another_base_is_refused_and_the_old_adapter_keeps_serving(served):
    import asyncio

    router, client, _ = served
    reason = asyncio.run(router.swap(CHALLENGER, adapter("challenger", "3", base="base-b", sha="bbb")))
    assert "trained on base base-b" in reason
    assert router.arms[CHALLENGER].version == "2"
    assert [m["version"] for m in client.get("/v1/models").json()["data"]] == ["1", "2"]


# ------------------------------------------------------------------------------------------------ answers, streams


def events(lines) -> list:
    """The `data:` payloads of a server-sent event stream, JSON decoded ("[DONE]" kept as it is)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_whole_answer_is_logged_with_its_text_and_the_engines_token_counts(tmp_path, request_log, engine_url):
    router = make_router(tmp_path, request_log, fraction=0.0)
    with TestClient(app_of(router, engine_url)) as client:
        answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200
    body = answer.json()
    assert body["model"] == "champion-v1" and body["id"].startswith("grpo-")
    [row] = rows(request_log)
    assert row["id"] == body["id"] and row["completion"] == "champion-v1 says the answer is 42"
    assert (row["prompt_tokens"], row["completion_tokens"], row["error"]) == (3, 6, False)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_stream_is_relayed_with_the_arm_and_logged_before_its_done(tmp_path, request_log, engine_url, kind):
    router = make_router(tmp_path, request_log, api_key="k")
    path, prompt = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        if kind == "chat"
        else ("/v1/completions", {"prompt": "hi"})
    )
    with live(router, engine_url) as url, httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}) as client:
        with client.stream("POST", path, json=prompt | {"stream": True, "user": "bob"}) as answer:
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
            arm, version = answer.headers["X-GRPO-Arm"], answer.headers["X-GRPO-Version"]
            seen = []
            for line in answer.iter_lines():
                seen.append(line)
                if line == "data: [DONE]":
                    logged = rows(request_log)  # read the instant [DONE] arrives: the row is already there
                    break
    chunks = events(seen)
    assert chunks[-1] == "[DONE]" and len(chunks) == 7  # six words, no usage chunk: the client did not ask
    assert arm == (CHALLENGER if arm_for(assignment_hash("bob"), 0.5) == CHALLENGER else CHAMPION)
    model = f"{arm}-v{version}"
    assert {c["id"] for c in chunks[:-1]} == {logged[0]["id"]} and {c["model"] for c in chunks[:-1]} == {model}
    assert all("usage" not in c for c in chunks[:-1])
    text_of = (lambda c: c["choices"][0]["delta"]["content"]) if kind == "chat" else (lambda c: c["choices"][0]["text"])
    assert "".join(map(text_of, chunks[:-1])) == f"{model} says the answer is 42 "
    [row] = logged
    assert (row["arm"], row["version"], row["error"]) == (arm, version, False)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 6)  # from the usage the router asked for
    assert row["completion"] == f"{model} says the answer is 42 "
    assert StandInEngine.received[-1]["stream_options"] == {"include_usage": True}


def test_a_stream_passes_usage_on_when_the_client_asks_for_it(tmp_path, request_log, engine_url):
    router = make_router(tmp_path, request_log, fraction=0.0)
    with TestClient(app_of(router, engine_url)) as client:
        answer = client.post(
            "/v1/completions", json={"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
        )
    chunks = events(answer.text.splitlines())
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["id"] == rows(request_log)[0]["id"]


def test_a_client_that_leaves_mid_stream_is_logged_once_with_the_error_flag(tmp_path, request_log, engine_url):
    router = make_router(tmp_path, request_log, fraction=0.0)
    with live(router, engine_url) as url, httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "forever", "stream": True}) as answer:
            request_id = None
            for i, line in enumerate(answer.iter_lines()):
                if line.startswith("data: "):
                    request_id = json.loads(line[len("data: ") :])["id"]
                if i >= 6:
                    break  # leave: the response is closed with the engine still streaming
        deadline = time.monotonic() + 60
        while not rows(request_log) and time.monotonic() < deadline:
            time.sleep(0.05)
        logged = rows(request_log)
        assert len(logged) == 1 and logged[0]["id"] == request_id and logged[0]["error"]
        assert logged[0]["completion_tokens"] >= 3 and logged[0]["completion"] is None
        assert router.inflight["champion-v1"] == 0  # a drain before an unload does not wait on it
        # the router still serves, and the disconnect was written once
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert [r["error"] for r in rows(request_log)].count(True) == 1


def test_a_stream_the_engine_refuses_is_the_arms_502_and_is_logged(tmp_path, request_log, engine_url):
    router = make_router(tmp_path, request_log, fraction=0.0)
    with TestClient(app_of(router, engine_url)) as client:
        answer = client.post("/v1/completions", json={"prompt": "fail", "stream": True})
        assert answer.status_code == 502 and "HTTP 500" in answer.json()["error"]["message"]
    [row] = rows(request_log)
    assert row["id"] == answer.json()["id"] and row["error"]


def test_feedback_with_a_reference_is_scored_by_the_pipelines_rewards(tmp_path, request_log, engine_url):
    rewards = RewardSet(names=("correct_answer", "number_only"), weights=(1.0, 0.5))
    router = make_router(tmp_path, request_log, fraction=0.0, rewards=rewards)
    with TestClient(app_of(router, engine_url)) as client:
        request_id = client.post("/v1/completions", json={"prompt": "hi"}).json()["id"]  # "... the answer is 42"
        right = client.post("/v1/feedback", json={"id": request_id, "reference": "42"})
        assert right.status_code == 200
        assert right.json()["rewards"] == {"correct_answer": 1.0, "number_only": 0.0, "total": 1.0}
        assert right.json()["score"] == 1.0
        wrong = client.post("/v1/feedback", json={"id": request_id, "reference": 41})  # replaces the earlier
        assert wrong.json()["score"] == 0.0
        assert client.post("/v1/feedback", json={"id": "grpo-nope", "reference": "42"}).status_code == 404
        both = client.post("/v1/feedback", json={"id": request_id, "score": 1, "reference": "42"})
        assert both.status_code == 400 and "not both" in both.json()["error"]["message"]
        assert client.post("/v1/feedback", json={"id": request_id}).status_code == 400
    with request_log.engine.connect() as c:
        assert c.execute(text("SELECT score FROM ab_feedback")).scalars().all() == [0.0]


def test_reference_feedback_needs_the_logged_completion(tmp_path, request_log, engine_url):
    rewards = RewardSet(names=("correct_answer",))
    router = make_router(tmp_path, request_log, fraction=0.0, rewards=rewards, log_completions=False)
    with TestClient(app_of(router, engine_url)) as client:
        request_id = client.post("/v1/completions", json={"prompt": "hi"}).json()["id"]
        refused = client.post("/v1/feedback", json={"id": request_id, "reference": "42"})
        assert refused.status_code == 400 and "ab.serve.log_completions" in refused.json()["error"]["message"]
        assert client.post("/v1/feedback", json={"id": request_id, "score": 1}).status_code == 200
    assert rows(request_log)[0]["completion"] is None


def test_a_log_from_before_completions_were_kept_gets_the_column(tmp_path):
    from sqlalchemy import create_engine

    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    old = create_engine(url)
    with old.begin() as c:
        c.execute(
            text(
                "CREATE TABLE ab_requests (id VARCHAR(64) PRIMARY KEY, created_at DATETIME NOT NULL, "
                "arm VARCHAR(32) NOT NULL, version VARCHAR(32) NOT NULL, latency_s FLOAT NOT NULL, "
                "prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, error BOOLEAN NOT NULL, "
                "assignment VARCHAR(16))"
            )
        )
        c.execute(text("INSERT INTO ab_requests VALUES ('old', '2026-01-01', 'champion', '1', 0.1, 1, 1, 0, NULL)"))
    old.dispose()
    log = RequestLog.open(url)
    try:
        assert log.completion("old") == (None, 1)
        log.record(RequestRow("new", "champion", "1", 0.1, 1, 2, False, completion="7"))
        assert log.completion("new") == ("7", 2)
        RequestLog.open(url).close()  # opening again finds the column: nothing to add
    finally:
        log.close()


# ------------------------------------------------------------------------------------------------ the command


def serve_cli(*args: str, env: dict | None = None):
    from typer.testing import CliRunner

    from grpo_pipeline.cli import app

    return CliRunner().invoke(app, ["serve", *args], env=env)


# What the checks before these need: a registry named (a server: naming one creates nothing) and an engine Python
# that exists (this one: none of these tests gets as far as starting it).
ENGINE = ("--set", f"ab.serve.engine_python={sys.executable}")


def _server(uri: str | None = None) -> tuple[str, ...]:
    return ("--set", f"tracking.mlflow_tracking_uri={uri or f'http://127.0.0.1:{closed_port()}'}", *ENGINE)


def test_serve_off_loopback_without_a_key_exits_2(monkeypatch):
    monkeypatch.delenv("GRPO_SERVE_API_KEY", raising=False)
    result = serve_cli("--host", "0.0.0.0", *_server())
    assert result.exit_code == 2 and "needs an API key" in result.output


def test_serve_with_the_log_store_unreachable_exits_2_naming_it(monkeypatch):
    monkeypatch.setenv("GRPO_AB_LOG_URL", "sqlite:////proc/no-such-dir/ab.sqlite")
    result = serve_cli(*_server())
    assert result.exit_code == 2 and "/proc/no-such-dir/ab.sqlite is unreachable" in result.output


def test_serve_with_the_registry_unreachable_exits_2_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_AB_LOG_URL", f"sqlite:///{tmp_path / 'ab.sqlite'}")
    uri = f"http://127.0.0.1:{closed_port()}"
    result = serve_cli(*_server(uri), "--set", "tracking.registered_model=m")
    assert result.exit_code == 2 and f"the registry m at {uri} did not answer" in result.output


@pytest.mark.slow  # an MLflow SQLite registry: its migrations take a minute on a busy machine
def test_serve_without_a_champion_exits_2(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("GRPO_AB_LOG_URL", f"sqlite:///{tmp_path / 'ab.sqlite'}")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.MlflowClient(uri).search_registered_models()  # a registry, with no model in it
    result = serve_cli(*_server(uri), "--set", "tracking.registered_model=nothing-here")
    assert result.exit_code == 2 and "no champion alias in the registry nothing-here" in result.output


def test_serve_with_a_log_store_of_another_schema_exits_2_naming_it(tmp_path, monkeypatch):
    from sqlalchemy import create_engine

    url = f"sqlite:///{tmp_path / 'other.sqlite'}"
    with create_engine(url).begin() as c:
        c.execute(text("CREATE TABLE ab_feedback (request_id TEXT, verdict TEXT)"))
    monkeypatch.setenv("GRPO_AB_LOG_URL", url)
    result = serve_cli(*_server())
    assert result.exit_code == 2, result.output
    assert "has a table ab_feedback that is not the A/B log's" in result.output and "other.sqlite" in result.output
