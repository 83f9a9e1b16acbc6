"""bench.lora_vs_full --tiny: every arm in its own process on a tiny random model (real GRPO steps, real NF4), two
side by side, each run's record kept as it ends; a run whose record is missing (killed mid-way) is the only one
run again; a record kept with other settings is refused, naming the setting."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _bench(*args):
    cmd = [sys.executable, "-m", "bench.lora_vs_full", "--tiny", "--tasks", "demo", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())


def test_tiny_runs_side_by_side_keeps_each_record_redoes_only_a_missing_one_and_refuses_other_settings(
    results, tmp_path
):
    work, records = tmp_path / "work", tmp_path / "records"
    args = ["--seeds", "0", "--full-rates", "1e-3", "--adapter-rates", "1e-3", "--work", str(work)]
    args += ["--results", str(records)]
    proc = _bench(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((results / "lora_vs_full_fair_tiny.json").read_text())
    demo = report["tasks"]["demo"]
    assert demo["fair"] is False and "NOT FAIR" in proc.stdout and "1 seed (0)" in proc.stdout
    assert "within 3 % of full on correct_answer: not fair" in proc.stdout  # no verdict without fairness
    kept = {p.name: json.loads(p.read_text()) for p in (records / "demo").glob("*.json")}
    assert set(kept) == {"base-none.json", "base-nf4.json", "full-0.001-s0.json", "lora-0.001-s0.json",
                         "qlora-0.001-s0.json"}  # fmt: skip
    full, lora, qlora = kept["full-0.001-s0.json"], kept["lora-0.001-s0.json"], kept["qlora-0.001-s0.json"]
    # every run starts its curve from its base's validation scores, scored once per quantization
    assert full["curve"][0]["skill"] == sum(kept["base-none.json"]["validation"]["skill"]) / 8
    assert full["steps"] <= 2 and len(full["holdout"]["skill"]) == 8 and 0 < full["eval_share"] < 1
    assert qlora["quantization"] == "nf4" and qlora["learning_rate"] == lora["learning_rate"]  # LoRA's rate
    assert qlora["trainable_params"] < full["trainable_params"] and qlora["adapter_dtypes"] == ["torch.float32"]
    assert "merged_generation" not in full["cuts"] and "share_prompt_forward" in full["cuts"]
    assert all(r["identity"] == full["identity"] for r in kept.values())
    assert set(demo["nf4_base"]) == {"fp32", "nf4", "loss"}
    assert len(list((work / "logs").glob("demo_*.log"))) == 5  # each child its own log, none interleaved
    savings = report["savings"]
    assert savings["lora"]["optimizer_state_mb"] < savings["full"]["optimizer_state_mb"]
    assert savings["lora"]["checkpoint_mb"] < savings["full"]["checkpoint_mb"]

    # a run killed mid-way leaves at most its aside file, never a record: the next invocation runs it alone
    (records / "demo" / "lora-0.001-s0.json").rename(records / "demo" / "lora-0.001-s0.json.tmp")
    again = _bench(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [line.split(":")[0] for line in again.stdout.splitlines() if line.endswith(".log)")] == [
        "[lora_vs_full_fair] demo/lora/0.001/0"
    ]

    other = _bench(*args, "--max-steps", "3")
    assert other.returncode == 2 and str(records / "demo") in other.stderr, other.stderr[-2000:]
    assert "max_steps 2 (now 3)" in other.stderr and "--fresh" in other.stderr


def test_gsm8k_is_skipped_with_a_clear_message_where_its_folder_is_absent(results, tmp_path):
    proc = _bench(
        "--tasks", "gsm8k", "--gsm8k", str(tmp_path / "none"), "--no-savings", "--work", str(tmp_path),
        "--results", str(tmp_path / "records"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"gsm8k: skipped: {tmp_path / 'none'} has no GSM8K" in proc.stdout
