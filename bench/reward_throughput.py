"""Reward throughput: completions scored per second by `math_answer`, and by `remote_verifier` at concurrency 16
against concurrency 1, on a local HTTP verifier that answers after a fixed latency.

    python -m bench.reward_throughput            # ~1 min; saves bench/results/reward_throughput.json
    python -m bench.reward_throughput --tiny     # a few hundred completions: does it run?

`math_answer` is scored on completions built from GSM8K's own test solutions (`../shared/data/gsm8k`, when
present; synthetic chains of thought otherwise): half end on the right `#### n`, half on a wrong one, and a
tenth of each give a LaTeX `\\boxed{\\frac{..}{..}}` that goes to math-verify. A GRPO step scores
`per_device_train_batch_size` x processes completions, typically 64 to 512: the rate says whether a reward
can hold a step up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.harness import ROOT, save
from bench.table import Row

NAME = "reward_throughput"
GSM8K_TEST = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def completions(n: int) -> tuple[list[str], list[str]]:
    """n (completion, reference) pairs: real GSM8K solutions, half with a wrong final line, some in LaTeX."""
    rows = []
    if GSM8K_TEST.is_file():
        with open(GSM8K_TEST, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        rows = [{"answer": f"{a} + {a} = <<{a}+{a}={2 * a}>>{2 * a} apples.\n#### {2 * a}"} for a in range(100)]
    texts, refs = [], []
    for i in range(n):
        solution = rows[i % len(rows)]["answer"]
        body, _, ref = solution.rpartition("####")
        ref = ref.strip().replace(",", "")
        given = ref if i % 2 == 0 else str(int(float(ref)) + 1)
        if i % 10 == 0:
            texts.append(
                f"<think>{body.strip()}</think>\n<answer>\\boxed{{\\frac{{{2 * int(float(given))}}}{{2}}}}</answer>"
            )
        else:
            texts.append(f"{body.strip()}\nSo the answer is {given}.")
        refs.append(ref)
    return texts, refs


def time_math_answer(n: int, repeats: int) -> dict:
    from grpo_pipeline.trainer.rewards import resolve_reward

    fn = resolve_reward("math_answer")
    texts, refs = completions(n)
    fn(texts[:20], answer=refs[:20])  # math-verify's first import and grammar build are not the rate
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        scores = fn(texts, answer=refs)
        rates.append(n / (time.perf_counter() - started))
    return {
        "n": n,
        "completions_per_s": statistics.median(rates),
        "samples": rates,
        "mean_score": statistics.fmean(scores),
    }


class _Slow(BaseHTTPRequestHandler):
    latency_s = 0.02

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.latency_s)  # the fixed service time of a verifier (a sandbox run, a judge call)
        reply = json.dumps({"scores": [1.0] * len(body["completions"])}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


def time_remote(n: int, latency_s: float, repeats: int) -> dict:
    from grpo_pipeline.trainer.rewards import resolve_reward

    _Slow.latency_s = latency_s
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    texts = [f"completion {i}" for i in range(n)]
    out: dict = {"n": n, "latency_s": latency_s, "batch_size": 1}
    try:
        samples: dict[int, list[float]] = {1: [], 16: []}
        for _ in range(repeats):
            for concurrency in (1, 16):  # alternating: a busy moment hurts both sides
                fn = resolve_reward("remote_verifier", {"url": url, "concurrency": concurrency, "batch_size": 1})
                started = time.perf_counter()
                fn(texts)
                samples[concurrency].append(n / (time.perf_counter() - started))
    finally:
        server.shutdown()
        server.server_close()
    for c, rates in samples.items():
        out[f"concurrency_{c}"] = {"completions_per_s": statistics.median(rates), "samples": rates}
    out["ratio"] = out["concurrency_16"]["completions_per_s"] / out["concurrency_1"]["completions_per_s"]
    out["ratios"] = [b / a for a, b in zip(samples[1], samples[16], strict=True)]
    return out


def table_rows(load) -> list[Row]:
    r = load(NAME)
    if r is None:
        return [Row("reward throughput (`bench.reward_throughput`)", "", "", None, "", note="not run yet")]
    m, remote = r["math_answer"], r["remote_verifier"]
    ratios = remote["ratios"]
    return [
        Row(
            f"math_answer on {m['n']:,} GSM8K-solution completions, 1 in 10 LaTeX (`bench.reward_throughput`)",
            "–",
            f"{m['completions_per_s']:,.0f} completions/s",
            None,
            "",
            note="reported (a GRPO step scores 64–512)",
        ),
        Row(
            f"remote_verifier, {remote['n']} completions one per request, local server {remote['latency_s'] * 1000:.0f} ms "
            "per request (same)",
            f"concurrency 1: {remote['concurrency_1']['completions_per_s']:,.0f}/s",
            f"concurrency 16: {remote['concurrency_16']['completions_per_s']:,.0f}/s",
            remote["ratio"],
            ">= 8",
            spread=(min(ratios), max(ratios)) if len(ratios) > 1 else None,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=4096)
    parser.add_argument("--remote-completions", type=int, default=256)
    parser.add_argument("--latency", type=float, default=0.02, help="the verifier's service time per request, s")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.completions, opts.remote_completions, opts.repeats = 200, 32, 1
    report = {
        "name": NAME,
        "math_answer": time_math_answer(opts.completions, opts.repeats),
        "remote_verifier": time_remote(opts.remote_completions, opts.latency, opts.repeats),
        "machine": {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    m, r = report["math_answer"], report["remote_verifier"]
    print(
        f"[{NAME}] math_answer: {m['completions_per_s']:,.0f} completions/s; remote_verifier "
        f"({r['latency_s'] * 1000:.0f} ms/request): {r['concurrency_1']['completions_per_s']:,.0f}/s at 1, "
        f"{r['concurrency_16']['completions_per_s']:,.0f}/s at 16 ({r['ratio']:.1f}x)"
    )
    save(f"{NAME}_tiny" if opts.tiny else NAME, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
