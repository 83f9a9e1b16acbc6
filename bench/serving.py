"""Serving: what the router costs, how fast an alias move takes effect, and adapters stacked on one base against
merged models, all through vLLM's CPU build (`.venv-serve`, `make serve-env`).

    python -m bench.serving            # SmolLM2-135M (the demo model), ~20 min on 2 cores; bench/results/serving.json
    python -m bench.serving --tiny     # a tiny random Llama, a few requests: does it run? (serving_tiny.json)

1. **Router overhead.** One engine holding the base and two random LoRA adapters (champion-v1, challenger-v2);
   the router (`grpo_pipeline.tasks.serve.router.Router` in a process of its own, as `grpo-pipeline serve` runs it:
   assignment, validation, the request log written to SQLite before each answer) in front of it. The same
   requests (the same users, so the same adapter for each, `ab.challenger_fraction=0.5`, a fixed completion
   length: `min_tokens = max_tokens`) go to the engine alone and through the router, at concurrency 1, 4 and
   16 (the engine's saturation on 2 cores), the two sides alternating in every round. Requests/s and p50/p95
   latency; the ratio is engine requests/s over router requests/s at the highest concurrency (goal <= 1.05).
2. **Hot-swap.** The challenger alias moved (`Router.swap`, as the alias poll calls it): the new adapter loaded
   into the engine, requests switched, the old one unloaded; timed from the move to the first answer from the
   new adapter, against one request's latency without a move. The registry poll (`ab.serve.poll_s`) comes on
   top in production.
3. **Stacked vs merged.** Completion tokens/s of the champion adapter served on the base through vLLM's LoRA
   (one engine for both arms) against the same adapter merged into the base and served by a plain engine
   (`--enable-lora` off): the alternative, a merged model per arm, i.e. one engine and one copy of the base per
   arm. Concurrency 1 and 16, alternating rounds.

Both engines run for the whole benchmark (only one is loaded at a time); each engine start takes minutes here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import ROOT, save, spread, stamp
from bench.table import Row
from grpo_pipeline.configs.ab import ServeConfig
from grpo_pipeline.tasks.serve.adapters import Adapter
from grpo_pipeline.tasks.serve.engine import Engine, default_python, free_port
from grpo_pipeline.tasks.serve.router import CHALLENGER, CHAMPION, Router, arm_for, assignment_hash

NAME = "serving"
FRACTION = 0.5
PROMPT = "What is 12 + 30? Reply with just the number."
ENGINE_KEY_ENV = "GRPO_BENCH_ENGINE_KEY"  # the engine's key, handed to the router process outside its argv


# ------------------------------------------------------------------------------------------------ load


def body(user: str, max_tokens: int, model: str | None = None) -> dict:
    out = {"prompt": PROMPT, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0, "user": user}
    return out | ({"model": model} if model else {})


def engine_model(user: str) -> str:
    """The adapter the router gives `user`: the engine-alone side sends each request to the same one."""
    return "challenger-v2" if arm_for(assignment_hash(user), FRACTION) == CHALLENGER else "champion-v1"


async def load(url: str, headers: dict, bodies: list[dict], concurrency: int) -> dict:
    """Send `bodies` with `concurrency` requests in flight; requests/s, latency percentiles, tokens/s."""
    queue = list(reversed(bodies))
    latencies: list[float] = []
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            b = queue.pop()
            started = time.perf_counter()
            r = await client.post("/v1/completions", json=b)
            latencies.append(time.perf_counter() - started)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": len(latencies),
        "requests_per_s": len(latencies) / elapsed,
        "tokens_per_s": tokens / elapsed,
        "p50_s": statistics.median(latencies),
        "p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
    }


# ------------------------------------------------------------------------------------------------ the router


def router_for(
    engine_url: str, engine_key: str, base: str, adapters: dict[str, Path], work: Path, engine: Engine | None = None
) -> Router:
    """A router as `serve` builds one (champion v1, challenger v2, a SQLite log), its engine client opened."""
    from grpo_pipeline.tasks.serve.ab_log import RequestLog

    router = Router(
        engine=engine,
        client=None,
        request_log=RequestLog.open(f"sqlite:///{work / 'ab.sqlite'}"),
        spool=work / "unlogged.jsonl",
        challenger_fraction=FRACTION,
        api_key=None,
        base=base,
        base_sha256=None,
        max_rank=8,
        request_timeout_s=600,
    )
    router.arms = {
        CHAMPION: Adapter(CHAMPION, "1", adapters["champion-v1"], base, None, 8),
        CHALLENGER: Adapter(CHALLENGER, "2", adapters["challenger-v2"], base, None, 8),
    }
    router.client = httpx.AsyncClient(
        base_url=engine_url,
        headers={"Authorization": f"Bearer {engine_key}"},
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        timeout=600,
    )
    return router


def serve_router(engine_url: str, port: int, base: str, champion: str, challenger: str, work: str) -> None:
    """The router process: `grpo-pipeline serve`'s Router and uvicorn, without the registry around them."""
    import uvicorn

    adapters = {"champion-v1": Path(champion), "challenger-v2": Path(challenger)}
    router = router_for(engine_url, os.environ[ENGINE_KEY_ENV], base, adapters, Path(work))
    uvicorn.run(router.app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


@contextlib.contextmanager
def router_process(engine: Engine, base: Path, adapters: dict[str, Path], work: Path):
    port = free_port()
    args = ["--engine-url", engine.url, "--port", str(port), "--base", str(base), "--work", str(work)]
    args += ["--champion", str(adapters["champion-v1"]), "--challenger", str(adapters["challenger-v2"])]
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.serving", "router", *args],
        env={**os.environ, ENGINE_KEY_ENV: engine.key},
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the router process exited with {process.returncode}")
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the router process was not ready (/ready) within 120 s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(30)


# ------------------------------------------------------------------------------------------------ the parts


def overhead(engine: Engine, router_url: str, concurrencies: tuple[int, ...], rounds: int, tokens: int) -> dict:
    out: dict = {str(c): {"engine": [], "router": []} for c in concurrencies}
    for r in range(rounds):
        for c in concurrencies:
            n = max(16, 4 * c)
            users = [f"r{r}-c{c}-u{i}" for i in range(n)]
            sides = [
                ("engine", engine.url, engine.headers, [body(u, tokens, engine_model(u)) for u in users]),
                ("router", router_url, {}, [body(u, tokens) for u in users]),
            ]
            for side, url, headers, bodies in sides if r % 2 == 0 else reversed(sides):
                result = asyncio.run(load(url, headers, bodies, c))
                out[str(c)][side].append(result)
                print(
                    f"[serving] round {r + 1}/{rounds} c={c} {side}: {result['requests_per_s']:.2f} req/s, "
                    f"p50 {result['p50_s']:.3f} s, p95 {result['p95_s']:.3f} s",
                    flush=True,
                )
    return out


async def hot_swap(engine: Engine, base: Path, adapters: dict[str, Path], work: Path, swaps: int, tokens: int):
    """Move the challenger between v2 and v3 `swaps` times; each time, the moment the router switches, send a
    request (fraction 1: everyone is on the challenger) and time the move to its answer."""
    router = router_for(engine.url, engine.key, str(base), adapters, work, engine)
    router.fraction = 1.0
    transport = httpx.ASGITransport(app=router.app())
    samples: list[dict] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=600) as client:
        plain = []
        for i in range(3):
            started = time.perf_counter()
            r = await client.post("/v1/completions", json=body(f"plain-{i}", tokens))
            r.raise_for_status()
            plain.append(time.perf_counter() - started)
        for i in range(swaps):
            version = "3" if router.arms[CHALLENGER].version == "2" else "2"
            new = Adapter(CHALLENGER, version, adapters[f"challenger-v{version}"], str(base), None, 8)
            started = time.perf_counter()
            swap = asyncio.create_task(router.swap(CHALLENGER, new))
            while router.arms[CHALLENGER].version != version:
                if swap.done():
                    raise RuntimeError(f"the swap to v{version} was refused: {swap.result()}")
                await asyncio.sleep(0.001)
            switched = time.perf_counter() - started
            r = await client.post("/v1/completions", json=body(f"swap-{i}", tokens))
            r.raise_for_status()
            assert r.headers["X-GRPO-Version"] == version
            answered = time.perf_counter() - started
            await swap  # the old adapter's unload
            samples.append({"switched_s": switched, "first_answer_s": answered})
            print(f"[serving] swap {i + 1}/{swaps} to v{version}: switched {switched:.3f} s, answered {answered:.3f} s")
    await router.client.aclose()
    router.log.close()
    return {"plain_request_s": statistics.median(plain), "swaps": samples}


def stacked_vs_merged(lora: Engine, merged: Engine, concurrencies: tuple[int, ...], rounds: int, tokens: int):
    out: dict = {str(c): {"stacked": [], "merged": []} for c in concurrencies}
    for r in range(rounds):
        for c in concurrencies:
            n = max(16, 4 * c)
            sides = [
                ("stacked", lora, [body(f"s{r}-{i}", tokens, "champion-v1") for i in range(n)]),
                ("merged", merged, [body(f"m{r}-{i}", tokens) for i in range(n)]),
            ]
            for side, engine, bodies in sides if r % 2 == 0 else reversed(sides):
                if side == "merged":
                    bodies = [b | {"model": merged.base} for b in bodies]
                result = asyncio.run(load(engine.url, engine.headers, bodies, c))
                out[str(c)][side].append(result)
                print(f"[serving] round {r + 1}/{rounds} c={c} {side}: {result['tokens_per_s']:.1f} tok/s", flush=True)
    return out


# ------------------------------------------------------------------------------------------------ models


def make_models(work: Path, tiny: bool) -> tuple[Path, dict[str, Path], Path]:
    """(the base, three random rank-8 adapters by engine name, the champion's adapter merged into the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny_model import create_random_adapter, create_random_model

    if tiny:
        base = create_random_model(work / "base", hidden_size=256, seed=0)  # head_dim 64: the CPU kernels take it
    else:
        from grpo_pipeline.configs.schema import load_config
        from grpo_pipeline.tasks.model import ensure_demo_model

        base = ensure_demo_model(load_config(ROOT / "configs" / "demo-cpu.yaml").data_dir / "models")
    adapters = {
        name: create_random_adapter(base, work / name, seed=10 + i)
        for i, name in enumerate(("champion-v1", "challenger-v2", "challenger-v3"))
    }
    merged = work / "merged-champion"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters["champion-v1"])
    model.merge_and_unload().save_pretrained(merged)
    AutoTokenizer.from_pretrained(base).save_pretrained(merged)
    return Path(base), adapters, merged


def engine_python() -> str:
    return os.environ.get("GRPO_SERVE_ENGINE_PYTHON") or str(default_python(ROOT))


# ------------------------------------------------------------------------------------------------ the table


def _ratios(by_c: dict, c: str, num: str, den: str, key: str) -> list[float]:
    return [a[key] / b[key] for a, b in zip(by_c[c][num], by_c[c][den], strict=True)]


def _median(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def table_rows(load) -> list[Row]:
    r = load(NAME)
    if r is None:
        return [
            Row(
                "router overhead at the engine's saturation (`bench.serving`)",
                "vLLM alone",
                "through the router",
                None,
                "<= 1.05",
                note="not run yet",
            )
        ]
    top = str(max(int(c) for c in r["overhead"]))
    o = r["overhead"][top]
    throughput = _ratios(r["overhead"], top, "engine", "router", "requests_per_s")
    p95 = _ratios(r["overhead"], top, "router", "engine", "p95_s")
    swap = r["hot_swap"]
    answered = statistics.median(s["first_answer_s"] for s in swap["swaps"])
    rows = [
        Row(
            f"router overhead, {r['model']}, concurrency {top}, {r['tokens']} tokens (`bench.serving`): engine / router req/s",
            f"vLLM alone: {_median(o['engine'], 'requests_per_s'):.2f} req/s",
            f"through the router: {_median(o['router'], 'requests_per_s'):.2f} req/s",
            statistics.median(throughput),
            "<= 1.05",
            spread=(min(throughput), max(throughput)) if len(throughput) > 1 else None,
        ),
        Row(
            f"router p95 latency, concurrency {top} (`bench.serving`): router / engine",
            f"vLLM alone: p95 {_median(o['engine'], 'p95_s'):.3f} s",
            f"through the router: p95 {_median(o['router'], 'p95_s'):.3f} s",
            statistics.median(p95),
            "<= 1.05",
            spread=(min(p95), max(p95)) if len(p95) > 1 else None,
        ),
        Row(
            "adapter hot-swap: alias moved to first answer from the new adapter (`bench.serving`)",
            f"one request, no move: {swap['plain_request_s']:.2f} s",
            f"move + first answer: {answered:.2f} s",
            answered / swap["plain_request_s"],
            "",
        ),
    ]
    for c, sides in r["stacked_vs_merged"].items():
        ratios = _ratios(r["stacked_vs_merged"], c, "merged", "stacked", "tokens_per_s")
        rows.append(
            Row(
                f"adapter stacked on the base vs merged per arm, CPU, concurrency {c} (`bench.serving`): tok/s",
                f"base + LoRA in vLLM: {_median(sides['stacked'], 'tokens_per_s'):.1f} tok/s",
                f"merged model: {_median(sides['merged'], 'tokens_per_s'):.1f} tok/s",
                statistics.median(ratios),
                "",
                spread=(min(ratios), max(ratios)) if len(ratios) > 1 else None,
            )
        )
    return rows


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:
        p = argparse.ArgumentParser(prog="python -m bench.serving router")
        for flag in ("--engine-url", "--base", "--champion", "--challenger", "--work"):
            p.add_argument(flag, required=True)
        p.add_argument("--port", type=int, required=True)
        o = p.parse_args(argv[1:])
        serve_router(o.engine_url, o.port, o.base, o.champion, o.challenger, o.work)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model, one round, few requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per request")
    parser.add_argument("--swaps", type=int, default=6)
    opts = parser.parse_args(argv)
    concurrencies = (1, 4, 16)
    if opts.tiny:
        opts.rounds, opts.tokens, opts.swaps, concurrencies = 1, 4, 2, (1, 4)
    python = engine_python()
    if not Path(python).is_file():
        print(f"no engine Python at {python}: run `make serve-env` or set GRPO_SERVE_ENGINE_PYTHON", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    base, adapters, merged_path = make_models(work, opts.tiny)
    cfg = ServeConfig(max_lora_rank=8, max_model_len=256)
    lora = Engine(python, str(base), cfg, work / "engine-lora.log")
    merged = Engine(python, str(merged_path), cfg, work / "engine-merged.log", lora=False)
    try:
        lora.start({name: path for name, path in adapters.items() if name != "challenger-v3"})
        merged.start({})
        lora.wait_ready()
        merged.wait_ready()
        warm = [body(f"warm-{i}", opts.tokens, engine_model(f"warm-{i}")) for i in range(8)]
        asyncio.run(load(lora.url, lora.headers, warm, 4))  # first requests compile and allocate
        asyncio.run(load(merged.url, merged.headers, [b | {"model": str(merged_path)} for b in warm], 4))
        with router_process(lora, base, adapters, work / "router") as router_url:
            over = overhead(lora, router_url, concurrencies, opts.rounds, opts.tokens)
        swap = asyncio.run(hot_swap(lora, base, adapters, work / "swap", opts.swaps, opts.tokens))
        stacked = stacked_vs_merged(lora, merged, (concurrencies[0], concurrencies[-1]), opts.rounds, opts.tokens)
    finally:
        lora.stop()
        merged.stop()
    report = {
        "name": NAME,
        "model": "tiny random Llama (hidden 256)" if opts.tiny else "SmolLM2-135M",
        "tokens": opts.tokens,
        "rounds": opts.rounds,
        "fraction": FRACTION,
        "overhead": over,
        "hot_swap": swap,
        "hot_swap_first_answer_s": spread([s["first_answer_s"] for s in swap["swaps"]]),
        "stacked_vs_merged": stacked,
        **stamp(),
    }
    path = save(NAME + ("_tiny" if opts.tiny else ""), report)
    for row in table_rows(lambda _name: report):
        print(f"{row.benchmark}: {row.baseline} | {row.candidate} | ratio {row.ratio:.3f}")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
