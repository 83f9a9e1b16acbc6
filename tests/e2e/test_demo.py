"""The demo config end to end on the real SmolLM2-135M: `make e2e` (about 10 minutes on 2 CPU cores)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_demo_trains_above_the_base_model(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    data_dir = ROOT / ".grpo"  # shares the converted model cache with `make demo`
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "run", "--json", "--set", f"data_dir={data_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    holdout = json.loads(proc.stdout)["holdout"]
    assert holdout["trained_reward"] > holdout["base_reward"], holdout
