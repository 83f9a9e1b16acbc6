"""The headline benchmarks' code paths on tiny models: real GRPO steps, real NF4, results written and read back."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture
def results(tmp_path, monkeypatch):
    folder = tmp_path / "results"
    monkeypatch.setenv("BENCH_RESULTS", str(folder))
    monkeypatch.setattr("bench.harness.RESULTS", folder)
    return folder


@pytest.mark.slow
def test_lora_vs_full_runs_each_arm_in_its_own_process_and_analyses_them(results):
    cmd = [
        sys.executable,
        "-m",
        "bench.lora_vs_full",
        "--tiny",
        "--arms",
        "full,qlora",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--holdout",
        "4",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((results / "lora_vs_full_tiny.json").read_text())
    full, qlora = report["arms"]["full"], report["arms"]["qlora"]
    assert [p["step"] for p in full["curve"]] == [0, 1, 2] and len(full["final_totals"]) == 4
    assert qlora["trainable_params"] < full["trainable_params"]  # only the adapter trains over the NF4 base
    assert qlora["adapter_dtypes"] == ["torch.float32"]  # as the trainer keeps it (keep_adapter_fp32)
    assert full["peak_rss_train_mb"] > 0 and len(qlora["step_s"]) == 2
    assert set(report["analysis"]) == {"qlora"}
    assert report["analysis"]["qlora"]["memory"]["ratio"] > 0


def test_machine_limit_counts_flops_and_bounds(results):
    from bench.machine_limit import main

    report = main(["--tiny", "--steps", "2", "--repeats", "2"])
    assert (results / "machine_limit_tiny.json").is_file()
    assert report["matmul_peak"]["median"] > 0 and report["copy_bandwidth"]["median"] > 0
    assert 0 < report["train_phase"]["fraction"] and 0 < report["decode_batch1"]["fraction"]
    step = report["steps"][0]
    assert step["gen_s"] < step["step_s"] and step["train_s"] > 0 and step["seqs"] == 16


def test_gpu_check_dry_run_takes_the_gpu_code_path_on_the_cpu(tmp_path):
    from bench.gpu_check import main

    report = main(["--dry-run", "--models", "qwen2.5-0.5b", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert saved["cases"] == json.loads(json.dumps(report["cases"]))
    assert [(c["model"], c["quantization"]) for c in saved["cases"]] == [
        ("qwen2.5-0.5b", "none"),
        ("qwen2.5-0.5b", "nf4"),
    ]
    for case in saved["cases"]:
        assert "error" not in case, case.get("error")
        m = case["measured"]
        # forced full-length completions: the shapes the planner's estimate assumes
        assert (m["prompt_len"], m["completion_len"]) == (12, 6)
        assert m["trainable_params"] == case["estimate"]["trainable_params"]  # the planner counts LoRA exactly
        # the adapter stays float32 and every tensor of it moves, over the 4-bit base too
        assert m["adapter_dtypes"] == ["torch.float32"] and m["adapter_finite"], case["quantization"]
        assert m["adapter_moved_min"] > 0.99, case["quantization"]  # bf16 rounding left as little as 0.43
