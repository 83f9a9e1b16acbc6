"""`grpo-pipeline stack up` when a start fails: one message naming the service, the error and the fix, no traceback,
exit 1 (2 for what the user fixes before anything starts), and nothing this `up` started left running. The
services are stood in for by real detached processes (`sleep`), so what is stopped is seen stopped; the tools the
stack runs come from this interpreter (`python -m`), wherever its console scripts are."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpo_pipeline.cli import app
from grpo_pipeline.infra import services
from grpo_pipeline.infra.stack import Stack

NO_PORTS = ["--s3-port", "0", "--mlflow-port", "0", "--prefect-port", "0"]  # nothing to collide with here


@pytest.fixture
def failing_mlflow(monkeypatch):
    """PostgreSQL and S3 start (as detached `sleep` processes); MLflow's start raises `raised[0]`."""
    spawned: list[services.Service] = []
    raised: list[BaseException] = [RuntimeError("psycopg2.OperationalError: could not connect to server")]

    def start(self: Stack, name: str) -> services.Service:
        if name == "mlflow":
            raise raised[0]
        spawned.append(services.spawn(name, ["sleep", "300"], self.root / name))
        return spawned[-1]

    monkeypatch.setattr(Stack, "_start", start)
    yield spawned, raised
    for service in spawned:  # whatever the test found, nothing outlives it
        services.stop(service, grace_s=1)


def test_a_service_that_fails_to_start_stops_what_up_started_and_says_so_without_a_traceback(tmp_path, failing_mlflow):
    spawned, _ = failing_mlflow
    result = CliRunner().invoke(app, ["stack", "up", "--dir", str(tmp_path / "stack"), *NO_PORTS])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.stderr
    failure = [line for line in result.stderr.splitlines() if line.startswith("stack up failed")]
    assert len(failure) == 1, result.stderr
    (line,) = failure
    assert "MLflow did not start" in line and "OperationalError: could not connect" in line  # the problem
    assert "stopped again what this `up` started (PostgreSQL, S3 (SeaweedFS))" in line
    assert "run `grpo-pipeline stack up` again" in line  # the fix
    assert [s.name for s in spawned] == ["postgres", "s3"]
    assert not any(services.alive(s) for s in spawned)  # nothing half-started left running
    assert json.loads((tmp_path / "stack" / "state.json").read_text())["services"] == {}


def test_ctrl_c_during_a_start_stops_what_up_started(tmp_path, failing_mlflow):
    spawned, raised = failing_mlflow
    raised[0] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        Stack(tmp_path / "stack", ports={"s3": 0, "mlflow": 0, "prefect": 0}).up()
    assert len(spawned) == 2 and not any(services.alive(s) for s in spawned)


def test_a_wait_that_ends_any_other_way_stops_the_process_it_waited_for(tmp_path):
    service = services.spawn("slow", ["sleep", "300"], tmp_path)

    def interrupted() -> bool:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        services.wait_until(interrupted, service, 60)
    assert not services.alive(service)


def test_a_folder_that_cannot_hold_the_stack_is_refused_with_exit_2_before_anything_starts(tmp_path, failing_mlflow):
    spawned, _ = failing_mlflow
    (tmp_path / "a-file").write_text("")
    result = CliRunner().invoke(app, ["stack", "up", "--dir", str(tmp_path / "a-file" / "stack"), *NO_PORTS])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.stderr and "fix: choose another --dir" in result.stderr
    assert spawned == []


def test_the_servers_run_with_this_interpreter_wherever_its_scripts_are(tmp_path, monkeypatch):
    """`prefect` and `mlflow` are run as `python -m`: an interpreter with no console scripts beside it (a symlink,
    a venv without bin/ scripts) still starts them, at the version this process imports."""
    interpreter = tmp_path / "bin" / "python"
    interpreter.parent.mkdir()
    interpreter.symlink_to(sys.executable)  # the folder holds no `prefect` nor `mlflow` script
    monkeypatch.setattr(sys, "executable", str(interpreter))
    commands: list[list[str]] = []

    def spawn(name, args, workdir, env=None):
        commands.append(args)
        raise services.ServiceError("recorded")

    monkeypatch.setattr(services, "spawn", spawn)
    with pytest.raises(services.ServiceError, match="recorded"):
        services.start_prefect(tmp_path / "p", "postgresql+asyncpg://x", auth_string="u:p", port=services.free_port())
    with pytest.raises(services.ServiceError, match="recorded"):
        services.start_mlflow(
            tmp_path / "m", "postgresql://x", "s3://b/m", {}, auth=services.MlflowAuth.generate(), port=0
        )
    assert [c[:3] for c in commands] == [[str(interpreter), "-m", "prefect"], [str(interpreter), "-m", "mlflow"]]
    assert not any(Path(c[0]).parent.joinpath(c[2]).exists() for c in commands)


def _pid_file(pgdata, pid: int) -> None:
    """A postmaster.pid as PostgreSQL writes it: pid, data dir, start time, port, socket dir, listen, shm key and
    id, status."""
    pgdata.mkdir(parents=True, exist_ok=True)
    lines = [str(pid), str(pgdata), "1796620293", "5432", str(pgdata), "", "  2146615    987654321", "ready   "]
    (pgdata / "postmaster.pid").write_text("\n".join(lines) + "\n")
    (pgdata / ".s.PGSQL.5432.lock").write_text(f"{pid}\n")


def test_a_killed_postgres_leaves_no_pid_file_or_socket_lock_that_blocks_its_start(tmp_path):
    import subprocess
    import sys

    from grpo_pipeline.infra.services import clear_stale_postmaster

    pgdata = tmp_path / "pgdata"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _pid_file(pgdata, gone.pid)  # its server is gone (no segment 987654321 is attached: none exists)
    clear_stale_postmaster(pgdata)
    assert not (pgdata / "postmaster.pid").exists() and not (pgdata / ".s.PGSQL.5432.lock").exists()

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the pid, recycled
    try:
        _pid_file(pgdata, other.pid)
        clear_stale_postmaster(pgdata)
        assert not (pgdata / "postmaster.pid").exists()
    finally:
        other.kill()
        other.wait()


def test_a_running_postgres_is_left_alone(tmp_path):
    import subprocess
    import sys

    from grpo_pipeline.infra.services import clear_stale_postmaster

    pgdata = tmp_path / "pgdata"
    pgdata.mkdir()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-D", str(pgdata)])
    try:
        _pid_file(pgdata, server.pid)  # a live process whose command line names this data dir
        clear_stale_postmaster(pgdata)
        assert (pgdata / "postmaster.pid").exists() and (pgdata / ".s.PGSQL.5432.lock").exists()
    finally:
        server.kill()
        server.wait()
