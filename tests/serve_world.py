"""Routers with a real engine process behind them, for the checks of the engine's supervision and of replicas:
the router's own `Engine` starting the stand-in vLLM server (tests/stand_in_vllm, put on PYTHONPATH by the
caller), served by `router.run` (uvicorn, the supervisor, the alias follower) on a free loopback port in a
thread. The adapters are folders the stand-in checks for, as vLLM does. `base_a_router` is the router every serving
test builds, with or without that engine (tests/unit/test_router.py puts an in-process server in its place)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from grpo_pipeline.configs.ab import ServeConfig
from grpo_pipeline.tasks.serve.ab_log import RequestLog
from grpo_pipeline.tasks.serve.adapters import Adapter
from grpo_pipeline.tasks.serve.engine import Engine, free_port
from grpo_pipeline.tasks.serve.router import Router, run


def adapter_at(root: Path, alias: str, version: str) -> Adapter:
    """An adapter whose folder exists (what the stand-in engine checks)."""
    path = root / f"{alias}-v{version}"
    path.mkdir(parents=True, exist_ok=True)
    return Adapter(alias, version, path, "base-a", "aaa", 8)


def base_a_router(
    request_log: RequestLog | None,
    spool: Path,
    *,
    engine: Engine | None = None,
    fraction: float = 0.5,
    api_key: str | None = None,
    request_timeout_s: float = 30,
    **kw: Any,
) -> Router:
    """A router serving base-a (sha256 "aaa", ranks up to 16) over `request_log`, its arms not yet set: the base
    every adapter of these tests is trained on. `engine` None: the caller puts a server of its own in its place."""
    return Router(
        engine=engine,  # None: no process to supervise
        client=None,
        request_log=request_log,  # None: a router that never gets to log
        spool=spool,
        challenger_fraction=fraction,
        api_key=api_key,
        base="base-a",
        base_sha256="aaa",
        max_rank=16,
        request_timeout_s=request_timeout_s,
        **kw,
    )


@dataclass
class Replica:
    router: Router
    url: str
    thread: threading.Thread
    error: list[BaseException] = field(default_factory=list)  # what `run` raised (the engine that gave up)

    @property
    def engine_pid(self) -> int:
        assert self.router.engine.process is not None
        return self.router.engine.process.pid


@contextlib.contextmanager
def replica(
    root: Path,
    request_log: RequestLog,
    arms: dict[str, Adapter],
    cfg: ServeConfig,
    resolve: Callable[[str], Adapter | None] | None = None,
    fraction: float = 0.5,
) -> Iterator[Replica]:
    """A router and its engine serving `arms`, until the block ends (or the router gives up: `thread` ends)."""
    root.mkdir(parents=True, exist_ok=True)
    engine = Engine(sys.executable, "base-a", cfg, root / "engine.log")
    router = base_a_router(
        request_log,
        root / "unlogged.jsonl",
        engine=engine,
        fraction=fraction,
        request_timeout_s=cfg.request_timeout_s,
        retry_after_s=cfg.retry_after_s,
    )
    router.arms = dict(arms)
    router.loaded = {a.engine_name: a.path for a in arms.values()}
    engine.start(router.loaded)
    port = free_port()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            run(router, "127.0.0.1", port, resolve or (lambda alias: router.arms.get(alias)), cfg)
        except BaseException as e:  # handed to the test, which asserts on it
            errors.append(e)

    try:
        engine.wait_ready(60)
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert thread.is_alive() and time.monotonic() < deadline, f"the router did not start: {errors}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.05)
        yield Replica(router, url, thread, errors)
    finally:
        router.stop()
        if "thread" in locals():
            thread.join(30)
        engine.stop()


T = TypeVar("T")


def wait_for(check: Callable[[], T], within_s: float, what: str) -> T:
    """Until `check()` holds, returning what it returned; fails naming `what` after `within_s` (generous: a busy
    machine is slow, not wrong)."""
    deadline = time.monotonic() + within_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} did not happen within {within_s:g} s"
        time.sleep(0.05)
    return value
