"""Benchmark: the search's sampled trial score in float32 against bfloat16, the same adapters and draws' seed.

The search scores every finished trial (and re-scores the best two and the control) by sampling k completions per
validation prompt (`tasks.evaluate.sampled_means`), in the base's configured dtype (float32). On a CPU with native
bf16 the trials train in bf16; would scoring them in bf16 too (the base loaded in bfloat16) make the search
cheaper? Each adapter is scored in both precisions, alternating, at the thread count a parallel trial gets:
wall seconds per scoring (ratio bf16 / fp32, goal <= 0.7 for it to be worth the changed draws) and each
adapter's mean score in both. Measured on the demo (docs/benchmarks.md): 1.10x, bf16 slower, so the scorer
stays in float32.

    python -m bench.scoring_precision --adapter DIR [--adapter DIR ...] --prompts val-select.jsonl [--rounds 2]
    python -m bench.scoring_precision --tiny
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import ROOT, save, spread, stamp
from bench.table import Row

NAME = "scoring_precision"


def _options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", action="append", type=Path, default=[], help="a trial's adapter (repeatable)")
    parser.add_argument("--prompts", type=Path, help="the search's selection prompts (JSONL)")
    parser.add_argument("--samples", type=int, default=4, help="hpo.trial_samples (default 4)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a parallel trial's share)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model and a fresh adapter")
    opts = parser.parse_args(argv)
    if not opts.tiny and (not opts.adapter or not opts.prompts):
        parser.error("--adapter and --prompts are needed without --tiny")
    return opts


def _tiny_setup(work: Path) -> tuple[str, list[Path], Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_pipeline.tasks.data.demo_task import generate
    from grpo_pipeline.tasks.data.splits import write_splits
    from tests.tiny_model import create_random_model

    model_dir = create_random_model(work / "tiny")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),  # random B: not the base
    )
    model.save_pretrained(work / "adapter")
    splits = write_splits(generate(_demo_cfg().data.demo.model_copy(update={"n_val": 4})), work / "data")
    return str(model_dir), [work / "adapter"], Path(splits["val"])


def _demo_cfg():
    from grpo_pipeline.configs.schema import load_config

    return load_config(ROOT / "configs" / "demo-cpu.yaml")


def main(argv: list[str] | None = None) -> int:
    opts = _options(argv)
    from grpo_pipeline.tasks.hpo.stage import intra_op_threads

    with intra_op_threads(opts.threads):  # put back after: a caller in this process (a test) keeps its own setting
        return _measure(opts)


def _measure(opts: argparse.Namespace) -> int:
    from grpo_pipeline.tasks.evaluate import sampled_means
    from grpo_pipeline.tasks.model import ensure_demo_model
    from grpo_pipeline.trainer.precision import cpu_has_native_bf16

    cfg = _demo_cfg()
    work = Path(tempfile.mkdtemp(prefix="bench-scoring-"))
    if opts.tiny:
        model_path, adapters, prompts = _tiny_setup(work)
        evaluate = cfg.evaluate.model_copy(update={"max_new_tokens": 4})
    else:
        model_path, adapters, prompts = str(ensure_demo_model(ROOT / ".grpo" / "models")), opts.adapter, opts.prompts
        evaluate = cfg.evaluate
    evaluate = evaluate.model_copy(update={"samples_k": opts.samples})
    rewards = cfg.train.reward_set()
    dtypes = ("float32", "bfloat16")
    seconds: dict[str, list[float]] = {d: [] for d in dtypes}
    means: dict[str, dict[str, float]] = {str(a): {} for a in adapters}
    for r in range(opts.rounds):
        for dtype in dtypes if r % 2 == 0 else dtypes[::-1]:  # alternating: neither side always goes first
            model = cfg.model.model_copy(update={"compute_dtype": dtype})
            for adapter in adapters:
                started = time.perf_counter()
                scores = sampled_means(model_path, model, prompts, rewards, evaluate, str(adapter))
                seconds[dtype].append(time.perf_counter() - started)
                means[str(adapter)][dtype] = statistics.fmean(scores)  # seeded: every round draws alike
    ratios = [b / f for f, b in zip(seconds["float32"], seconds["bfloat16"], strict=True)]
    report = {
        "name": NAME,
        "tiny": opts.tiny,
        "native_bf16": cpu_has_native_bf16(),
        "threads": opts.threads,
        "samples": opts.samples,
        "prompts": sum(1 for line in Path(prompts).read_text().splitlines() if line.strip()),
        "max_new_tokens": evaluate.max_new_tokens,
        "seconds": {d: spread(v) for d, v in seconds.items()},
        "ratio": spread(ratios),
        "means": means,
        **stamp(),
    }
    save(NAME + ("_tiny" if opts.tiny else ""), report)
    print(
        f"[{NAME}] fp32 {report['seconds']['float32']['median']:.1f} s, bf16 "
        f"{report['seconds']['bfloat16']['median']:.1f} s per scoring: {report['ratio']['median']:.3f}x; means {means}"
    )
    return 0


def table_rows(load) -> list[Row]:
    r = load(NAME)
    if r is None:
        return []
    kind = "AVX512-BF16" if r["native_bf16"] else "AVX2-only"
    shifts = [abs(m["bfloat16"] - m["float32"]) for m in r["means"].values()]
    return [
        Row(
            f"the search's sampled trial score, {r['prompts']} prompts x {r['samples']}, {r['threads']} thread(s), "
            f"{kind} CPU (`bench.scoring_precision`)",
            f"fp32: {r['seconds']['float32']['median']:.1f} s",
            f"bf16: {r['seconds']['bfloat16']['median']:.1f} s",
            r["ratio"]["median"],
            "<= 0.7",
            spread=(r["ratio"]["min"], r["ratio"]["max"]),
            note="" if r["native_bf16"] else "not judged: this CPU has no native bf16 (the scorer stays fp32 there)",
        ),
        Row(
            f"the same, the largest shift of an adapter's mean sampled score, bf16 against fp32 ({len(shifts)} adapters)",
            "fp32",
            "bf16",
            max(shifts),
            "",
            note=f"largest shift {max(shifts):.3f} (reward 0-2)",
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
