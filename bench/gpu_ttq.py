"""GPU check: time to quality, LoRA against full fine-tuning at the batch each fits in the same GPU memory.

What the seed's "3-12x faster" rests on for a GPU: a LoRA run keeps no optimizer state and no gradients for the
frozen base, so in the memory full fine-tuning needs at its batch, LoRA fits a larger one: more completions per
step, each step's GRPO groups larger or more numerous. This check measures that mechanism end to end on one GPU:

1. full fine-tuning at `--batch` completions per step: its peak memory (`torch.cuda.max_memory_allocated`) is the
   budget;
2. LoRA at `--batch` x 2, x 4, ... (two steps each) until the next doubling would pass the budget (or runs out of
   memory): the largest batch that fits the same memory;
3. both train `--steps` GRPO steps on a reward a random model can learn (the share of the digit 7 in the completion,
   `sevens`), at rates 10x apart (full `--full-lr`, LoRA `--lora-lr`); each arm's wall time to a reward of
   `--target` and its completions per second.

The model is random-initialised from `configs/models/<name>.json` (nothing is fetched, as in `bench.gpu_check`), so
the reward is a toy: the ratio measures what the larger batch buys in time, not a task's quality. The CPU has no
such trade (its memory is not the limit: docs/benchmarks.md), so here only `--dry-run` runs, on a tiny model, with
no memory search (a fixed 2x batch).

    bash bench/gpu_check.sh --time-to-quality             # on the GPU machine, < 8 minutes
    python -m bench.gpu_ttq --dry-run                      # here: the code path on a tiny Qwen2, on the CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.gpu_check import TINY, _free, grpo_args, prompts, random_checkpoint
from bench.harness import ROOT

NAME = "gpu_time_to_quality"


def sevens(completions, **_) -> list[float]:
    """The share of 7s among a completion's characters: a reward a random model learns within a few dozen steps.

    >>> sevens(["7777", "7a7b", ""])
    [1.0, 0.5, 0.0]
    """
    return [str(c).count("7") / len(str(c)) if str(c) else 0.0 for c in completions]


def first_at(curve: list[dict], target: float) -> dict | None:
    """The first logged step whose mean reward reaches `target`, with its seconds since training began.

    >>> first_at([{"step": 1, "s": 2.0, "reward": 0.1}, {"step": 2, "s": 4.0, "reward": 0.6}], 0.5)
    {'step': 2, 's': 4.0, 'reward': 0.6}
    >>> first_at([{"step": 1, "s": 2.0, "reward": 0.1}], 0.5) is None
    True
    """
    return next((p for p in curve if p["reward"] >= target), None)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny Qwen2 on the CPU: checks the code path")
    p.add_argument("--model", default="qwen2.5-0.5b", help="a name of configs/models/*.json")
    p.add_argument("--batch", type=int, default=16, help="full fine-tuning's completions per step (4 per prompt)")
    p.add_argument("--steps", type=int, default=60, help="GRPO steps per arm in the race")
    p.add_argument("--target", type=float, default=0.5, help="the reward that counts as quality")
    p.add_argument("--full-lr", type=float, default=1e-5)
    p.add_argument("--lora-lr", type=float, default=1e-4, help="~10x full's, the usual rule")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--max-doublings", type=int, default=5, help="LoRA's batch is tried up to --batch x 2^this")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--completion-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for the JSON result")
    opts = p.parse_args(argv)
    if opts.dry_run:
        opts.batch, opts.steps, opts.max_doublings, opts.prompt_tokens, opts.completion_tokens = 4, 2, 1, 8, 4
    return opts


def train(model_dir: Path, arm: str, batch: int, steps: int, lr: float, opts) -> dict:
    """`steps` GRPO steps of one arm at `batch` completions per step: its reward curve (wall seconds since training
    began), completions per second and peak GPU memory; `oom` where it did not fit."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from grpo_pipeline.configs.schema import ModelConfig
    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.trainer.loading import load_model

    cuda = torch.cuda.is_available()
    _free()
    model, tokenizer = load_model(str(model_dir), model_load(ModelConfig(compute_dtype="bfloat16")))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    class Curve(TrainerCallback):
        def __init__(self):
            self.points: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.points.append(
                    {"step": state.global_step, "s": time.perf_counter() - self.t0, "reward": logs["reward"]}
                )

    curve = Curve()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[sevens],
        args=grpo_args(
            model_dir.parent / f"out-{arm}-{batch}",
            cuda,
            max_steps=steps,
            per_device_train_batch_size=batch,
            num_generations=4,
            max_completion_length=opts.completion_tokens,
            learning_rate=lr,
        ),
        processing_class=tokenizer,
        peft_config=None
        if arm == "full"
        else LoraConfig(
            task_type="CAUSAL_LM", r=opts.lora_rank, lora_alpha=2 * opts.lora_rank, target_modules="all-linear"
        ),
        train_dataset=Dataset.from_list(prompts(batch // 4 * steps, opts.prompt_tokens)),
        callbacks=[curve],
    )
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    except torch.cuda.OutOfMemoryError:
        del trainer, model
        _free()
        return {"arm": arm, "batch": batch, "oom": True}
    out = {
        "arm": arm,
        "batch": batch,
        "curve": curve.points,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "completions_per_s": batch * len(curve.points) / curve.points[-1]["s"] if curve.points else None,
    }
    del trainer, model
    _free()
    return out


def main(argv: list[str] | None = None) -> dict:
    import torch

    from grpo_pipeline.tasks.plan import load_model_config

    opts = options(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not opts.dry_run:
        raise SystemExit("no CUDA GPU here: run this on the GPU machine (bench/gpu_check.sh --time-to-quality)")
    started = time.monotonic()
    _, model_cfg = load_model_config(opts.model)
    if opts.dry_run:
        model_cfg = {**model_cfg, **TINY}
    root = Path(tempfile.mkdtemp(prefix="gpu-ttq-"))
    report: dict = {
        "name": NAME + ("_dry_run" if opts.dry_run else ""),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": opts.model,
        "settings": {k: v for k, v in vars(opts).items() if k != "out"},
    }
    try:
        model_dir = random_checkpoint(model_cfg, root / opts.model, torch.bfloat16, "cuda" if cuda else "cpu")
        full = train(model_dir, "full", opts.batch, opts.steps, opts.full_lr, opts)
        if full.get("oom"):
            raise SystemExit(f"full fine-tuning of {opts.model} does not fit at batch {opts.batch}: lower --batch")
        # LoRA's batch: the largest doubling whose two-step peak stays within full's peak (no search on a CPU)
        lora_batch, probes = opts.batch * 2, []
        if cuda:
            lora_batch = opts.batch
            for k in range(1, opts.max_doublings + 1):
                probe = train(model_dir, "lora", opts.batch * 2**k, 2, opts.lora_lr, opts)
                probes.append({key: probe.get(key) for key in ("batch", "peak_bytes", "oom")})
                if probe.get("oom") or probe["peak_bytes"] > full["peak_bytes"]:
                    break
                lora_batch = opts.batch * 2**k
        lora = train(model_dir, "lora", lora_batch, opts.steps, opts.lora_lr, opts)
        hits = {arm: first_at(run.get("curve", []), opts.target) for arm, run in (("full", full), ("lora", lora))}
        report |= {
            "full": full,
            "lora": lora,
            "probes": probes,
            "time_to_target": hits,
            "speedup": hits["full"]["s"] / hits["lora"]["s"] if hits["full"] and hits["lora"] else None,
            "throughput_ratio": (lora["completions_per_s"] or 0) / full["completions_per_s"]
            if full.get("completions_per_s")
            else None,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
        report["seconds"] = time.monotonic() - started
        report["date"] = datetime.now(UTC).isoformat(timespec="seconds")
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{report['name']}.json").write_text(json.dumps(report, indent=1))
    print(
        f"[{NAME}] full at batch {opts.batch}, LoRA at batch {lora_batch} (same memory): time to reward "
        f"{opts.target}: {hits}; speedup {report['speedup']}; completions/s ratio {report['throughput_ratio']}",
        flush=True,
    )
    return report


if __name__ == "__main__":
    main()
