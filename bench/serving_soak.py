"""Serving soak: steady traffic for minutes through two router replicas on one PostgreSQL request log, with an alias
move and kills of an engine, a router and the log store; what the clients saw, window by window.

    python -m bench.serving_soak                 # 10 minutes, 4 clients, 200 users; bench/results/serving_soak.json
    python -m bench.serving_soak --minutes 3     # shorter
    python -m bench.serving_soak --tiny          # 40 s, a few users: does it run? (serving_soak_tiny.json)

The parts are the production ones: PostgreSQL from `grpo-pipeline stack` (`Stack.up(["postgres"])`, started again
by the same call after its kill), each router a process of its own run by supervisord (`services.start_supervised`,
as `stack up --serve` runs it: a killed router is started again) serving with `router.run` (the engine's
supervision, the alias follower, the spool). Two things stand in: the registry is a JSON file of alias -> version
the routers poll (an MLflow registry's read is not what is soaked), and the engine is the stand-in vLLM server
(tests/stand_in_vllm: the router's own `Engine` starts it with vLLM's command line; `--engine-start-s` is its
start-up) unless `--engine-python` names a Python with vLLM and `--base` a model, since vLLM's CPU build is not
on every machine. The report says which engine ran.

Traffic: `--clients` threads, each sending one request at a time for a random user of `--users`, to the replicas
in turn, a 503 or a refused connection retried once on the other replica (a load balancer's retry); a request no
replica answered is failed. Faults, at fixed shares of the run: 20 % the challenger alias moves, 35 % replica 0's
engine is killed (SIGKILL), 55 % replica 1's router is killed, 75 % PostgreSQL is killed and `stack up` starts it
again `--store-down-s` later. Per window: requests, answered, failed, the clients' 503 retries, router 0's
memory (RSS). Per fault: seconds until the faulted part serves again (its /ready, or for the store, the spools
replayed) and the longest time no client got an answer. At the end, every answered id is looked up in the
log: rows lost (goal 0).

Resumable: each finished window is kept in `<work>/runs.json`; a killed soak started again with the same options
continues at the next window (the services are started again; the faults already done are not repeated).
Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import httpx

from bench.harness import ROOT, fingerprint, keep_runs, open_work, save, stamp

NAME = "serving_soak"
STAND_IN = ROOT / "tests" / "stand_in_vllm"
FAULTS = (("alias_move", 0.20), ("engine_kill", 0.35), ("router_kill", 0.55), ("store_kill", 0.75))


# ------------------------------------------------------------------------------------------------ one replica


def adapter(root: Path, alias: str, version: str):
    from grpo_pipeline.tasks.serve.adapters import Adapter

    path = root / f"{alias}-v{version}"
    path.mkdir(parents=True, exist_ok=True)  # the stand-in checks the folder; vLLM would read the adapter there
    return Adapter(alias, version, path, "soak-base", None, 8)


def replica_main(args: argparse.Namespace) -> int:
    """One router process (started by supervisord): the alias file's adapters on an engine, served by `run`."""
    import logging

    from grpo_pipeline.configs.ab import ServeConfig
    from grpo_pipeline.tasks.serve import ab_spool
    from grpo_pipeline.tasks.serve.ab_log import RequestLog
    from grpo_pipeline.tasks.serve.api import CHALLENGER, CHAMPION
    from grpo_pipeline.tasks.serve.engine import Engine, EngineError
    from grpo_pipeline.tasks.serve.router import Router, run

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    root, aliases = Path(args.root), Path(args.aliases)
    cfg = ServeConfig(
        poll_s=args.poll_s, probe_s=1.0, probe_timeout_s=10.0, retry_after_s=1, dtype="float32", reattach_engine=True
    )

    def resolve(alias: str):
        version = json.loads(aliases.read_text()).get(alias)
        return None if version is None else adapter(aliases.parent / "adapters", alias, version)

    request_log = RequestLog.open(os.environ["GRPO_AB_LOG_URL"])
    spool = root / "unlogged.jsonl"
    with suppress(Exception):  # the store may be down at this start: the next write replays
        ab_spool.replay(spool, request_log)
    # recorded, as the stack's router: a killed router's engine keeps running and its successor attaches to it
    engine = Engine(args.engine_python, args.base, cfg, root / "engine.log", record=root / "engine.json")
    router = Router(
        engine=engine,
        client=None,
        request_log=request_log,
        spool=spool,
        challenger_fraction=0.5,
        api_key=None,
        base="soak-base",
        base_sha256=None,
        max_rank=16,
        request_timeout_s=cfg.request_timeout_s,
        retry_after_s=cfg.retry_after_s,
    )
    router.arms = {a: found for a in (CHAMPION, CHALLENGER) if (found := resolve(a)) is not None}
    router.loaded = {a.engine_name: a.path for a in router.arms.values()}
    try:
        run(router, "127.0.0.1", args.port, resolve, cfg)  # bound at once; the engine started or attached behind
    except EngineError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        engine.stop()
        request_log.close()
    return 0


# ------------------------------------------------------------------------------------------------ the traffic


class Traffic:
    """Client threads sending to the replicas in turn, one retry on the other replica; every outcome kept."""

    def __init__(self, urls: list[str], users: int, clients: int, seed: int):
        self.urls, self.users, self.clients = urls, users, clients
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: list[tuple[float, bool]] = []  # (time, answered)
        self.answered_ids: list[str] = []
        self.retries = 0
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.clients):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self, index: int) -> None:
        clients = [httpx.Client(base_url=u, timeout=60) for u in self.urls]
        turn = index
        while not self.stop.is_set():
            with self.lock:
                user = f"user-{self.rng.randrange(self.users)}"
            answer_id, retried = None, 0
            for attempt in range(2):
                client = clients[(turn + attempt) % len(clients)]
                try:
                    answer = client.post("/v1/completions", json={"prompt": "x", "user": user, "max_tokens": 8})
                except httpx.HTTPError:
                    retried += 1
                    continue
                if answer.status_code == 200:
                    answer_id = answer.json()["id"]
                    break
                retried += 1
            turn += 1
            with self.lock:
                self.outcomes.append((time.time(), answer_id is not None))
                self.retries += min(retried, 1) if answer_id else 0
                if answer_id:
                    self.answered_ids.append(answer_id)
            if answer_id is None:
                self.stop.wait(1.0)  # no replica answered: Retry-After's second, not a tight loop
        for c in clients:
            c.close()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)


# ------------------------------------------------------------------------------------------------ the soak


def ready(url: str) -> bool:
    with suppress(httpx.HTTPError):
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    return False


def unlogged(url: str) -> int | None:
    with suppress(httpx.HTTPError, ValueError, KeyError):
        return int(httpx.get(f"{url}/health", timeout=5).json()["unlogged"])
    return None


def wait_until(check, within_s: float) -> float | None:
    """Seconds until `check()` holds; None when it did not within `within_s`."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        if check():
            return round(time.monotonic() - started, 2)
        time.sleep(0.1)
    return None


def longest_gap(outcomes: list[tuple[float, bool]], since: float, until: float) -> float:
    """The longest stretch in [since, until] with no answered request (the clients' view of an outage)."""
    answered = sorted(t for t, ok in outcomes if ok and since <= t <= until)
    points = [since, *answered, until]
    return round(max(b - a for a, b in zip(points, points[1:], strict=False)), 2)


def router_pid(service) -> int | None:
    from grpo_pipeline.infra import services

    state = services.supervised_state(service)
    return state["pid"] if state and state["statename"] == "RUNNING" and state["pid"] else None


def engine_pid(router: int) -> int | None:
    import psutil

    with suppress(psutil.Error):
        for child in psutil.Process(router).children():
            if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline()):
                return child.pid
    return None


def rss_mib(pid: int | None) -> float | None:
    import psutil

    with suppress(psutil.Error, TypeError):
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    return None


def soak(args: argparse.Namespace) -> dict:
    from sqlalchemy import select

    from grpo_pipeline.infra import services
    from grpo_pipeline.infra.stack import Stack
    from grpo_pipeline.tasks.serve.ab_log import RequestLog, requests_table

    work = args.work.resolve()
    identity = json.dumps({k: v for k, v in vars(args).items() if k not in ("work", "fresh", "command")}, default=str)
    state = open_work(work, fingerprint(identity, ("bench/serving_soak.py", "tasks/serve")), args.fresh)
    runs = state["runs"]  # "windows": [...], "faults": {...}, "answered": [...]
    windows, faults, answered = (
        runs.setdefault("windows", []),
        runs.setdefault("faults", {}),
        runs.setdefault("answered", []),
    )
    total_s, window_s = args.minutes * 60, args.window_s
    elapsed = len(windows) * window_s
    if elapsed >= total_s:
        return runs

    stack = Stack(work / "stack")
    pg = stack.up(["postgres"])["postgres"]
    uri = services.database_uri(pg, "ab")
    RequestLog.open(uri).close()  # the tables, before two routers race to create them
    aliases = work / "aliases.json"
    if not aliases.exists():
        aliases.write_text(json.dumps({"champion": "1", "challenger": "2"}))
    env = {
        "GRPO_AB_LOG_URL": uri,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if args.engine_python is None:
        env["PYTHONPATH"] += os.pathsep + str(STAND_IN)
        env["STAND_IN_ENGINE_START_S"] = str(args.engine_start_s)
        env["STAND_IN_ENGINE_LATENCY_S"] = str(args.engine_latency_s)
    replicas = []
    for i in range(2):
        port = services.free_port()
        command = [
            sys.executable,
            "-m",
            "bench.serving_soak",
            "replica",
            "--port",
            str(port),
            "--root",
            str(work / f"replica-{i}"),
        ]
        command += [
            "--aliases",
            str(aliases),
            "--poll-s",
            str(args.poll_s),
            "--engine-python",
            args.engine_python or sys.executable,
        ]
        command += ["--base", args.base]
        service = services.start_supervised(f"router-{i}", command, work / f"replica-{i}", env, settled=(2,))
        service.url = f"http://127.0.0.1:{port}"
        replicas.append(service)
    traffic = None
    try:
        for service in replicas:
            if wait_until(lambda s=service: ready(s.url), 600) is None:
                raise SystemExit(f"{service.name} was not ready within 600 s; see {service.log}")
        traffic = Traffic([s.url for s in replicas], args.users, args.clients, seed=len(windows))
        traffic.start()
        started = time.time() - elapsed  # the soak's clock, across resumes
        while elapsed < total_s:
            window_end = started + elapsed + window_s
            for name, share in FAULTS:
                at = started + share * total_s
                if name not in faults and at < window_end:
                    time.sleep(max(0.0, at - time.time()))
                    faults[name] = inject(name, replicas, stack, aliases, args, traffic)
            time.sleep(max(0.0, window_end - time.time()))
            with traffic.lock:
                seen = [ok for t, ok in traffic.outcomes if window_end - window_s <= t < window_end]
                retries, traffic.retries = traffic.retries, 0
                answered.extend(traffic.answered_ids)
                traffic.answered_ids.clear()
            windows.append(
                {
                    "window": len(windows),
                    "end_s": round(elapsed + window_s),
                    "requests": len(seen),
                    "answered": sum(seen),
                    "failed": len(seen) - sum(seen),
                    "retried_elsewhere": retries,
                    "router0_rss_mib": rss_mib(router_pid(replicas[0])),
                }
            )
            elapsed += window_s
            for fault in faults.values():
                if "_at" in fault and "client_gap_s" not in fault and time.time() > fault["_at"] + 30:
                    fault["client_gap_s"] = longest_gap(traffic.outcomes, fault["_at"], fault["_at"] + 30)
            keep_runs(work / "runs.json", state)
            print(json.dumps(windows[-1]), flush=True)
        traffic.finish()
        with traffic.lock:
            answered.extend(traffic.answered_ids)
            traffic.answered_ids.clear()
        for fault in faults.values():
            if "_at" in fault and "client_gap_s" not in fault:
                fault["client_gap_s"] = longest_gap(traffic.outcomes, fault["_at"], time.time())
        # every spool replayed: a write replays, so one more request per replica
        for service in replicas:
            with suppress(httpx.HTTPError):
                httpx.post(f"{service.url}/v1/completions", json={"prompt": "x", "user": "last"}, timeout=60)
        wait_until(lambda: all(unlogged(s.url) == 0 for s in replicas), 60)
        log = RequestLog.open(uri)
        with log.engine.connect() as c:
            stored = set(c.execute(select(requests_table.c.id)).scalars())
        log.close()
        runs["rows_lost"] = len(set(answered) - stored)
        keep_runs(work / "runs.json", state)
    finally:
        if traffic is not None:
            traffic.finish()
        for service in replicas:
            services.stop(service)
        stack.down()
    return runs


def inject(name: str, replicas: list, stack, aliases: Path, args: argparse.Namespace, traffic: Traffic) -> dict:
    """Cause the fault; wait for the faulted part to serve again. Returns what happened (times in seconds)."""
    at = time.time()
    if name == "alias_move":
        aliases.write_text(json.dumps({"champion": "1", "challenger": "3"}))

        def moved() -> bool:
            with suppress(httpx.HTTPError, ValueError, KeyError):
                return all(
                    {m["id"]: m["version"] for m in httpx.get(f"{s.url}/v1/models", timeout=5).json()["data"]}.get(
                        "challenger"
                    )
                    == "3"
                    for s in replicas
                )
            return False

        return {"_at": at, "what": "challenger 2 -> 3", "recovery_s": wait_until(moved, 300)}
    if name == "engine_kill":
        router = router_pid(replicas[0])
        engine = engine_pid(router) if router else None
        if engine is None:
            return {"_at": at, "what": "no engine found under router 0", "recovery_s": None}
        os.kill(engine, signal.SIGKILL)
        time.sleep(0.5)  # the router's check sees it within probe_s; /ready says so at once
        return {
            "_at": at,
            "what": "replica 0's engine SIGKILL",
            "recovery_s": wait_until(lambda: ready(replicas[0].url), 300),
        }
    if name == "router_kill":
        router = router_pid(replicas[1])
        if router is None:
            return {"_at": at, "what": "no router 1 running", "recovery_s": None}
        os.kill(router, signal.SIGKILL)  # its engine keeps running; supervisord starts the router, which attaches
        time.sleep(0.5)
        return {
            "_at": at,
            "what": "replica 1's router SIGKILL",
            "recovery_s": wait_until(lambda: ready(replicas[1].url), 300),
        }
    pg = stack.service("postgres")
    os.kill(pg.pid, signal.SIGKILL)
    time.sleep(args.store_down_s)
    stack.up(["postgres"])
    replayed = wait_until(lambda: all(unlogged(s.url) == 0 for s in replicas), 300)
    return {
        "_at": at,
        "what": f"PostgreSQL SIGKILL, `stack up` {args.store_down_s:g} s later",
        "recovery_s": None if replayed is None else round(time.time() - at, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    rep = sub.add_parser("replica", help="one router process (the soak starts these under supervisord)")
    rep.add_argument("--port", type=int, required=True)
    rep.add_argument("--root", required=True)
    rep.add_argument("--aliases", required=True)
    rep.add_argument("--poll-s", type=float, default=2.0)
    rep.add_argument("--engine-python", required=True)
    rep.add_argument("--base", required=True)
    parser.add_argument("--tiny", action="store_true", help="40 s, 2 clients, 20 users: does it run?")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--poll-s", type=float, default=2.0, help="the routers' alias poll")
    parser.add_argument("--store-down-s", type=float, default=5.0, help="how long PostgreSQL stays down")
    parser.add_argument("--engine-python", default=None, help="a Python with vLLM (default: the stand-in engine)")
    parser.add_argument("--base", default="soak-base", help="the engine's base model (with --engine-python)")
    parser.add_argument("--engine-start-s", type=float, default=20.0, help="the stand-in engine's start-up")
    parser.add_argument("--engine-latency-s", type=float, default=0.05, help="the stand-in engine's answer time")
    parser.add_argument("--work", type=Path, default=None, help="where the soak keeps its state (resumable)")
    parser.add_argument("--fresh", action="store_true", help="forget the work folder's windows")
    args = parser.parse_args(argv)
    if args.command == "replica":
        sys.exit(replica_main(args))
    if args.tiny:
        args.minutes, args.window_s, args.clients, args.users = 40 / 60, 5.0, 2, 20
        args.engine_start_s, args.store_down_s, args.poll_s = min(args.engine_start_s, 2.0), 2.0, 0.5
    name = f"{NAME}_tiny" if args.tiny else NAME
    args.work = args.work or ROOT / ".grpo" / "bench" / name
    runs = soak(args)
    report = {
        "engine": "vLLM " + args.engine_python
        if args.engine_python
        else f"stand-in vLLM server (start-up {args.engine_start_s:g} s)",
        "options": {k: v for k, v in vars(args).items() if k not in ("work", "command", "fresh")},
        "windows": runs["windows"],
        "faults": {k: {f: v for f, v in fault.items() if f != "_at"} for k, fault in runs["faults"].items()},
        "rows_lost": runs.get("rows_lost"),
        "answered": len(runs["answered"]),
        "memory_growth_last_half": memory_growth(runs["windows"]),
        **stamp(),
    }
    print(json.dumps({k: report[k] for k in ("faults", "rows_lost", "answered", "memory_growth_last_half")}, indent=1))
    print(f"saved {save(name, report)}")


def memory_growth(windows: list[dict]) -> float | None:
    """Router 0's RSS growth over the last half of the run, as a share of its value at the half (goal < 0.10).

    >>> memory_growth([{"router0_rss_mib": 100}, {"router0_rss_mib": 100}, {"router0_rss_mib": 104}])
    0.04
    """
    rss = [w["router0_rss_mib"] for w in windows if w.get("router0_rss_mib")]
    if len(rss) < 2:
        return None
    half = rss[len(rss) // 2 :] if len(rss) > 2 else rss
    return round((half[-1] - half[0]) / half[0], 3)


if __name__ == "__main__":
    main()
