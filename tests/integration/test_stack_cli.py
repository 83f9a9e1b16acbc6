"""`grpo-pipeline stack up|env|down` as a newcomer's shell sees them, against real services: `up` and `down` name
each service on stderr as they start or stop it (a minute cold: never silent), stdout holds only the exports
(`eval "$(grpo-pipeline stack up)"` must keep working), and `stack env` refuses, on stderr and with exit 2, when
no stack runs, rather than printing nothing for `eval` to set."""

import shlex
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from grpo_pipeline.cli import EXIT_CONFIG, app
from grpo_pipeline.infra import services
from grpo_pipeline.infra.stack import Stack

pytestmark = pytest.mark.integration


def test_down_names_each_service_it_stops_and_env_then_refuses(tmp_path):
    root = tmp_path / "stack"
    Stack(root).up(["postgres"])  # the one service that starts in seconds; it listens on a Unix socket only
    try:
        env = CliRunner().invoke(app, ["stack", "env", "--dir", str(root)])
        assert env.exit_code == 0 and "export GRPO_AB_LOG_URL=" in env.stdout
        down = CliRunner().invoke(app, ["stack", "down", "--dir", str(root)])
    finally:
        Stack(root).down()
    assert down.exit_code == 0 and down.stdout == ""
    assert down.stderr.startswith("PostgreSQL stopped (") and down.stderr.rstrip().endswith(" s)")
    refused = CliRunner().invoke(app, ["stack", "env", "--dir", str(root)])
    assert refused.exit_code == EXIT_CONFIG and refused.stdout == ""
    assert f"no stack runs under {root.resolve()}: start one with `grpo-pipeline stack up --dir {root}`" in (
        refused.stderr.replace("\n", " ")
    )


@pytest.mark.slow  # the four servers cold: one to three minutes
def test_up_names_each_service_as_it_starts_it_and_prints_only_exports(tmp_path):
    root = str(tmp_path / "stack")
    ports = ["--s3-port", str(services.free_port_pair())]
    ports += ["--mlflow-port", str(services.free_port()), "--prefect-port", str(services.free_port())]
    cli = [sys.executable, "-m", "grpo_pipeline.cli", "stack"]
    try:
        up = subprocess.run([*cli, "up", "--dir", root, *ports], capture_output=True, text=True, timeout=900)
        assert up.returncode == 0, up.stderr[-3000:]
        started = [line.partition(" started (")[0] for line in up.stderr.splitlines() if " started (" in line]
        assert started == ["PostgreSQL", "S3 (SeaweedFS)", "MLflow", "Prefect"]  # each step, in its order
        lines = up.stdout.splitlines()
        assert lines and all(line.startswith("export ") for line in lines)  # what eval reads, nothing else
        names = {shlex.split(line.removeprefix("export "))[0].partition("=")[0] for line in lines}
        assert {"MLFLOW_TRACKING_URI", "PREFECT_API_URL", "AWS_ENDPOINT_URL_S3"} <= names
    finally:
        down = subprocess.run([*cli, "down", "--dir", root], capture_output=True, text=True, timeout=300)
    assert down.returncode == 0 and down.stdout == ""
    stopped = [line.partition(" stopped (")[0] for line in down.stderr.splitlines() if " stopped (" in line]
    assert stopped == ["Prefect", "MLflow", "S3 (SeaweedFS)", "PostgreSQL"]
