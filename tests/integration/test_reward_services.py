"""The rewards that call out: `remote_verifier` against a real HTTP server on 127.0.0.1 (a good answer, a 500,
a timeout, a wrong-length reply, bounded concurrency), and `reward_model` on a tiny random classifier."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.rewards import RewardError, resolve_reward

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
    with pytest.raises(RewardError, match=r"'remote_verifier' at http://127\.0\.0\.1:\d+/error failed for row 0 "
                                          r"of 1: HTTP 500 .*after 3 attempts"):
        _verifier(server + "/error", retries=2)(["72"], answer=["72"])
    assert Verifier.calls["/error"] == 3


def test_a_client_error_is_not_retried(server):
    with pytest.raises(RewardError, match="HTTP 400"):
        _verifier(server + "/bad-request", retries=3)(["72"], answer=["72"])
    assert Verifier.calls["/bad-request"] == 1


def test_a_timeout_is_an_error_that_names_the_verifier(server):
    with pytest.raises(RewardError, match=r"'remote_verifier' at .*/hang failed for row 0 of 1: no reply within "
                                          r"0\.2 s \(after 2 attempts\)"):
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
    scores = _verifier(server + "/count", concurrency=4)([str(i) for i in range(16)], answer=[str(i) for i in range(16)])
    assert scores == [1.0] * 16
    assert Verifier.calls["/count"] == 16 and 1 <= Verifier.most_in_flight <= 4


def test_an_unreachable_verifier_is_named():
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RewardError, match=rf"'remote_verifier' at http://127.0.0.1:{port}/score failed for row 0 of 1: "
                                          r".*Connection.*\(after 1 attempt\)"):
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
