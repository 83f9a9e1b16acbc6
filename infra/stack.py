"""The local service stack, for users without Docker and for the integration tests.

    grpo-pipeline stack up        # PostgreSQL, S3 (SeaweedFS), MLflow server, Prefect server on 127.0.0.1
    eval "$(grpo-pipeline stack env)"   # URLs and credentials: MLFLOW_*, PREFECT_API_*, AWS_* in this shell
    grpo-pipeline stack status    # each service's health; the router's own state and restarts; the UIs' URLs
    grpo-pipeline stack down      # stop them (data stays under .grpo/stack for the next `up`)
    grpo-pipeline stack up --serve      # also `grpo-pipeline serve` on 127.0.0.1:8000: the registry's champion and
                                        # challenger, its request log in the stack's PostgreSQL (database `ab`)

The same layout as docker-compose.yml: MLflow keeps its runs in PostgreSQL and its artifacts in the
bucket (served through the MLflow server, so clients need no S3 credentials), Prefect keeps its database
in PostgreSQL. Services run as background processes; their pids, ports, URLs and data directories are in
`<root>/state.json`, so any later command can check or stop them. The state file (mode 0600) also holds
the credentials generated at the first `up`: the S3 key, MLflow's admin and Prefect's auth string. Both
servers refuse requests without them (any local user can reach a loopback port); `stack env` hands them
to clients, workers and shells. PostgreSQL listens on a Unix socket only; the others listen on fixed ports
(`DEFAULT_PORTS`, the ports docker-compose.yml publishes), so URLs stay the same from one `up` to the next. The
`grpo-pipeline stack` commands themselves are in grpo_pipeline/cli/stack.py.

The router (`serve`, only with `up --serve`) reads the MLflow registry as the stack's admin, writes its request
log to the `ab` database, and asks clients for the key generated at the first `up` (`GRPO_SERVE_API_KEY` in
`stack env`); its engine listens on loopback with a key of its own that only the router holds. supervisord starts
a killed router again, and the router attaches to the engine the killed one left (`ab.serve.reattach_engine`), so
service is back within seconds; `stack down` stops the engine too, should its router be gone.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import sys
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo_pipeline.infra import services
from grpo_pipeline.infra.services import REGION, Refused, Service, ServiceError

DEFAULT_ROOT = Path(".grpo/stack")
DEFAULT_PORTS = {"s3": 9000, "mlflow": 5000, "prefect": 4200, "serve": 8000}  # docker-compose.yml publishes the same
DEFAULT_BUCKET = "grpo"
SERVICES = ("postgres", "s3", "mlflow", "prefect", "serve")  # start order; `down` stops in reverse
TITLES = {
    "postgres": "PostgreSQL",
    "s3": "S3 (SeaweedFS)",
    "mlflow": "MLflow",
    "prefect": "Prefect",
    "serve": "the router",
}
DEFAULT_UP = ("postgres", "s3", "mlflow", "prefect")  # what `up` starts; the router only with --serve
DEPENDS_ON = {
    "postgres": (),
    "s3": (),
    "mlflow": ("postgres", "s3"),
    "prefect": ("postgres",),
    "serve": ("postgres", "mlflow"),
}
DATABASES = ("mlflow", "prefect", "ab")  # ab: the router's request log
STATE_FILE = "state.json"
LOG_URL_ENV = "GRPO_AB_LOG_URL"  # grpo_pipeline.tasks.serve.ab_log.LOG_URL_ENV; not imported from there: SQLAlchemy
ROUTER_REFUSED = 2  # `grpo-pipeline serve`'s exit status for what the user fixes (grpo_pipeline.cli.EXIT_CONFIG)


# Wraps each service's start or stop, given its name: how `grpo-pipeline stack up|down` shows progress
Step = Callable[[str], AbstractContextManager[object]]


def _unshown(name: str) -> AbstractContextManager[object]:
    return nullcontext()


class ServeRefused(Refused):
    """The router refused to start for a reason the user fixes (no champion alias, the registry unreachable,
    an adapter's rank above the engine's): `stack up --serve` exits 2 with the router's message."""


def with_dependencies(names: Iterable[str]) -> list[str]:
    """The services to start for `names`, dependencies first, in start order.

    >>> with_dependencies(["mlflow"])
    ['postgres', 's3', 'mlflow']
    """
    wanted: set[str] = set()

    def add(name: str) -> None:
        if name not in DEPENDS_ON:
            raise ServiceError(f"unknown service {name!r}; choose from {', '.join(SERVICES)}")
        wanted.add(name)
        for dep in DEPENDS_ON[name]:
            add(dep)

    for name in names:
        add(name)
    return [name for name in SERVICES if name in wanted]


class Stack:
    """The four services under one root directory, with their state in `<root>/state.json`.

    `ports` maps s3/mlflow/prefect/serve to a port; 0 picks a free one (tests), None keeps the recorded or
    default port. `credentials` (access key, secret key) fix the S3 identity; by default one is
    generated at the first `up` and kept in the state file, as are MLflow's admin and Prefect's auth string.
    `start_timeout_s` caps each server's start (`services.wait_until`: a start that stops making progress ends
    sooner).
    """

    def __init__(
        self,
        root: Path = DEFAULT_ROOT,
        *,
        ports: dict[str, int | None] | None = None,
        bucket: str | None = None,
        credentials: tuple[str, str] | None = None,
        start_timeout_s: float = services.START_CEILING_S,
    ):
        self.root = Path(root).resolve()
        self.start_timeout_s = start_timeout_s  # each server's ceiling; it is waited for while it makes progress
        self.state = self._load()
        recorded = self.state.setdefault("ports", {})
        for name, default in DEFAULT_PORTS.items():
            wanted = (ports or {}).get(name)
            if wanted is not None:
                recorded[name] = wanted  # 0: a free port, chosen when the service starts
            recorded.setdefault(name, default)
        self.state["bucket"] = bucket or self.state.get("bucket") or DEFAULT_BUCKET
        if credentials is not None:
            self.state["s3_credentials"] = list(credentials)
        self.state.setdefault("s3_credentials", [f"grpo-{secrets.token_hex(4)}", secrets.token_urlsafe(30)])
        # A state file from before auth was on gets them here; they are saved with the first service `up` starts.
        self.state.setdefault("mlflow_auth", asdict(services.MlflowAuth.generate()))
        self.state.setdefault("prefect_auth_string", services.prefect_auth())
        self.state.setdefault("serve_api_key", secrets.token_urlsafe(32))  # what the router's clients send
        self.state.setdefault("services", {})

    # --- state ------------------------------------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.root / STATE_FILE

    def _load(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as exc:
            raise ServiceError(
                f"{self.state_path} is not valid JSON ({exc}); stop the services by hand and delete it"
            ) from None
        except OSError as exc:  # a --dir under a file, or one this user may not read
            raise Refused(f"cannot use {self.root} for the stack ({exc.strerror}); fix: choose another --dir") from None

    def _save(self) -> None:
        """Written aside then renamed, never half-written; 0600 because it holds the stack's credentials."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.state, f, indent=1)
        tmp.replace(self.state_path)

    def service(self, name: str) -> Service | None:
        data = self.state["services"].get(name)
        return Service.from_dict(data) if data else None

    def _recorded(self, name: str) -> Service:
        service = self.service(name)
        if service is None:
            raise ServiceError(f"{name} is not recorded in {self.state_path}: start it with `grpo-pipeline stack up`")
        return service

    @property
    def bucket(self) -> str:
        return self.state["bucket"]

    @property
    def credentials(self) -> tuple[str, str]:
        access, secret = self.state["s3_credentials"]
        return access, secret

    @property
    def mlflow_auth(self) -> services.MlflowAuth:
        return services.MlflowAuth(**self.state["mlflow_auth"])

    @property
    def prefect_auth_string(self) -> str:
        return self.state["prefect_auth_string"]

    @property
    def serve_api_key(self) -> str:
        return self.state["serve_api_key"]

    def _without_auth(self, name: str) -> bool:
        """A server recorded as started without authentication (by a version before auth was on): `up`
        restarts it rather than leave it open while `stack env` hands out credentials it ignores."""
        service = self.service(name)
        return name in ("mlflow", "prefect") and service is not None and service.extra.get("auth") != "basic"

    def _to_start(self, name: str, serve: ServeOptions | None = None) -> bool:
        """Whether `up` (re)starts `name`: it is not running and answering, it runs without authentication
        (`_without_auth`), or it is the router serving another config or engine than `serve` asks for (the
        options `up --serve` was given are the ones the user expects to run, not an earlier start's)."""
        if not self.healthy(name) or self._without_auth(name):
            return True
        running = self.state.get("serve_options")
        return name == "serve" and serve is not None and running is not None and serve.differs_from(running)

    # --- health -----------------------------------------------------------------------------------------

    def healthy(self, name: str) -> bool:
        service = self.service(name)
        if service is None or not services.alive(service):
            return False
        if name == "postgres":
            return services.postgres_healthy(service)
        if name == "s3":
            return services.s3_healthy(service, *self.credentials)
        if name == "serve":
            return router_ready(service)
        return services.http_healthy(service)

    def status(self) -> dict[str, dict]:
        """Each service's health; MLflow's and Prefect's with where their UI is and how to log in; the router's
        only when it was started (`up --serve`), with its own state (`router_status`)."""
        out: dict[str, dict] = {}
        for name in SERVICES:
            service = self.service(name)
            if name not in DEFAULT_UP and service is None:
                continue
            out[name] = {
                "healthy": self.healthy(name),
                "running": service is not None and services.alive(service),
                "url": service.url if service else None,
                "pid": service.pid if service else None,
                "log": service.log if service else None,
            }
            if name in UI_LOGIN and service is not None:
                out[name] |= {"ui": ui_url(service), "login": UI_LOGIN[name]}
            if name == "serve" and service is not None:
                out[name] |= router_status(service)
                out[name]["healthy"] = out[name]["state"] == "up"
        return out

    # --- up / down --------------------------------------------------------------------------------------

    def up(
        self, names: Iterable[str] = DEFAULT_UP, serve: ServeOptions | None = None, step: Step = _unshown
    ) -> dict[str, Service]:
        """Start what is not already running and healthy (dependencies first); returns the services asked for.
        A fixed port that is taken (PortInUse) or a folder that cannot be written is refused before anything
        starts. A service that fails to start (or Ctrl-C) stops what this `up` started before the failure, so no
        half-started stack is left running; the error says which service and where its log is (a `ServiceError`,
        whatever the failure was). The router's refusal (`ServeRefused`: no champion yet...) is the exception: the
        services under it are whole and stay up, as its message says. `serve`: how to start the router, when
        `names` holds it (recorded, so the state says what runs). `step` wraps each service's start (the CLI's
        progress line)."""
        names = list(names)
        if "serve" in names and serve is None:
            raise ServiceError("starting the router needs its options (a config and the engine's Python)")
        todo = [name for name in with_dependencies(names) if self._to_start(name, serve)]
        stale_options = self.state.get("serve_options")
        if serve is not None and "serve" in names:
            self.state["serve_options"] = serve.as_dict()
        for name in todo:
            port, stale = self.state["ports"].get(name), self.service(name)
            if stale is not None and services.alive(stale):
                continue  # its own unanswering process holds the port; it is stopped before the restart
            if port:  # 0 or absent (postgres): a free one is chosen at start
                services.check_port(name, port)
        if todo:
            self._writable()
        started: list[str] = []
        for name in todo:
            stale = self.service(name)
            try:
                with step(name):
                    if stale is not None:  # running but not answering, or gone: start afresh
                        services.stop(stale)
                        if name == "serve" and self.state.get("serve_options") != stale_options:
                            stop_engine_left(Path(stale.workdir))  # another config's: the new router would not attach
                        del self.state["services"][name]
                    self.state["services"][name] = self._start(name).to_dict()
            except ServeRefused:
                raise
            except BaseException as exc:
                self._stop_started(started)
                if isinstance(exc, Exception) and not isinstance(exc, Refused):
                    raise ServiceError(self._failed(name, exc, started)) from exc
                raise
            started.append(name)
            self._save()
        return {name: self._recorded(name) for name in names}

    def _writable(self) -> None:
        """Refused, before anything starts, when the stack's folder cannot hold its data and state."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / ".writable"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise Refused(
                f"cannot write the stack's data under {self.root} ({exc.strerror}); fix: choose another --dir"
            ) from None

    def _stop_started(self, started: list[str]) -> None:
        """Stop what this `up` started, the last first, and forget it in the state file."""
        for name in reversed(started):
            if (service := self.service(name)) is not None:
                services.stop(service)
                del self.state["services"][name]
        self._save()

    def _failed(self, name: str, exc: Exception, started: list[str]) -> str:
        """What `up` says when `name` failed to start: the service, the error, what was stopped, where to look."""
        reason = str(exc) if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}"
        undone = f"; stopped again what this `up` started ({', '.join(TITLES[n] for n in started)})" if started else ""
        return (
            f"{TITLES[name]} did not start{undone}; fix what its log under {self.root / name} says, then run "
            f"`grpo-pipeline stack up` again. The error: {reason}"
        )

    def _start(self, name: str) -> Service:
        work, port = self.root / name, self.state["ports"].get(name) or None
        if name == "postgres":
            return services.start_postgres(work, DATABASES)
        if name == "s3":
            previous = self.state.setdefault("weed_ports", {})
            service = services.start_seaweedfs(
                work, self.bucket, *self.credentials, s3_port=port, ports=previous, ready_timeout_s=self.start_timeout_s
            )
            self.state["weed_ports"] = service.extra["ports"]
            return service
        pg = self._recorded("postgres")  # dependencies start first
        if name == "serve":
            return self._start_router(work, port or services.free_port(), pg)  # 0: a free one, as the others
        if name == "mlflow":
            access, secret = self.credentials
            env = {
                "AWS_ACCESS_KEY_ID": access,
                "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_DEFAULT_REGION": REGION,
                "MLFLOW_S3_ENDPOINT_URL": self._recorded("s3").url,
            }
            return services.start_mlflow(
                work,
                services.database_uri(pg, "mlflow"),
                f"s3://{self.bucket}/mlflow",
                env,
                auth=self.mlflow_auth,
                port=port,
                ready_timeout_s=self.start_timeout_s,
            )
        return services.start_prefect(
            work,
            services.database_uri(pg, "prefect", "asyncpg"),
            auth_string=self.prefect_auth_string,
            port=port,
            ready_timeout_s=self.start_timeout_s,
        )

    def _start_router(self, work: Path, port: int, pg: Service) -> Service:
        """`grpo-pipeline serve` on loopback, detached; ready once /ready says its engine answers with the
        champion loaded (the engine's start-up: minutes on a CPU)."""
        options = ServeOptions(**self.state["serve_options"])
        mlflow = self._recorded("mlflow")
        env = {
            LOG_URL_ENV: services.database_uri(pg, "ab"),
            "GRPO_SERVE_API_KEY": self.serve_api_key,
            "MLFLOW_TRACKING_URI": mlflow.url,
            **self.mlflow_auth.client_env(),
        }
        log = work / "serve.log"
        before = log.stat().st_size if log.is_file() else 0  # the log is kept across starts: report this one's
        # Under supervisord: a router that exits (its engine would not come back: status 1) or is killed is started
        # again; a refusal (status 2: what the user fixes) is not.
        service = services.start_supervised(
            "serve", router_command(options, port, mlflow.url, work / "data"), work, env, settled=(ROUTER_REFUSED,)
        )
        service.url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            state = services.supervised_state(service)
            if state is not None and state["exitstatus"] == ROUTER_REFUSED and state["statename"] != "RUNNING":
                services.stop(service)
                # what the user fixes (no champion yet, the registry unreachable...): the router's own words
                raise ServeRefused(
                    f"the router did not start: {services.log_tail(service.log, 5, since=before)}\nThe other services run; "
                    "fix that and run `grpo-pipeline stack up --serve` again"
                )
            return router_ready(service)

        # no stall limit: the router idles while its engine loads, and the engine has its own limit
        services.wait_until(ready, service, options.startup_timeout_s + 60, stall_s=None)
        return service

    def down(self, step: Step = _unshown) -> list[str]:
        """Stop every recorded service, dependents first; data, ports and credentials stay for the next `up`.
        `step` wraps each service's stop (the CLI's progress line)."""
        stopped = []
        for name in reversed(SERVICES):
            service = self.service(name)
            if service is not None:
                with step(name):
                    services.stop(service)
                    if name == "serve":  # a router stopped cleanly took its engine; a killed one left it running
                        stop_engine_left(Path(service.workdir))
                stopped.append(name)
                del self.state["services"][name]
                self._save()
        return stopped

    # --- what clients need ------------------------------------------------------------------------------

    def running(self) -> list[str]:
        """The recorded services whose process runs, answering or not: none before the first `up`, after
        `down`, or after a reboot left the state file behind."""
        return [name for name in SERVICES if (s := self.service(name)) is not None and services.alive(s)]

    def env(self) -> dict[str, str]:
        """The environment a pipeline run, a worker or a shell needs to use this stack.

        GRPO_AB_LOG_URL is the request log in PostgreSQL (database `ab`): where the router writes and `grpo-pipeline
        ab status|decide` and the `ab-decide` flow read (without it they read an empty SQLite log under data_dir).
        MLFLOW_S3_ENDPOINT_URL and AWS_ENDPOINT_URL_S3 point MLflow's and boto3's S3 clients (checkpoints
        with `train.checkpoint_uri=s3://<bucket>/...`) at the local S3 API. MLFLOW_TRACKING_USERNAME/PASSWORD
        (MLflow's admin) and PREFECT_API_AUTH_STRING are what the servers ask of every client.
        """
        out: dict[str, str] = {}
        if (mlflow := self.service("mlflow")) is not None:
            out["MLFLOW_TRACKING_URI"] = mlflow.url
            if mlflow.extra.get("auth") == "basic":
                out |= self.mlflow_auth.client_env()
        if (prefect := self.service("prefect")) is not None:
            out["PREFECT_API_URL"] = prefect.url
            if prefect.extra.get("auth") == "basic":
                out["PREFECT_API_AUTH_STRING"] = self.prefect_auth_string
        if (pg := self.service("postgres")) is not None:  # the router's request log: what `ab status|decide` read
            out[LOG_URL_ENV] = services.database_uri(pg, "ab")
        if (serve := self.service("serve")) is not None:  # the application's side: where to send, with what key
            out["GRPO_SERVE_URL"] = f"{serve.url}/v1"
            out["GRPO_SERVE_API_KEY"] = self.serve_api_key
        if (s3 := self.service("s3")) is not None:
            access, secret = self.credentials
            out |= {
                "AWS_ACCESS_KEY_ID": access,
                "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_DEFAULT_REGION": REGION,
                "AWS_ENDPOINT_URL_S3": s3.url,
                "MLFLOW_S3_ENDPOINT_URL": s3.url,
            }
        return out


@dataclass(frozen=True)
class ServeOptions:
    """How `up --serve` starts the router: the pipeline config it serves (None: the defaults), the Python that
    runs vLLM, and how long the engine may take to start."""

    config: str | None
    engine_python: str
    startup_timeout_s: float = 900.0

    def as_dict(self) -> dict:
        return asdict(self)

    def differs_from(self, recorded: dict) -> bool:
        """Whether a router started with `recorded` options serves something else (the start-up timeout aside).

        >>> ServeOptions("a.yaml", "/v/python").differs_from(ServeOptions("a.yaml", "/v/python", 60.0).as_dict())
        False
        >>> ServeOptions("b.yaml", "/v/python").differs_from({"config": "a.yaml", "engine_python": "/v/python"})
        True
        """
        return (self.config, self.engine_python) != (recorded.get("config"), recorded.get("engine_python"))


UI_LOGIN = {  # where the credentials are, never what they are
    "mlflow": "user MLFLOW_TRACKING_USERNAME, password MLFLOW_TRACKING_PASSWORD, from `grpo-pipeline stack env`",
    "prefect": "password: the whole PREFECT_API_AUTH_STRING, user:password, from `grpo-pipeline stack env`",
}


def ui_url(service: Service) -> str:
    """Where a browser opens a service's UI: MLflow's at its URL, Prefect's at its API's URL without `/api`.

    >>> ui_url(Service("prefect", 1, "http://127.0.0.1:4200/api", "", "", 0.0))
    'http://127.0.0.1:4200'
    """
    return service.url.removesuffix("/api")


def engine_record(work: Path) -> Path:
    """Where the stack's router records its engine (`ab.serve.reattach_engine`): its data folder's serve/."""
    return work / "data" / "serve" / "engine.json"


def stop_engine_left(work: Path) -> int | None:
    """Stop the engine a killed router left running (none when its router stopped cleanly); its pid."""
    from grpo_pipeline.tasks.serve.engine import stop_recorded  # httpx and pydantic: not for every `stack` command

    return stop_recorded(engine_record(work))


# supervisord's states of a program that runs no process and will not start one by itself
SUPERVISED_STOPPED = ("STOPPED", "STOPPING", "EXITED", "FATAL")


def router_status(service: Service) -> dict:
    """The router's own state, from the router and its supervisor rather than from supervisord's pid alone:
    `state` up (its /ready answers 200), starting (its first start: the port not bound yet, or its engine
    starting), restarting (started again by supervisord, or its engine restarting, and not ready yet) or stopped
    (supervisord gone, or the program stopped, exited or given up); `restarts`, supervisord's restarts of it;
    `router_pid`, the program's own pid (`pid` is supervisord's); and from its /health and /ready, `engine` (the
    engine's state as the router sees it), `engine_restarts` and, when not ready, `reason`."""
    program = services.supervised_state(service) if services.alive(service) else None
    restarts = services.supervised_restarts(service) if program is not None else None
    health = services.http_answer(f"{service.url}/health")[1]
    code, ready = services.http_answer(f"{service.url}/ready")
    up = code == 200
    if not services.alive(service) or (program is not None and program["statename"] in SUPERVISED_STOPPED):
        state = "stopped"
    elif up:
        state = "up"
    elif restarts or (health or {}).get("engine") in ("restarting", "gave up"):
        state = "restarting"
    else:
        state = "starting"
    return {
        "state": state,
        "restarts": restarts,
        "router_pid": (program["pid"] or None) if program and program["statename"] not in SUPERVISED_STOPPED else None,
        "engine": (health or {}).get("engine"),
        "engine_restarts": (health or {}).get("restarts"),
        **({"reason": ready["reason"]} if ready and not up and ready.get("reason") else {}),
        **({"exit_status": program["exitstatus"]} if program and state == "stopped" else {}),
    }


def router_ready(service: Service) -> bool:
    """The router's readiness (`/ready`: its engine answers and the champion is loaded), not its liveness: a
    router whose engine is restarting is up but serves nothing."""
    return services.http_status(f"{service.url}/ready") == 200


def router_command(options: ServeOptions, port: int, tracking_uri: str, data_dir: Path) -> list[str]:
    """The router's command line: `grpo-pipeline serve` on loopback, against the stack's registry.

    >>> " ".join(router_command(ServeOptions(None, "/v/python"), 8000, "http://127.0.0.1:5000", Path("/d"))[1:])
    '-m grpo_pipeline.cli serve --host 127.0.0.1 --port 8000 --set ab.serve.reattach_engine=true --set tracking.mlflow_tracking_uri=http://127.0.0.1:5000 --set ab.serve.engine_python=/v/python --set data_dir=/d'
    """
    cmd = [sys.executable, "-m", "grpo_pipeline.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if options.config:
        cmd += ["--config", options.config]
    return cmd + [
        "--set",
        "ab.serve.reattach_engine=true",  # supervisord starts a killed router again: it attaches to the engine left
        "--set",
        f"tracking.mlflow_tracking_uri={tracking_uri}",
        "--set",
        f"ab.serve.engine_python={options.engine_python}",
        "--set",
        f"data_dir={data_dir}",
    ]


def exports(env: dict[str, str]) -> str:
    """Shell lines for `eval`.

    >>> print(exports({"A": "x y", "B": "1"}))
    export A='x y'
    export B=1
    """
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
