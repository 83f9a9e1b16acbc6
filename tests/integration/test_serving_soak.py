"""The serving soak's `--tiny` mode (bench/serving_soak.py) end to end: PostgreSQL from the stack, two router
processes under supervisord with the stand-in engine, traffic, the alias move and the three kills; every answered
request is in the log (rows lost 0), each faulted part serves again, the results are written and a second start
resumes (nothing left to run)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a PostgreSQL initdb and 40 s of traffic


@pytest.fixture
def work():
    # outside pytest's temporary root: a concurrent test session resets that root to 0700, which shuts PostgreSQL's
    # unprivileged user out of its data mid-run (when the tests run as root)
    folder = Path(tempfile.mkdtemp(prefix="grpo-soak-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_the_tiny_soak_loses_no_row_and_every_fault_recovers(work, results):
    cmd = [sys.executable, "-m", "bench.serving_soak", "--tiny", "--work", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((results / "serving_soak_tiny.json").read_text())
    assert report["rows_lost"] == 0 and report["answered"] > 0
    assert report["engine"].startswith("stand-in vLLM server")
    assert set(report["faults"]) == {"alias_move", "engine_kill", "router_kill", "store_kill"}
    assert all(fault["recovery_s"] is not None for fault in report["faults"].values()), report["faults"]
    windows = report["windows"]
    assert len(windows) == 8 and sum(w["answered"] for w in windows) > 0
    assert all(w["router0_rss_mib"] for w in windows)
    again = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((results / "serving_soak_tiny.json").read_text())["windows"] == windows  # resumed: done
