"""Benchmark: how far the GRPO step is from this machine's limits, both measured in the same run.

1. Compute. The machine's matmul peak: `torch.matmul` of square matrices at the training dtype, best size of
   a few. The GRPO step's training phase (loss forward + backward, generation excluded) does, per token,
   2·N forward plus 2·N backward for the input gradients through the frozen base, i.e. 4·N (N = matmul
   parameters: the decoder linears, plus the LM head on the completion tokens it scores), plus the LoRA
   matrices' 6·N_lora and attention's 4·L·T·d per token; the same counting as `grpo_pipeline.tasks.plan.step_seconds`.
   Achieved FLOP/s = those FLOPs / the phase's seconds, per step; fraction = achieved / peak.
2. Memory. Bandwidth from a large tensor copy (bytes read + written per second). Decoding one sequence reads
   every weight once per token, so tokens/s <= bandwidth / model bytes; GRPO generates a batch of B sequences
   at once, bounded by min(B·bandwidth / model bytes, peak / 2·N) (the roofline). Fraction = measured / bound.

    python -m bench.machine_limit [--steps 5] [--repeats 5] [--tiny] [--anyway]

A fraction of the machine's limits means nothing when other work shares the cores: the peak, the bandwidth and the
step would each be measured against a different share of them. So the benchmark reads the 1-minute load average
before it starts and when it ends (`other_work`); when other work kept a core busy, it says so, exits 3 and keeps
the saved results as they were (`--anyway` measures and saves, marked `loaded`; `--tiny`, a smoke test, is not
judged).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.harness import ROOT, save, spread
from bench.table import Row


def matmul_peak(dtype, repeats: int, sizes=(1024, 2048, 3072)) -> dict:
    """FLOP/s of square matmuls (2·n³ each) at the best of a few sizes; every repeat of that size kept."""
    import torch

    best: dict = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.matmul(a, b)  # warm-up: thread pool, allocator
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, b)
            samples.append(2 * n**3 / (time.perf_counter() - start))
        if not best or statistics.median(samples) > statistics.median(best["samples"]):
            best = {"size": n, "samples": samples}
    return best


def copy_bandwidth(repeats: int, mib: int = 512) -> list[float]:
    """Bytes per second of `dst.copy_(src)` on a tensor far larger than any cache (read + write counted)."""
    import torch

    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(2 * src.numel() * 4 / (time.perf_counter() - start))
    return samples


def decode_rate(model, tokenizer, repeats: int, tokens: int = 32) -> list[float]:
    """Greedy tokens per second for one sequence, forced to `tokens` new tokens (prefill time excluded)."""
    import torch

    ids = tokenizer("What is 12 + 7? Reply with just the number.", return_tensors="pt")
    samples = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            kw = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
            start = time.perf_counter()
            model.generate(**ids, max_new_tokens=1, min_new_tokens=1, **kw)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
            samples.append((tokens - 1) / (time.perf_counter() - start - prefill))
    return samples[1:]  # the first run warms up


def _probed_trainer():
    """GRPOTrainer that times generation and the training phase of each step and keeps their token shapes;
    on CUDA also each phase's peak memory (generation; loss forward + backward; the optimizer step and the rest)."""
    import torch
    from trl import GRPOTrainer

    cuda = torch.cuda.is_available()

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()  # kernels run asynchronously: time what has finished
        return time.perf_counter()

    def phase_peak() -> int | None:
        if not cuda:
            return None
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return peak

    class Probed(GRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.probe: list[dict] = []
            self._peaks: dict = {}

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            self._peaks["before_generation"] = phase_peak()  # the previous optimizer step's peak is in here
            start = now()
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            self._gen = {
                "gen_s": now() - start,
                "seqs": len(prompt_ids),
                "gen_prompt_len": max(map(len, prompt_ids)),
                "gen_steps": max(map(len, out[0])),
                "gen_tokens": sum(map(len, out[0])),
            }
            self._peaks["generation"] = phase_peak()
            return out

        def _prepare_inputs(self, inputs):
            start = now()
            out = super()._prepare_inputs(inputs)
            self._prepare_s = now() - start
            self._shape = (*out["completion_ids"].shape, out["prompt_ids"].shape[1])
            phase_peak()  # scoring and tokenising: small, and counted with generation's buffers freed
            return out

        def training_step(self, model, inputs, num_items_in_batch):
            start = now()
            loss = super().training_step(model, inputs, num_items_in_batch)
            total = now() - start
            self._peaks["train"] = phase_peak()
            batch, completion, prompt = self._shape
            self.probe.append(
                {
                    **self._gen,
                    "step_s": total,
                    "train_s": total - self._prepare_s,
                    "batch": batch,
                    "prompt_len": prompt,
                    "completion_len": completion,
                    **({"cuda_peaks": dict(self._peaks)} if cuda else {}),
                }
            )
            return loss

    return Probed


def flops(arch, lora: int, step: dict) -> dict:
    """FLOPs of one step's generation and training phase (see the module docstring for the counting).

    >>> from grpo_pipeline.tasks.plan import architecture, load_model_config
    >>> a = architecture(load_model_config("smollm2-135m")[1])
    >>> f = flops(a, 0, {"batch": 1, "prompt_len": 10, "completion_len": 10, "seqs": 1, "gen_prompt_len": 10,
    ...                  "gen_steps": 10})
    >>> round(f["train"] / (4 * a.matmul_params * 20), 2)  # ~4N per token; the head only scores 10 of 20
    0.9
    """
    body = arch.linear_params
    head = arch.vocab * arch.hidden
    attn_width = arch.heads * arch.head_dim
    t = step["prompt_len"] + step["completion_len"]
    tokens = step["batch"] * t
    fwd = (
        2 * body * tokens
        + 2 * head * step["batch"] * step["completion_len"]
        + 4 * arch.layers * t * attn_width * tokens
    )
    train = 2 * fwd + 6 * lora * tokens  # input gradients cost a forward; LoRA's weight gradients are extra
    g_t = step["gen_prompt_len"] + step["gen_steps"]
    g_tokens = step["seqs"] * g_t
    # prefill + one token per decoding step per sequence; logits only at the last position of each step
    gen = (
        2 * (body + 2 * lora) * g_tokens
        + 2 * head * step["seqs"] * step["gen_steps"]
        + 2 * arch.layers * g_t * attn_width * g_tokens
    )
    return {"train": train, "generation": gen}


LOADED_EXIT = 3
BUSY = 0.5  # another job's share of a core (load average beyond this run's own threads) that spoils a fraction


def other_work(load_before: float, load_after: float, threads: int) -> str | None:
    """Why this run's fractions cannot be trusted: the load average beyond its own `threads` before it started or
    when it ended says another job kept a core busy (`BUSY`); None when the machine was this run's.

    >>> other_work(0.1, 2.2, threads=2) is None
    True
    >>> other_work(1.3, 2.1, threads=2)
    'the 1-minute load average was 1.3 before the run started: other work is using the cores'
    >>> other_work(0.2, 3.4, threads=2)
    'the 1-minute load average was 3.4 at the end, 1.4 beyond its own 2 threads: other work shared the cores'
    """
    if load_before >= BUSY:
        return f"the 1-minute load average was {load_before:.1f} before the run started: other work is using the cores"
    if load_after - threads >= BUSY:
        return (
            f"the 1-minute load average was {load_after:.1f} at the end, {load_after - threads:.1f} beyond its own "
            f"{threads} threads: other work shared the cores"
        )
    return None


def _refuse(reason: str) -> SystemExit:
    print(
        f"[machine_limit] not measured: {reason}. A fraction of the limits would measure the other work too; run it "
        "on a quiet machine (nothing else running), or pass --anyway to measure and save it marked as loaded",
        flush=True,
    )
    return SystemExit(LOADED_EXIT)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps; the first is a warm-up and not counted")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--anyway", action="store_true", help="measure on a loaded machine too (saved as loaded)")
    opts = parser.parse_args(argv)
    judged = not (opts.anyway or opts.tiny)  # --tiny's figures are a smoke test's, never tabled
    load_before = os.getloadavg()[0]
    if judged and (reason := other_work(load_before, 0.0, threads=0)):
        raise _refuse(reason)

    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from trl import GRPOConfig

    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.data.demo_task import generate
    from grpo_pipeline.tasks.data.splits import write_splits
    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.tasks.model import ensure_demo_model
    from grpo_pipeline.tasks.plan import architecture, load_model_config
    from grpo_pipeline.trainer.loading import load_model
    from grpo_pipeline.trainer.precision import cpu_has_native_bf16, node_default_bf16
    from grpo_pipeline.trainer.rewards import resolve_reward
    from tests.tiny_model import create_random_model

    cfg = load_config(ROOT / "configs" / "demo-cpu.yaml")
    work = Path(tempfile.mkdtemp(prefix="bench-limit-"))
    model_dir = create_random_model(work / "tiny") if opts.tiny else ensure_demo_model(cfg.data_dir / "models")
    dtype = getattr(torch, cfg.model.compute_dtype)
    arch = architecture(load_model_config(str(model_dir))[1])

    bf16 = node_default_bf16()  # what the trainer chooses here: the step runs its matmuls in this precision
    precision = "bf16" if bf16 else cfg.model.compute_dtype
    print(
        f"[machine_limit] {torch.get_num_threads()} threads, {cfg.model.compute_dtype} weights, step in {precision}",
        flush=True,
    )
    # --tiny checks the code path: small matrices and copies, figures not meant to be read. Both peaks are
    # measured, so the page says what bf16 offers on this CPU (where it is emulated: 1/50 of float32; bf16 at
    # one size there, a 3072 matmul would take a minute); the step is set against the one it runs in.
    fp32_peak = matmul_peak(torch.float32, opts.repeats, sizes=(256, 512) if opts.tiny else (1024, 2048, 3072))
    bf16_peak = matmul_peak(
        torch.bfloat16,
        opts.repeats,
        sizes=(256,) if opts.tiny else (1024, 2048, 3072) if cpu_has_native_bf16() else (1024,),
    )
    peak = bf16_peak if bf16 else fp32_peak if dtype == torch.float32 else matmul_peak(dtype, opts.repeats)
    bandwidth = copy_bandwidth(opts.repeats, mib=32 if opts.tiny else 512)
    peak_s, bw_s = spread(peak["samples"]), spread(bandwidth)
    print(
        f"[machine_limit] matmul peaks: float32 {statistics.median(fp32_peak['samples']) / 1e9:.1f}, bfloat16 "
        f"{statistics.median(bf16_peak['samples']) / 1e9:.1f} GFLOP/s (native bf16: {cpu_has_native_bf16()})",
        flush=True,
    )
    print(
        f"[machine_limit] the step's matmul peak {peak_s['median'] / 1e9:.1f} GFLOP/s (n={peak['size']}); "
        f"copy bandwidth {bw_s['median'] / 1e9:.2f} GB/s",
        flush=True,
    )

    model, tokenizer = load_model(str(model_dir), model_load(cfg.model))
    bytes_per_param = torch.finfo(dtype).bits // 8
    model_bytes = arch.matmul_params * bytes_per_param
    decode = spread(decode_rate(model, tokenizer, opts.repeats))
    decode_bound = bw_s["median"] / model_bytes

    splits = write_splits(generate(cfg.data.demo), work / "data")
    grpo = dict(cfg.train.grpo) | {
        "max_steps": opts.steps,
        "bf16": bf16,
        "use_cpu": not torch.cuda.is_available(),
        "report_to": [],
        "disable_tqdm": True,
        "logging_steps": opts.steps,
    }
    args = GRPOConfig(output_dir=str(work / "out"), save_strategy="no", **grpo)
    trainer = _probed_trainer()(
        model=model,
        # as the trainer does: a length reward (the recipe's overlong_penalty) scores against the run's own cap
        reward_funcs=[
            resolve_reward(e.name, e.args, max_completion_length=args.max_completion_length) for e in cfg.train.rewards
        ],
        args=args,
        train_dataset=load_dataset("json", data_files=str(splits["train"]), split="train"),
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", **cfg.train.lora),
    )
    trainer.train()
    lora = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    steps = trainer.probe[1:] or trainer.probe
    lora_bytes = lora * bytes_per_param
    for s in steps:
        f = flops(arch, lora, s)
        s["train_flops_per_s"] = f["train"] / s["train_s"]
        s["gen_flops_per_s"] = f["generation"] / s["gen_s"]
        s["step_flops_per_s"] = (f["train"] + f["generation"]) / s["step_s"]
        s["gen_seq_tokens_per_s"] = s["seqs"] * s["gen_steps"] / s["gen_s"]  # decoding work, padding included
        s["gen_bound"] = min(
            s["seqs"] * bw_s["median"] / (model_bytes + lora_bytes),
            peak_s["median"] / (2 * (arch.matmul_params + 2 * lora)),
        )

    def med(key):
        return spread([s[key] for s in steps])

    train, gen, whole, rate = (
        med(k) for k in ("train_flops_per_s", "gen_flops_per_s", "step_flops_per_s", "gen_seq_tokens_per_s")
    )
    gen_bound = statistics.median(s["gen_bound"] for s in steps)
    report = {
        "name": "machine_limit" + ("_tiny" if opts.tiny else ""),
        "model": str(model_dir),
        "dtype": cfg.model.compute_dtype,
        "step_precision": precision,
        "native_bf16": cpu_has_native_bf16(),
        "threads": torch.get_num_threads(),
        "matmul_params": arch.matmul_params,
        "lora_params": lora,
        "model_bytes": model_bytes,
        "matmul_peak": {"size": peak["size"], **peak_s},
        "matmul_peaks": {
            name: {"size": p["size"], **spread(p["samples"])}
            for name, p in (("float32", fp32_peak), ("bfloat16", bf16_peak))
        },
        "copy_bandwidth": bw_s,
        "train_phase": {
            "flops_per_s": train,
            "fraction": train["median"] / peak_s["median"],
            "spread": [train["min"] / peak_s["median"], train["max"] / peak_s["median"]],
        },
        "generation_phase": {
            "flops_per_s": gen,
            "fraction_of_peak": gen["median"] / peak_s["median"],
            "tokens_per_s": rate,
            "bound_tokens_per_s": gen_bound,
            "fraction": rate["median"] / gen_bound,
            "spread": [rate["min"] / gen_bound, rate["max"] / gen_bound],
        },
        "whole_step": {
            "flops_per_s": whole,
            "fraction": whole["median"] / peak_s["median"],
            "generation_share_of_time": statistics.median(s["gen_s"] / s["step_s"] for s in steps),
        },
        "decode_batch1": {
            "tokens_per_s": decode,
            "bound_tokens_per_s": decode_bound,
            "fraction": decode["median"] / decode_bound,
            "spread": [decode["min"] / decode_bound, decode["max"] / decode_bound],
        },
        "steps": steps,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    loaded = other_work(load_before, os.getloadavg()[0], torch.get_num_threads())
    if loaded and judged:
        raise _refuse(loaded)
    report["loaded"] = loaded  # None: the machine was this run's
    save(report["name"], report)
    print(
        f"[machine_limit] training phase {train['median'] / 1e9:.2f} GFLOP/s = "
        f"{report['train_phase']['fraction']:.1%} of the matmul peak; whole step {report['whole_step']['fraction']:.1%} "
        f"(generation {report['whole_step']['generation_share_of_time']:.0%} of the time)"
    )
    print(
        f"[machine_limit] decode (1 sequence) {decode['median']:.1f} tok/s = {report['decode_batch1']['fraction']:.1%} "
        f"of the bandwidth bound {decode_bound:.1f}; GRPO generation ({steps[0]['seqs']} sequences) "
        f"{rate['median']:.0f} tok/s = {report['generation_phase']['fraction']:.1%} of its roofline {gen_bound:.0f}"
    )
    return report


def table_rows(load) -> list[Row]:
    r = load("machine_limit")
    name = "`bench.machine_limit`"
    if r is None:
        return [
            Row(
                f"distance from the machine's limits ({name})",
                "measured peaks",
                "GRPO step",
                None,
                "",
                note="not run yet",
            )
        ]
    peak, bw = r["matmul_peak"]["median"], r["copy_bandwidth"]["median"]
    t, g, d = r["train_phase"], r["generation_phase"], r["decode_batch1"]
    seqs = r["steps"][0]["seqs"]
    peaks = r.get("matmul_peaks", {})
    both = (
        [
            Row(
                f"matmul peak, bfloat16 against float32 on this CPU (native bf16: {r['native_bf16']}) ({name})",
                f"float32: {peaks['float32']['median'] / 1e9:.1f} GFLOP/s",
                f"bfloat16: {peaks['bfloat16']['median'] / 1e9:.1f} GFLOP/s",
                peaks["float32"]["median"] / peaks["bfloat16"]["median"],
                "",
                note="reported (time ratio)",
            )
        ]
        if peaks
        else []
    )
    return both + [
        Row(
            f"GRPO training phase FLOP/s (4·N per token, LoRA) against the matmul peak, "
            f"{r.get('step_precision', r['dtype'])} ({name})",
            f"matmul peak: {peak / 1e9:.1f} GFLOP/s",
            f"fwd + bwd: {t['flops_per_s']['median'] / 1e9:.1f} GFLOP/s",
            t["fraction"],
            "",
            spread=tuple(t["spread"]),
            note="reported (fraction)",
        ),
        Row(
            f"GRPO generation, {seqs} sequences, tokens/s against the roofline (same)",
            f"min(B·bandwidth/bytes, peak/2N): {g['bound_tokens_per_s']:.0f}/s",
            f"measured: {g['tokens_per_s']['median']:.0f}/s",
            g["fraction"],
            "",
            spread=tuple(g["spread"]),
            note="reported (fraction)",
        ),
        Row(
            "decoding one sequence, tokens/s against the bandwidth bound (same)",
            f"{bw / 1e9:.1f} GB/s ÷ {r['model_bytes'] / 2**20:.0f} MiB: {d['bound_tokens_per_s']:.1f}/s",
            f"measured: {d['tokens_per_s']['median']:.1f}/s",
            d["fraction"],
            "",
            spread=tuple(d["spread"]),
            note="reported (fraction)",
        ),
    ]


if __name__ == "__main__":
    main()
