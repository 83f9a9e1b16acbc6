"""The local service stack, for users without Docker and for the integration tests.

    grpo-pipeline stack up        # PostgreSQL, S3 (SeaweedFS), MLflow server, Prefect server on 127.0.0.1
    eval "$(grpo-pipeline stack env)"   # URLs and credentials: MLFLOW_*, PREFECT_API_*, AWS_* in this shell
    grpo-pipeline stack status    # each service's health
    grpo-pipeline stack down      # stop them (data stays under .grpo/stack for the next `up`)

The same layout as docker-compose.yml: MLflow keeps its runs in PostgreSQL and its artifacts in the
bucket (served through the MLflow server, so clients need no S3 credentials), Prefect keeps its database
in PostgreSQL. Services run as background processes; their pids, ports, URLs and data directories are in
`<root>/state.json`, so any later command can check or stop them. The state file (mode 0600) also holds
the credentials generated at the first `up`: the S3 key, MLflow's admin and Prefect's auth string. Both
servers refuse requests without them (any local user can reach a loopback port); `stack env` hands them
to clients, workers and shells. PostgreSQL listens on a Unix socket only; the others listen on fixed ports
(`DEFAULT_PORTS`, the ports docker-compose.yml publishes), so URLs stay the same from one `up` to the next. The
`grpo-pipeline stack` commands themselves are in grpo_pipeline/cli.py.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from grpo_pipeline.infra import services
from grpo_pipeline.infra.services import REGION, Service, ServiceError

DEFAULT_ROOT = Path(".grpo/stack")
DEFAULT_PORTS = {"s3": 9000, "mlflow": 5000, "prefect": 4200}  # docker-compose.yml publishes the same
DEFAULT_BUCKET = "grpo"
SERVICES = ("postgres", "s3", "mlflow", "prefect")  # start order; `down` stops in reverse
DEPENDS_ON = {"postgres": (), "s3": (), "mlflow": ("postgres", "s3"), "prefect": ("postgres",)}
DATABASES = ("mlflow", "prefect")
STATE_FILE = "state.json"


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

    `ports` maps s3/mlflow/prefect to a port; 0 picks a free one (tests), None keeps the recorded or
    default port. `credentials` (access key, secret key) fix the S3 identity; by default one is
    generated at the first `up` and kept in the state file, as are MLflow's admin and Prefect's auth string.
    """

    def __init__(
        self,
        root: Path = DEFAULT_ROOT,
        *,
        ports: dict[str, int | None] | None = None,
        bucket: str | None = None,
        credentials: tuple[str, str] | None = None,
    ):
        self.root = Path(root).resolve()
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

    def _without_auth(self, name: str) -> bool:
        """A server recorded as started without authentication (by a version before auth was on): `up`
        restarts it rather than leave it open while `stack env` hands out credentials it ignores."""
        service = self.service(name)
        return name in ("mlflow", "prefect") and service is not None and service.extra.get("auth") != "basic"

    # --- health -----------------------------------------------------------------------------------------

    def healthy(self, name: str) -> bool:
        service = self.service(name)
        if service is None or not services.alive(service.pid, service.created):
            return False
        if name == "postgres":
            return services.postgres_healthy(service)
        if name == "s3":
            return services.s3_healthy(service, *self.credentials)
        return services.http_healthy(service)

    def status(self) -> dict[str, dict]:
        out = {}
        for name in SERVICES:
            service = self.service(name)
            out[name] = {
                "healthy": self.healthy(name),
                "running": service is not None and services.alive(service.pid, service.created),
                "url": service.url if service else None,
                "pid": service.pid if service else None,
                "log": service.log if service else None,
            }
        return out

    # --- up / down --------------------------------------------------------------------------------------

    def up(self, names: Iterable[str] = SERVICES) -> dict[str, Service]:
        """Start what is not already running and healthy (dependencies first); returns the services asked for.
        A fixed port that is taken is refused (PortInUse) before anything starts, so a refused `up` leaves no
        half-started stack behind."""
        todo = [name for name in with_dependencies(names) if not self.healthy(name) or self._without_auth(name)]
        for name in todo:
            port, stale = self.state["ports"].get(name), self.service(name)
            if stale is not None and services.alive(stale.pid, stale.created):
                continue  # its own unanswering process holds the port; it is stopped before the restart
            if port:  # 0 or absent (postgres): a free one is chosen at start
                services.check_port(name, port)
        for name in todo:
            stale = self.service(name)
            if stale is not None:  # running but not answering, or gone: start afresh
                services.stop(stale)
            self.state["services"][name] = self._start(name).to_dict()
            self._save()
        return {name: self._recorded(name) for name in names}

    def _start(self, name: str) -> Service:
        work, port = self.root / name, self.state["ports"].get(name) or None
        if name == "postgres":
            return services.start_postgres(work, DATABASES)
        if name == "s3":
            previous = self.state.setdefault("weed_ports", {})
            service = services.start_seaweedfs(work, self.bucket, *self.credentials, s3_port=port, ports=previous)
            self.state["weed_ports"] = service.extra["ports"]
            return service
        pg = self._recorded("postgres")  # dependencies start first
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
            )
        return services.start_prefect(
            work, services.database_uri(pg, "prefect", "asyncpg"), auth_string=self.prefect_auth_string, port=port
        )

    def down(self) -> list[str]:
        """Stop every recorded service, dependents first; data, ports and credentials stay for the next `up`."""
        stopped = []
        for name in reversed(SERVICES):
            service = self.service(name)
            if service is not None:
                services.stop(service)
                stopped.append(name)
                del self.state["services"][name]
                self._save()
        return stopped

    # --- what clients need ------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment a pipeline run, a worker or a shell needs to use this stack.

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


def exports(env: dict[str, str]) -> str:
    """Shell lines for `eval`.

    >>> print(exports({"A": "x y", "B": "1"}))
    export A='x y'
    export B=1
    """
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
