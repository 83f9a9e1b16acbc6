"""bench.lora_vs_full --tiny: every arm in its own process on a tiny random model (real GRPO steps, real NF4), the
result saved and marked not fair, a resumed folder reused, one of another configuration refused."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _bench(*args):
    cmd = [sys.executable, "-m", "bench.lora_vs_full", "--tiny", "--tasks", "demo", "--arms", "full,qlora", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())


def test_tiny_runs_each_arm_resumes_and_refuses_a_mixed_folder(results, tmp_path):
    work = tmp_path / "work"
    args = ["--seeds", "0", "--full-rates", "1e-3", "--adapter-rates", "1e-3", "--work", str(work)]
    proc = _bench(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((results / "lora_vs_full_fair_tiny.json").read_text())
    demo = report["tasks"]["demo"]
    assert demo["fair"] is False and "NOT FAIR" in proc.stdout and "1 seed (0)" in proc.stdout
    assert "within 3 % of full on correct_answer: not fair" in proc.stdout  # no verdict without fairness
    runs = json.loads((work / "runs.json").read_text())["runs"]
    full, qlora = runs["demo/full/0.001/0"], runs["demo/qlora/0.001/0"]
    assert [p["step"] for p in full["curve"]][0] == 0 and full["steps"] <= 2 and len(full["holdout"]["skill"]) == 8
    assert qlora["trainable_params"] < full["trainable_params"] and qlora["adapter_dtypes"] == ["torch.float32"]
    assert "merged_generation" not in full["cuts"] and "share_prompt_forward" in full["cuts"]
    assert full["base_holdout"] and qlora["base_holdout"] and set(demo["nf4_base"]) == {"fp32", "nf4", "loss"}
    savings = report["savings"]
    assert savings["lora"]["optimizer_state_mb"] < savings["full"]["optimizer_state_mb"]
    assert savings["lora"]["checkpoint_mb"] < savings["full"]["checkpoint_mb"]

    again = _bench(*args)  # every run is kept: nothing trains again
    assert again.returncode == 0 and "[lora_vs_full_fair] demo/" not in again.stdout, again.stderr[-2000:]

    other = _bench(*args, "--max-steps", "3")
    assert other.returncode == 2 and str(work) in other.stderr and "another configuration" in other.stderr


def test_gsm8k_is_skipped_with_a_clear_message_where_its_folder_is_absent(results, tmp_path):
    proc = _bench("--tasks", "gsm8k", "--gsm8k", str(tmp_path / "none"), "--no-savings", "--work", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"gsm8k: skipped: {tmp_path / 'none'} has no GSM8K" in proc.stdout
