"""Benchmark: evaluation throughput, batched generation against one prompt at a time, in one process.

Goal: ratio >= 3 (completions per second) on 2 CPU cores. Same model, same holdout prompts, greedy.

    python -m bench.eval_throughput [--prompts 64] [--batch-size 32] [--repeats 2] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.harness import RESULTS, ROOT
from bench.table import Row, from_compare
from grpo_pipeline.configs.schema import DemoTaskConfig, ModelConfig, load_config
from grpo_pipeline.tasks.data.demo_task import generate as demo_rows
from grpo_pipeline.tasks.evaluate import generate
from grpo_pipeline.tasks.job import model_load
from grpo_pipeline.tasks.model import ensure_demo_model
from grpo_pipeline.trainer.loading import load_model
from tests.tiny_model import create_random_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    demo = load_config(ROOT / "configs" / "demo-cpu.yaml")
    if args.tiny:
        import tempfile

        model_dir = create_random_model(Path(tempfile.mkdtemp()) / "tiny")
    else:
        model_dir = ensure_demo_model(demo.data_dir / "models")
    model, tokenizer = load_model(str(model_dir), model_load(ModelConfig()))
    model.eval()
    prompts = [r["prompt"] for r in demo_rows(DemoTaskConfig(n_holdout=args.prompts))["holdout"]]
    tokens = demo.evaluate.max_new_tokens
    samples: dict[str, list[float]] = {"one_at_a_time": [], "batched": []}
    for i in range(args.repeats):
        for side, batch in (("one_at_a_time", 1), ("batched", args.batch_size)):
            start = time.perf_counter()
            generate(model, tokenizer, prompts, tokens, batch)
            samples[side].append(len(prompts) / (time.perf_counter() - start))
            print(f"[eval_throughput] round {i + 1}/{args.repeats} {side}: {samples[side][-1]:.2f} completions/s")
    medians = {side: statistics.median(v) for side, v in samples.items()}
    report = {
        "name": "eval_throughput" + ("_tiny" if args.tiny else ""),
        "metric": "completions per second",
        "ratio": medians["batched"] / medians["one_at_a_time"],
        "median": medians,
        "samples": samples,
        "prompts": args.prompts,
        "batch_size": args.batch_size,
        "max_new_tokens": tokens,
        "model": str(model_dir),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{report['name']}.json").write_text(json.dumps(report, indent=1))
    print(f"[eval_throughput] ratio batched / one at a time = {report['ratio']:.2f}")


def table_rows(load) -> list[Row]:
    result = load("eval_throughput")
    n, batch = (result["prompts"], result["batch_size"]) if result else (64, 32)
    return [
        from_compare(
            result,
            f"evaluation throughput (`bench.eval_throughput`, {n} prompts, 16 tokens)",
            "one prompt at a time",
            f"batches of {batch}",
            ">= 3",
            value="{:.1f}/s",
            sides=("one_at_a_time", "batched"),
        )
    ]


if __name__ == "__main__":
    main()
