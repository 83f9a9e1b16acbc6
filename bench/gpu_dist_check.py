"""GPU check for several processes: the paths the CPU cannot run. NCCL ranks, FSDP2 and DeepSpeed ZeRO-2/3
through `python -m grpo_pipeline.trainer.launch` (accelerate's environment from configs/accelerate/*.yaml), a SIGTERM over
NCCL (exit 75 on every rank, then resume), and vLLM server mode (`trl vllm-serve` on its own GPU, the trainers
on the rest). Per case: exit code, seconds, tokens/s per GPU, and each rank's peak GPU memory (nvidia-smi)
against the planner's per-GPU estimate for that strategy (`grpo_pipeline.tasks.plan.estimate_memory`, sharded for FSDP).

Each case is a real job on a random-weight Qwen2.5-0.5B (configs/models/qwen2.5-0.5b.json; nothing fetched) and
runs where the machine has what it needs; the others are reported as skipped with the reason (two GPUs for
NCCL between ranks and vLLM server mode, the `deepspeed` / `vllm` packages for ZeRO and vLLM).

    bash bench/gpu_check.sh --distributed     # on the GPU machine, < 4 minutes on one H200
    python -m bench.gpu_dist_check --dry-run  # here: each case's launch command (grpo_pipeline.trainer.launch --dry-run)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "qwen2.5-0.5b"
PROMPT_TOKENS, COMPLETION_TOKENS, GENERATIONS = 32, 64, 4


def options(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print each case's launch command; run nothing")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=200, help="start no new case after this many seconds")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def cases(gpus: int) -> list[tuple[str, dict, str | None]]:
    """(name, train.distributed + grpo overrides, why it is skipped or None)."""
    two = None if gpus >= 2 else f"needs 2 GPUs (this machine has {gpus})"
    ds = None if importlib.util.find_spec("deepspeed") else "the deepspeed package is not installed"
    vllm = None if importlib.util.find_spec("vllm") else "the vllm package is not installed"
    return [
        ("ddp-1", {"processes_per_node": 1}, None),  # the single-GPU baseline: tokens/s per GPU at 1 process
        ("fsdp-1", {"processes_per_node": 1, "strategy": "fsdp"}, None),  # FSDP2 under torchrun, NCCL world of 1
        ("ddp-2", {"processes_per_node": 2}, two),
        ("fsdp-2", {"processes_per_node": 2, "strategy": "fsdp"}, two),
        ("sigterm-ddp-2", {"processes_per_node": 2}, two),
        ("zero2-1", {"processes_per_node": 1, "strategy": "zero2"}, ds),
        ("zero3-2", {"processes_per_node": 2, "strategy": "zero3"}, two or ds),
        (
            "vllm-server",
            {"processes_per_node": 1, "vllm_server_gpus": 1, "grpo": {"use_vllm": True, "vllm_mode": "server"}},
            two or vllm,
        ),
    ]


class PeakMemory(threading.Thread):
    """Highest GPU memory nvidia-smi shows for each process while a case runs (MiB)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peaks: dict[str, int] = {}
        self.running = True
        self.start()

    def run(self):
        while self.running:
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.strip().splitlines():
                pid, _, mib = line.partition(",")
                if mib.strip().isdigit():
                    self.peaks[pid.strip()] = max(self.peaks.get(pid.strip(), 0), int(mib))
            time.sleep(0.5)

    def stop(self) -> list[int]:
        self.running = False
        return sorted(self.peaks.values(), reverse=True)


def write_job(work: Path, model_dir: Path, data: Path, name: str, distributed: dict, steps: int) -> Path:
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.job import model_load, train_settings
    from grpo_pipeline.trainer.spec import JobSpec

    grpo = {
        "max_steps": steps,
        "num_generations": GENERATIONS,
        "per_device_train_batch_size": 8,
        "max_completion_length": COMPLETION_TOKENS,
        "logging_steps": 1,
        "bf16": True,
        **distributed.pop("grpo", {}),
    }
    cfg = load_config(
        None,
        ["model.compute_dtype=bfloat16", "train.checkpoint_every=2", "train.rewards=[bench.gpu_check:varied_reward]"],
    )
    train = train_settings(cfg.train).model_copy(update={"grpo": {**grpo, "min_new_tokens": COMPLETION_TOKENS}})
    train = train.model_copy(update={"distributed": train.distributed.model_copy(update=distributed)})
    spec = JobSpec(
        model_path=str(model_dir),
        model=model_load(cfg.model),
        train=train,
        train_file=str(data),
        work_dir=str(work / name / "work"),
        checkpoint_uri=str(work / name / "ckpt"),
        adapter_dir=str(work / name / "adapter"),
    )
    return spec.write(work / name / "job.json")


def estimate_gib(model_cfg: dict, strategy: str, count: int) -> float:
    from grpo_pipeline.tasks.plan.base import GIB
    from grpo_pipeline.tasks.plan.memory import estimate_memory
    from grpo_pipeline.tasks.plan.workload import Workload

    work = Workload(
        model=MODEL,
        dtype="bfloat16",
        lora_rank=16,
        lora_targets="all-linear",
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=COMPLETION_TOKENS,
        num_generations=GENERATIONS,
        effective_batch=8 * count,
    )
    shards = count if strategy in ("fsdp", "zero3") else 1
    return (
        estimate_memory(
            model_cfg, work, per_device_batch=8, gradient_checkpointing=False, generation_batch=8, shards=shards
        ).total
        / GIB
    )


def run_case(name: str, spec_path: Path, gpus_used: int, model_cfg: dict, strategy: str) -> dict:
    launch = [sys.executable, "-m", "grpo_pipeline.trainer.launch", "--spec", str(spec_path)]
    peak = PeakMemory()
    started = time.monotonic()
    proc = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    out: dict = {"case": name, "gpus": gpus_used}
    if name.startswith("sigterm"):
        ckpt = spec_path.parent / "work"
        while proc.poll() is None and not (ckpt / "hf").exists() and time.monotonic() - started < 120:
            time.sleep(0.2)
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)  # the node launcher forwards it to both NCCL ranks
        out["sigterm_code"] = proc.wait(180)
        proc = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
    out["code"] = proc.wait(300)
    reader.join(10)
    out["seconds"] = time.monotonic() - started
    out["peak_mib_per_process"] = peak.stop()
    out["estimate_gib_per_gpu"] = round(estimate_gib(model_cfg, strategy, gpus_used), 2)
    try:
        result = json.loads(lines[-1])
        out["result"] = {k: result[k] for k in ("global_step", "world_size", "resumed_from_step")}
        runtime = result["metrics"]["train_runtime"]
        tokens = 8 * gpus_used * (PROMPT_TOKENS + COMPLETION_TOKENS) * result["global_step"]
        out["tokens_per_s_per_gpu"] = tokens / runtime / gpus_used
    except (ValueError, KeyError, IndexError):
        out["tail"] = "".join(lines[-40:])
    return out


def main(argv=None) -> dict:
    opts = options(argv)
    started = time.monotonic()
    gpus = 0
    if not opts.dry_run:
        import torch

        gpus = torch.cuda.device_count()
    model_cfg = json.loads((ROOT / "configs" / "models" / f"{MODEL}.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="gpu-dist-"))
    data = work / "train.jsonl"
    from bench.gpu_check import prompts, random_checkpoint

    data.write_text("".join(json.dumps({**p, "answer": "0"}) + "\n" for p in prompts(64, PROMPT_TOKENS)))
    report: dict = {"gpus": gpus, "cases": []}
    model_dir = work / "model"
    if not opts.dry_run:
        import torch

        random_checkpoint(model_cfg, model_dir, torch.bfloat16, "cpu")
    out = Path(os.environ.get("OUT") or opts.out)
    for name, distributed, skip in cases(gpus if not opts.dry_run else 8):
        strategy = distributed.get("strategy", "ddp")
        used = distributed.get("processes_per_node", 1)
        spec_path = write_job(work, model_dir, data, name, dict(distributed), opts.steps)
        if opts.dry_run:
            cmd = [
                sys.executable,
                "-m",
                "grpo_pipeline.trainer.launch",
                "--spec",
                str(spec_path),
                "--gpus-per-node",
                "8",
                "--dry-run",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            print(f"[{name}] exit {proc.returncode}: {proc.stdout.strip() or proc.stderr.strip()[-500:]}")
            report["cases"].append({"case": name, "dry_run_code": proc.returncode})
            continue
        if skip or time.monotonic() - started > opts.budget_s:
            report["cases"].append({"case": name, "skipped": skip or "out of time"})
            continue
        case = run_case(name, spec_path, used, model_cfg, strategy)
        print(json.dumps(case), flush=True)
        report["cases"].append(case)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_dist_check.json").write_text(json.dumps(report, indent=1))  # after every case
    return report


if __name__ == "__main__":
    report = main()
    failed = [c["case"] for c in report["cases"] if c.get("code", 0) != 0 or c.get("dry_run_code", 0) != 0]
    sys.exit(1 if failed else 0)
