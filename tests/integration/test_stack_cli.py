"""`grpo-pipeline stack up|env|down` as a newcomer's shell sees them, against real services: `up` and `down` name
each service on stderr as they start or stop it (a minute cold: never silent), stdout holds only the exports
(`eval "$(grpo-pipeline stack up)"` must keep working), and `stack env` refuses, on stderr and with exit 2, when
no stack runs, rather than printing nothing for `eval` to set."""

import base64
import json
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
        exported = dict(shlex.split(line.removeprefix("export "))[0].partition("=")[::2] for line in lines)
        assert {"MLFLOW_TRACKING_URI", "PREFECT_API_URL", "AWS_ENDPOINT_URL_S3"} <= exported.keys()
        ui_lines_say_where_and_how_to_log_in(up.stderr, exported, root)
        status = subprocess.run([*cli, "status", "--json", "--dir", root], capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["mlflow"]["ui"] == exported["MLFLOW_TRACKING_URI"]
        assert report["prefect"]["ui"] == exported["PREFECT_API_URL"].removesuffix("/api")
        assert "PREFECT_API_AUTH_STRING" in report["prefect"]["login"]
        table = subprocess.run([*cli, "status", "--dir", root], capture_output=True, text=True, timeout=120).stdout
        assert f"UI {report['prefect']['ui']}" in table and f"UI {report['mlflow']['ui']}" in table
    finally:
        down = subprocess.run([*cli, "down", "--dir", root], capture_output=True, text=True, timeout=300)
    assert down.returncode == 0 and down.stdout == ""
    stopped = [line.partition(" stopped (")[0] for line in down.stderr.splitlines() if " stopped (" in line]
    assert stopped == ["Prefect", "MLflow", "S3 (SeaweedFS)", "PostgreSQL"]


def ui_lines_say_where_and_how_to_log_in(stderr: str, exported: dict[str, str], root: str) -> None:
    """`stack up`'s lines for a person: each UI's address, and a login that works there as written, with no
    credential on the screen. Prefect's UI sends the one password field's text as HTTP Basic (base64 of it, as
    its login page does): the whole auth string is that text."""
    mlflow_ui, prefect_ui = exported["MLFLOW_TRACKING_URI"], exported["PREFECT_API_URL"].removesuffix("/api")
    lines = {line.partition(":")[0]: line for line in stderr.splitlines() if line.endswith(f"--dir {root}`")}
    assert f"MLflow UI:  {mlflow_ui}  log in as {exported['MLFLOW_TRACKING_USERNAME']}" in lines["MLflow UI"]
    assert "MLFLOW_TRACKING_PASSWORD" in lines["MLflow UI"]
    assert f"Prefect UI: {prefect_ui}  password: the whole PREFECT_API_AUTH_STRING" in lines["Prefect UI"]
    for secret in (exported["MLFLOW_TRACKING_PASSWORD"], exported["PREFECT_API_AUTH_STRING"]):
        assert secret not in stderr
    assert services.http_status(prefect_ui) == 200  # the UI's page itself
    as_the_ui = {"Authorization": "Basic " + base64.b64encode(exported["PREFECT_API_AUTH_STRING"].encode()).decode()}
    assert services.http_status(f"{exported['PREFECT_API_URL']}/admin/version", as_the_ui) == 200
    assert services.http_status(f"{exported['PREFECT_API_URL']}/admin/version") == 401
    login = f"{exported['MLFLOW_TRACKING_USERNAME']}:{exported['MLFLOW_TRACKING_PASSWORD']}"
    assert (
        services.http_status(mlflow_ui) == 401
        and services.http_status(mlflow_ui, services.basic_auth_header(login)) == 200
    )
