"""The rewards that call out: `remote_verifier` against a real HTTP server on 127.0.0.1 (a good answer, a 500,
a timeout, a wrong-length reply, bounded concurrency), and `reward_model` on a tiny random classifier."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_pipeline.trainer.rewards import RewardError, resolve_reward

pytestmark = pytest.mark.integration


class Verifier(BaseHTTPRequestHandler):
    """Scores 1.0 where the completion is the answer; the path picks a behaviour."""

    calls: dict[str, int] = {}
    in_flight = 0  # /count requests between their arrival and the moment their reply starts
    most_in_flight = 0
    lock = threading.Lock()
    release = threading.Event()

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.calls[self.path] = self.calls.get(self.path, 0) + 1
            n_call = self.calls[self.path]
        if self.path == "/hang":
            self.release.wait(30)  # longer than any client timeout in these tests
            return
        if self.path == "/count":
            self._hold_and_count()
        if self.path == "/error" or (self.path == "/flaky" and n_call == 1):
            self.send_error(500, "verifier crashed")
            return
        if self.path == "/bad-request":
            self.send_error(400, "no such task")
            return
        scores = [float(c.strip() == a) for c, a in zip(body["completions"], body["answer"], strict=True)]
        if self.path == "/short":
            scores = scores[:-1]
        reply = json.dumps({"scores": scores} if self.path != "/bare" else scores).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def _hold_and_count(self):
        """Holds a /count request a moment, counted as in flight until just before its reply is written.

        The client sends a worker's next request only after it has read this reply, so a request is never
        counted beside the one that freed its worker: the count measures the client's bound, not the server's
        thread scheduling (counting until after the write let a worker's next request overlap its last)."""
        with self.lock:
            Verifier.in_flight += 1
            Verifier.most_in_flight = max(Verifier.most_in_flight, Verifier.in_flight)
        try:
            self.release.wait(0.05)  # so several are in flight together
        finally:
            with self.lock:
                Verifier.in_flight -= 1


@pytest.fixture()
def server():
    Verifier.calls, Verifier.in_flight, Verifier.most_in_flight = {}, 0, 0
    Verifier.release = threading.Event()  # a handler of an earlier test still waiting holds the old one
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Verifier)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    Verifier.release.set()
    httpd.shutdown()
    httpd.server_close()


def _verifier(url, **args):
    return resolve_reward("remote_verifier", {"url": url, "backoff_s": 0.0, **args})


def test_good_answers_are_scored_in_order(server):
    fn = _verifier(server + "/good", batch_size=2, concurrency=2)
    assert fn(["72", " 5", "no"], answer=["72", "5", "3"], key=["a", "b", "c"]) == [1.0, 1.0, 0.0]
    assert _verifier(server + "/bare")(["1"], answer=["1"]) == [1.0]  # a bare list of scores is a reply too


def test_a_500_is_retried_then_named(server):
    assert _verifier(server + "/flaky", retries=1)(["72"], answer=["72"]) == [1.0]
    assert Verifier.calls["/flaky"] == 2
    with pytest.raises(
        RewardError,
        match=r"'remote_verifier' at http://127\.0\.0\.1:\d+/error failed for row 0 "
        r"of 1: HTTP 500 .*after 3 attempts",
    ):
        _verifier(server + "/error", retries=2)(["72"], answer=["72"])
    assert Verifier.calls["/error"] == 3


def test_a_client_error_is_not_retried(server):
    with pytest.raises(RewardError, match="HTTP 400"):
        _verifier(server + "/bad-request", retries=3)(["72"], answer=["72"])
    assert Verifier.calls["/bad-request"] == 1


def test_a_timeout_is_an_error_that_names_the_verifier(server):
    with pytest.raises(
        RewardError,
        match=r"'remote_verifier' at .*/hang failed for row 0 of 1: no reply within "
        r"0\.2 s \(after 2 attempts\)",
    ):
        _verifier(server + "/hang", timeout_s=0.2, retries=1)(["72"], answer=["72"])


def test_a_wrong_length_reply_is_an_error(server):
    with pytest.raises(RewardError, match="rows 0-2 of 3: the reply has 2 scores for 3 completions"):
        _verifier(server + "/short", batch_size=8)(["1", "2", "3"], answer=["1", "2", "3"])
    assert Verifier.calls["/short"] == 1  # the service would answer the same again


def test_the_fallback_is_counted_never_silent(server):
    logged = []
    fn = _verifier(server + "/error", retries=0, fallback=-1.0, batch_size=2)
    scores = fn(["a", "b", "c"], answer=["a", "b", "c"], log_metric=lambda k, v: logged.append((k, v)))
    assert scores == [-1.0, -1.0, -1.0]
    assert logged == [("remote_verifier/fallbacks", 3.0)]
    good = _verifier(server + "/good", fallback=0.0)
    good(["a"], answer=["a"], log_metric=lambda k, v: logged.append((k, v)))
    assert logged[-1] == ("remote_verifier/fallbacks", 0.0)


def test_concurrency_is_bounded(server):
    scores = _verifier(server + "/count", concurrency=4)(
        [str(i) for i in range(16)], answer=[str(i) for i in range(16)]
    )
    assert scores == [1.0] * 16
    assert Verifier.calls["/count"] == 16 and 1 <= Verifier.most_in_flight <= 4


def test_an_unreachable_verifier_is_named():
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(
        RewardError,
        match=rf"'remote_verifier' at http://127.0.0.1:{port}/score failed for row 0 of 1: "
        r".*Connection.*\(after 1 attempt\)",
    ):
        _verifier(f"http://127.0.0.1:{port}/score", retries=0)(["1"], answer=["1"])


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny random Llama sequence classifier (one label) with a real tokenizer, made here."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from tests.tiny_model import create_random_model

    path = create_random_model(tmp_path_factory.mktemp("rm"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig.from_pretrained(path, num_labels=1)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(path)
    return path, tokenizer, model.eval()


def test_reward_model_scores_prompt_and_completion_in_batches(classifier):
    import torch

    path, tokenizer, model = classifier
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}]] * 3
    completions = [[{"role": "assistant", "content": c}] for c in ("5", "It is 5, since 2 + 3 = 5.", "7")]
    one = resolve_reward("reward_model", {"model": str(path), "batch_size": 1})(completions, prompts=prompts)
    three = resolve_reward("reward_model", {"model": str(path), "batch_size": 3})(completions, prompts=prompts)
    assert len(one) == 3 and all(math.isfinite(s) for s in one)
    assert three == pytest.approx(one, abs=1e-4)  # padding does not move a score
    text = tokenizer.apply_chat_template(prompts[0] + completions[2], tokenize=False)
    with torch.inference_mode():
        direct = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
    assert one[2] == pytest.approx(direct, abs=1e-4)
    assert len(set(round(s, 5) for s in one)) == 3  # different completions, different scores


def test_reward_model_that_cannot_load_is_named(tmp_path):
    with pytest.raises(RewardError, match="reward_model: cannot load"):
        resolve_reward("reward_model", {"model": str(tmp_path / "absent")})(["x"])


# ------------------------------------------------------------- a hostile or broken verifier: what it cannot do


class Hostile(BaseHTTPRequestHandler):
    """Redirects, trickles, floods; `/auth` scores only with the right Authorization header."""

    stop = threading.Event()

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        try:
            getattr(self, "_" + self.path.strip("/").replace("-", "_"))()
        except (BrokenPipeError, ConnectionResetError):  # the client hung up: what it should do
            pass

    def _redirect(self):
        self.send_response(307)  # 307 keeps the method and body: a client that follows it re-sends everything
        self.send_header("Location", self.headers["X-Redirect-To"])
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _trickle(self):
        """Headers at once, then one byte of the body every 50 ms: each socket read is quick, the reply endless."""
        self.send_response(200)
        self.end_headers()
        while not self.stop.wait(0.05):
            self.wfile.write(b" ")
            self.wfile.flush()

    def _trickle_headers(self):
        self.wfile.write(b"HTTP/1.0 200 OK\r\n")
        while not self.stop.wait(0.05):
            self.wfile.write(b"X-Slow: 1\r\n")
            self.wfile.flush()

    def _flood(self, declared=False):
        """100 MB, made as it is sent (never held here): with no length, the reply ends when the connection does."""
        self.send_response(200)
        if declared:
            self.send_header("Content-Length", str(100_000_000))
        self.end_headers()
        block = b" " * (64 << 10)
        for _ in range(100_000_000 // len(block)):
            if self.stop.is_set():
                return
            self.wfile.write(block)

    def _flood_declared(self):
        self._flood(declared=True)

    def _auth(self):
        ok = self.headers.get("Authorization") == "Bearer s3cret"
        reply = b"[1.0]" if ok else b""
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


@pytest.fixture()
def hostile():
    Hostile.stop = threading.Event()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    Hostile.stop.set()
    httpd.shutdown()
    httpd.server_close()


def test_a_redirect_is_refused_and_the_credential_goes_nowhere(hostile, server, monkeypatch):
    monkeypatch.setenv("VERIFIER_TOKEN", "Bearer s3cret")
    fn = _verifier(
        hostile + "/redirect",
        retries=2,
        headers={"X-Redirect-To": server + "/good"},
        headers_from_env={"Authorization": "VERIFIER_TOKEN"},
    )
    with pytest.raises(
        RewardError,
        match=rf"HTTP 307 .*a redirect to {server}/good, which is not followed .*set url "
        "to the verifier's own address",
    ):
        fn(["1"], answer=["1"])
    assert "/good" not in Verifier.calls  # nothing, and no token, reached the other server


@pytest.mark.parametrize("path", ["/trickle", "/trickle-headers"])
def test_a_trickling_server_cannot_hold_a_step_past_the_deadline(hostile, path):
    import time

    started = time.monotonic()
    with pytest.raises(RewardError, match=r"no reply within 0\.5 s \(after 2 attempts\)"):
        _verifier(hostile + path, timeout_s=0.5, retries=1)(["1"], answer=["1"])
    assert time.monotonic() - started < 10  # two attempts of 0.5 s, on a loaded machine; without the cap: for ever


@pytest.mark.parametrize("path", ["/flood", "/flood-declared"])
def test_a_100_mb_reply_is_cut_at_the_cap_without_being_held(hostile, path):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(RewardError, match=r"over max_reply_bytes=1,048,576.*raise max_reply_bytes"):
        _verifier(hostile + path, max_reply_bytes=1 << 20)(["1"], answer=["1"])
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 50_000  # far less than the 100 MB sent


def test_credentials_come_from_the_environment_never_the_config(hostile, monkeypatch):
    fn = _verifier(hostile + "/auth", headers_from_env={"Authorization": "VERIFIER_TOKEN"})
    monkeypatch.delenv("VERIFIER_TOKEN", raising=False)
    with pytest.raises(
        RewardError,
        match="headers_from_env.Authorization names the environment variable VERIFIER_TOKEN, which is not set",
    ):
        fn(["1"], answer=["1"])
    monkeypatch.setenv("VERIFIER_TOKEN", "Bearer s3cret")
    assert fn(["1"], answer=["1"]) == [1.0]
    for headers in ({"Authorization": "Bearer s3cret"}, {"X-Api-Key": "abc"}, {"X-Extra": "Basic dXNlcjpwYXNz"}):
        with pytest.raises(RewardError, match=r"looks like a credential, .*headers_from_env: \{"):
            _verifier(hostile + "/auth", headers=headers)  # refused when resolved: preflight, before any work


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file:///etc/passwd", "is not http:// or https://; the verifier is an HTTP service: give its http"),
        ("ftp://127.0.0.1/score", "is not http:// or https://"),
        ("http://user:pw@127.0.0.1:9/score", "holds a user or password"),
    ],
)
def test_only_http_urls_without_credentials(url, message):
    with pytest.raises(RewardError, match=message) as refused:
        _verifier(url)
    assert "pw" not in str(refused.value) and "root:" not in str(refused.value)
