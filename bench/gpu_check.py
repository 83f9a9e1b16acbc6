"""GPU check: bf16 LoRA and NF4 QLoRA GRPO steps on the Qwen2.5 0.5B, 1.5B and 7B architectures; peak GPU
memory against the planner's estimate (`grpo_pipeline.tasks.plan.estimate_memory`) and step time against its time model
(`grpo_pipeline.tasks.plan.step_seconds`). Nothing is fetched: each model is random-initialised from the config JSON shipped
in `configs/models/`, saved once with a word-level tokenizer made here, and loaded through the trainer's own
`grpo_pipeline.trainer.loading.load_model` (so NF4 goes through bitsandbytes exactly as in a real QLoRA run).

Each case runs `--steps` GRPO steps (the first is a warm-up and not counted) with completions forced to full
length (`min_new_tokens`), so the token shapes are the ones the estimate assumes. Memory: the peak of
`torch.cuda.max_memory_allocated` after loading (weights included) over generation, training and optimizer
phases; the estimate's `total`, `generation_peak` and `training_peak` are saved beside it. Each case also records
the adapter's dtypes and the smallest share of entries that moved in any adapter tensor (`adapter_moved_min`): QLoRA
must keep a float32 adapter that moves everywhere over CUDA's 4-bit kernels too (docs/training.md#qlora).

    bash bench/gpu_check.sh                 # on the GPU machine, < 8 minutes on one H200
    python -m bench.gpu_check --dry-run     # here: the same code path on a tiny Qwen2 architecture, on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import tempfile
import time
import traceback
import zlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.harness import ROOT, peak_rss_mb, reset_peak_rss
from bench.table import Row

MODELS = ("qwen2.5-7b", "qwen2.5-1.5b", "qwen2.5-0.5b")  # largest first: the figure that matters most
QUANTS = ("none", "nf4")
# --dry-run: Qwen2 (biases on q, k, v; untied head as in 7B) shrunk to run in seconds on a CPU.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_window_layers": 2,
}


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny Qwen2 on the CPU: checks the code path")
    p.add_argument("--models", default=",".join(MODELS), help="names of configs/models/*.json")
    p.add_argument("--quantizations", default=",".join(QUANTS), help="none (bf16 LoRA), nf4 (QLoRA)")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per case; the first is not counted")
    p.add_argument("--batch", type=int, default=8, help="completions per step (2 prompts x 4 generations)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--completion-tokens", type=int, default=256)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=420, help="start no new case after this many seconds")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for gpu_check.json")
    opts = p.parse_args(argv)
    if opts.dry_run:
        opts.steps, opts.batch, opts.prompt_tokens, opts.completion_tokens = 2, 4, 12, 6
    return opts


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: every byte is one token, so a prompt of k digits is k tokens
    whichever pre-tokenizer reads it (transformers 5 rebuilds a Qwen2 tokenizer with Qwen's own regex, which
    splits digits one by one; transformers 4 keeps ours).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def random_checkpoint(model_cfg: dict, target: Path, dtype, device: str) -> Path:
    """Random weights for a config.json dict, saved with the tokenizer: a model directory like a real one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    fields = {k: v for k, v in model_cfg.items() if k not in ("architectures", "torch_dtype", "dtype")}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    del model
    return target


def prompts(n: int, tokens: int) -> list[dict]:
    """n plain-text prompts of exactly `tokens` digits (one token each with `byte_tokenizer`), reproducibly.

    >>> [len(p["prompt"]) for p in prompts(2, 5)]
    [5, 5]
    """
    import random

    rng = random.Random(0)
    return [{"prompt": "".join(rng.choice("0123456789") for _ in range(tokens))} for _ in range(n)]


def varied_reward(completions, **_) -> list[float]:
    """A reward that varies across a group, so advantages and gradients are non-zero on random weights.

    >>> varied_reward(["a", "b"]) == varied_reward(["a", "b"]), len(set(varied_reward(["a", "b", "c"]))) > 1
    (True, True)
    """
    return [zlib.crc32(str(c).encode()) % 101 / 100 for c in completions]


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def grpo_args(out: Path, cuda: bool, **fields: Any) -> Any:  # trl.GRPOConfig
    """TRL's GRPOConfig as the GPU checks train (this one and `bench.gpu_ttq`): bf16, no checkpoints, no reporting,
    no KL term (beta 0), every step logged, sampled at temperature 1, seed 0; `fields`: the run's own GRPOConfig
    fields (steps, batch, group size, lengths, rate)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        save_strategy="no",
        report_to=[],
        beta=0.0,
        bf16=True,
        gradient_checkpointing=False,
        logging_steps=1,
        disable_tqdm=True,
        temperature=1.0,
        seed=0,
        use_cpu=not cuda,  # transformers allows bf16 autocast on a CPU only when told
        **fields,
    )


def run_case(name: str, quant: str, model_dir: Path, model_cfg: dict, opts, gpu) -> dict:
    """Load, run GRPO steps, measure memory and time; the planner's estimates beside them."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback

    from bench.machine_limit import _probed_trainer
    from grpo_pipeline.configs.schema import ModelConfig
    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.tasks.plan import Assumptions, Settings, Workload, estimate_memory, step_seconds
    from grpo_pipeline.trainer.loading import keep_adapter_fp32, load_model

    cuda = torch.cuda.is_available()
    _free()
    started = time.perf_counter()
    model, tokenizer = load_model(str(model_dir), model_load(ModelConfig(quantization=quant, compute_dtype="bfloat16")))
    load_s = time.perf_counter() - started
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    generations = min(4, opts.batch)
    args = grpo_args(
        model_dir.parent / f"out-{name}-{quant}",
        cuda,
        max_steps=opts.steps,
        per_device_train_batch_size=opts.batch,
        num_generations=generations,
        max_completion_length=opts.completion_tokens,
        generation_kwargs={"min_new_tokens": opts.completion_tokens},
        learning_rate=1e-5,
    )
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=opts.lora_rank,
        lora_alpha=2 * opts.lora_rank,
        target_modules="all-linear",
        lora_dropout=0.0,
    )
    trainer = _probed_trainer()(
        model=model,
        reward_funcs=[varied_reward],
        args=args,
        processing_class=tokenizer,
        peft_config=lora,
        train_dataset=Dataset.from_list(prompts(opts.batch * opts.steps, opts.prompt_tokens)),
        callbacks=[keep_adapter_fp32(model)],  # as the trainer runs QLoRA (docs/training.md#qlora)
    )
    trainer.remove_callback(PrinterCallback)  # one summary line per case instead of HF's per-step dicts
    adapter = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in adapter.items()}
    trainer.train()
    steps = trainer.probe[1:] or trainer.probe
    # the probe resets the peak at each phase boundary: the run's peak is the largest phase's
    phases = [v for s in trainer.probe for v in s.get("cuda_peaks", {}).values() if v is not None]
    measured = {
        "peak_bytes": max([torch.cuda.max_memory_allocated(), *phases]) if cuda else None,
        "peak_rss_mb": None if cuda else peak_rss_mb(),
        "phase_peaks": [s.get("cuda_peaks") for s in trainer.probe] if cuda else None,
        "step_s": statistics.median(s["step_s"] for s in steps),
        "generation_s": statistics.median(s["gen_s"] for s in steps),
        "train_s": statistics.median(s["train_s"] for s in steps),
        "prompt_len": steps[0]["prompt_len"],
        "completion_len": steps[0]["completion_len"],
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "load_s": load_s,
        # QLoRA learns over CUDA's 4-bit kernels as over the CPU's: the adapter stays float32 and every one of its
        # tensors moves (a share of its entries well below 1 means updates rounded away or gradients not arriving)
        "adapter_dtypes": sorted({str(p.dtype) for p in adapter.values()}),
        "adapter_moved_min": min(float((p.detach() != before[n]).float().mean()) for n, p in adapter.items()),
        "adapter_finite": all(bool(torch.isfinite(p).all()) for p in adapter.values()),
    }
    measured["tokens_per_s"] = opts.batch * (measured["prompt_len"] + measured["completion_len"]) / measured["step_s"]
    # the run above as the planner describes it (TRL's defaults where the GRPOConfig above leaves them)
    work = Workload(
        model=name,
        quantization=quant,
        dtype="bfloat16",
        lora_rank=opts.lora_rank,
        lora_targets="all-linear",
        prompt_tokens=opts.prompt_tokens,
        completion_tokens=opts.completion_tokens,
        num_generations=generations,
        effective_batch=opts.batch,
    )
    estimate = estimate_memory(
        model_cfg, work, per_device_batch=opts.batch, gradient_checkpointing=False, generation_batch=opts.batch
    )
    out = {
        "model": name,
        "quantization": quant,
        "measured": measured,
        "estimate": {
            "bytes": estimate.total,
            "training_peak": estimate.training_peak,
            "generation_peak": estimate.generation_peak,
            "gib": estimate.gib(),
            "trainable_params": estimate.trainable_params,
        },
    }
    if measured["peak_bytes"]:
        out["memory_ratio"] = measured["peak_bytes"] / estimate.total  # measured / estimated
    if gpu is not None:
        settings = Settings(
            gpu=gpu.name,
            count=1,
            strategy="single",
            per_device_train_batch_size=opts.batch,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            gradient_checkpointing=False,
            bf16=True,
        )
        train_est, gen_est = step_seconds(model_cfg, work, settings, gpu, Assumptions())
        out["time_estimate"] = {
            "train_s": train_est,
            "generation_s": gen_est,
            "train_ratio": measured["train_s"] / train_est,
            "generation_ratio": measured["generation_s"] / gen_est,
        }
    del trainer, model
    _free()
    return out


def main(argv: list[str] | None = None) -> dict:
    opts = options(argv)
    import torch

    from grpo_pipeline.tasks.plan import PlanError, architecture, load_catalog, load_model_config

    started = time.monotonic()
    cuda = torch.cuda.is_available()
    if not cuda and not opts.dry_run:
        raise SystemExit("no CUDA GPU here: run this on the GPU machine (bench/gpu_check.sh), or --dry-run on a CPU")
    device = "cuda" if cuda else "cpu"
    gpu = None
    if cuda:
        name = torch.cuda.get_device_name()
        try:
            gpu = load_catalog().get(
                next((g for g in ("H200", "H100", "A100-80GB", "L40S") if g.split("-")[0] in name), name)
            )
        except PlanError:
            gpu = None  # not in the catalog: memory is still checked, time is not
    shm = Path("/dev/shm")
    need = 1.2 * max(2 * architecture(load_model_config(m)[1]).params for m in opts.models.split(","))  # bf16
    root = Path(
        tempfile.mkdtemp(prefix="gpu-check-", dir=shm if shm.is_dir() and shutil.disk_usage(shm).free > need else None)
    )
    report = {
        "name": "gpu_check" + ("_dry_run" if opts.dry_run else ""),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "catalog_gpu": gpu.name if gpu else None,
        "versions": {m: __import__(m).__version__ for m in ("torch", "transformers", "trl", "peft", "bitsandbytes")},
        "settings": {
            k: getattr(opts, k) for k in ("steps", "batch", "prompt_tokens", "completion_tokens", "lora_rank")
        },
        "cases": [],
    }
    try:
        for model_name in opts.models.split(","):
            _, model_cfg = load_model_config(model_name)
            if opts.dry_run:
                model_cfg = {**model_cfg, **TINY}
            model_dir = None
            for quant in opts.quantizations.split(","):
                if time.monotonic() - started > opts.budget_s:
                    report["cases"].append({"model": model_name, "quantization": quant, "skipped": "time budget"})
                    continue
                try:
                    if model_dir is None:
                        t = time.perf_counter()
                        model_dir = random_checkpoint(model_cfg, root / model_name, torch.bfloat16, device)
                        print(
                            f"[gpu_check] {model_name}: random checkpoint in {time.perf_counter() - t:.0f} s",
                            flush=True,
                        )
                    case = run_case(model_name, quant, model_dir, model_cfg, opts, gpu)
                except Exception as exc:  # one case failing (out of memory, a library mismatch) must not hide the rest
                    case = {
                        "model": model_name,
                        "quantization": quant,
                        "error": f"{type(exc).__name__}: {exc}"[:800],
                        "traceback": traceback.format_exc()[-3000:],
                    }
                    _free()
                report["cases"].append(case)
                _write(report, Path(opts.out), started)  # after every case: a hard stop keeps what was measured
                print(f"[gpu_check] {json.dumps(_summary(case))}", flush=True)
            if model_dir is not None:
                shutil.rmtree(model_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        _write(report, Path(opts.out), started)
        print(
            f"[gpu_check] {len(report['cases'])} cases in {report['seconds']:.0f} s -> {opts.out}/{report['name']}.json"
        )
    return report


def _write(report: dict, out: Path, started: float) -> None:
    report["seconds"] = time.monotonic() - started
    report["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{report['name']}.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / f"{report['name']}.json")


def _summary(case: dict) -> dict:
    """One line per case for the log: what was measured and how it compares with the planner."""
    if "measured" not in case:
        return case
    m = case["measured"]
    out = {
        "model": case["model"],
        "quantization": case["quantization"],
        "step_s": round(m["step_s"], 3),
        "tokens_per_s": round(m["tokens_per_s"], 1),
        "estimate_gib": round(case["estimate"]["gib"]["total"], 2),
        "adapter": m["adapter_dtypes"],
        "adapter_moved_min": round(m["adapter_moved_min"], 3),
        "adapter_finite": m["adapter_finite"],
    }
    if m["peak_bytes"]:
        out |= {"peak_gib": round(m["peak_bytes"] / 2**30, 2), "measured/estimate": round(case["memory_ratio"], 3)}
    else:
        out["peak_rss_mb"] = round(m["peak_rss_mb"])
    if "time_estimate" in case:
        out |= {
            "train_s/estimate": round(case["time_estimate"]["train_ratio"], 2),
            "generation_s/estimate": round(case["time_estimate"]["generation_ratio"], 2),
        }
    return out


def table_rows(load) -> list[Row]:
    r = load("gpu_check")
    if r is None:
        return [
            Row(
                "GPU check (`bench/gpu_check.sh`): peak memory vs planner estimate, 0.5B/1.5B/7B × bf16 LoRA/NF4 QLoRA",
                "`grpo_pipeline.tasks.plan.estimate_memory`",
                "`torch.cuda.max_memory_allocated`",
                None,
                "",
                note="not run on a GPU yet; `--dry-run` passes on the CPU",
            )
        ]
    rows = []
    for c in r["cases"]:
        label = f"{c['model']} {'NF4 QLoRA' if c['quantization'] == 'nf4' else 'bf16 LoRA'}"
        if "measured" not in c:
            rows.append(
                Row(
                    f"GPU check {label}",
                    "estimate",
                    "measured",
                    None,
                    "",
                    note=c.get("skipped") or c.get("error", "")[:80],
                )
            )
            continue
        m, e = c["measured"], c["estimate"]
        rows.append(
            Row(
                f"GPU check {label} on {r['device']}: peak memory, measured / planner estimate",
                f"estimate: {e['bytes'] / 2**30:.2f} GiB",
                f"measured: {m['peak_bytes'] / 2**30:.2f} GiB "
                f"({m['tokens_per_s']:.0f} tokens/s, {m['step_s']:.2f} s/step)",
                c["memory_ratio"],
                "<= 1.1",
                spread=None,
            )
        )
    return rows


if __name__ == "__main__":
    main()
