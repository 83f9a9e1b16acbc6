"""The engine's record (`ab.serve.reattach_engine`): what a router started after a killed one trusts before it
attaches to the engine left running. A real process stands for the engine (a sleeping Python with the engine's
command line as its arguments); the record file is written as the router writes it.

- the engine it names, running the command this router would run, its router gone: attached (its port and key
  taken, the record now names this router);
- another command line (another base or settings): stopped, not attached;
- an engine whose router still runs: left alone; a pid that is another process now: not the engine;
- `stop_recorded` (`stack down`) stops an engine whose router is gone, and removes the record; the record is 0600.
"""

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpo_pipeline.configs.ab import ServeConfig
from grpo_pipeline.tasks.serve.engine import Engine, EngineRecord, engine_command, stop_recorded

CFG = ServeConfig(reattach_engine=True)


@pytest.fixture
def left(tmp_path):
    """An 'engine' a dead router left: a process whose command line starts with the engine's, and its record."""
    started: list[subprocess.Popen] = []

    def leave(base: str = "base-a", owner: subprocess.Popen | None = None) -> tuple[subprocess.Popen, EngineRecord]:
        command = engine_command("/venv/python", base, 18123, CFG, {})
        # argv[0] is the Python that runs it; the rest is the engine's command line, which sleep ignores
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)", *command[1:]], start_new_session=True
        )
        started.append(proc)
        if owner is None:
            owner = subprocess.Popen([sys.executable, "-c", "pass"])
            owner.wait()  # a router that is gone
        record = EngineRecord(
            proc.pid,
            psutil.Process(proc.pid).create_time(),
            18123,
            "the-engines-key",
            [sys.executable, "-c", "import time; time.sleep(600)", *command[1:]],
            owner.pid,
            psutil.Process(owner.pid).create_time() if owner.poll() is None else time.time() - 60,
        )
        record.save(tmp_path / "engine.json")
        return proc, record

    yield leave
    for proc in started:
        proc.kill()
        proc.wait()


def engine(tmp_path: Path, base: str = "base-a") -> Engine:
    """The engine a new router would start: the same command line as the one left (sys.executable -c ... stands
    for the engine's Python and its module)."""
    made = Engine("/venv/python", base, CFG, tmp_path / "engine.log", record=tmp_path / "engine.json")
    made._command = (
        lambda adapters, port=None: [  # type: ignore[method-assign]
            sys.executable,
            "-c",
            "import time; time.sleep(600)",
            *engine_command("/venv/python", base, port or made.port, CFG, adapters)[1:],
        ]
    )
    return made


def test_the_engine_a_dead_router_left_is_attached_with_its_port_and_key(tmp_path, left):
    proc, record = left()
    new = engine(tmp_path)
    assert new.adopt().startswith(f"attached to the engine an earlier router left (pid {proc.pid})")
    assert (new.port, new.key, new.pid, new.exit_status()) == (18123, "the-engines-key", proc.pid, None)
    again = EngineRecord.load(tmp_path / "engine.json")
    assert again.pid == proc.pid and again.owner_pid != record.owner_pid  # this router holds it now
    assert oct((tmp_path / "engine.json").stat().st_mode)[-3:] == "600"  # it holds the engine's key
    proc.kill()
    proc.wait()
    assert new.exit_status() is not None  # gone: the router's next check restarts it


def test_an_engine_of_another_command_line_is_stopped_not_attached(tmp_path, left):
    proc, _ = left(base="base-b")
    new = engine(tmp_path)
    assert "ran another command line; stopped it" in new.adopt()
    assert proc.wait(30) is not None and new.adopted is None and new.port != 18123


def test_an_engine_whose_router_runs_is_left_alone_and_a_recycled_pid_is_not_the_engine(tmp_path, left):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        proc, _ = left(owner=owner)
        assert "belongs to a router that runs" in engine(tmp_path).adopt()
        assert stop_recorded(tmp_path / "engine.json") is None and proc.poll() is None
    finally:
        owner.kill()
        owner.wait()
    record = EngineRecord.load(tmp_path / "engine.json")
    assert record is not None
    EngineRecord(**{**record.__dict__, "started": record.started - 3600}).save(tmp_path / "engine.json")
    assert "is gone" in engine(tmp_path).adopt()  # the pid runs, but not the process that was recorded


def test_stop_recorded_stops_the_engine_of_a_gone_router_and_removes_the_record(tmp_path, left):
    proc, _ = left()
    assert stop_recorded(tmp_path / "engine.json") == proc.pid
    assert proc.wait(30) is not None and not (tmp_path / "engine.json").exists()
    assert stop_recorded(tmp_path / "engine.json") is None  # nothing recorded: nothing to do
