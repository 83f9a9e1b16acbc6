"""Benchmark: our trainer's step time against a plain TRL GRPOTrainer script, same model and settings.

Goal: ratio <= 1.0 (the pipeline's trainer adds no overhead). Both run the demo model with the demo
config's GRPO settings for a few steps, alternating, and report HF's own `train_runtime`.

    python -m bench.trainer_overhead [--steps 6] [--repeats 2] [--tiny]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from bench.harness import ROOT, compare, training_bench_args
from bench.table import Row, from_compare
from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.tasks.data.demo_task import generate
from grpo_pipeline.tasks.data.splits import write_splits
from grpo_pipeline.tasks.job import build_job_spec
from grpo_pipeline.tasks.model import ensure_demo_model
from grpo_pipeline.trainer.precision import node_default_bf16
from tests.tiny_model import create_random_model


def main() -> None:
    args = training_bench_args(__doc__)

    cfg = load_config(
        ROOT / "configs" / "demo-cpu.yaml",
        [f"train.grpo.max_steps={args.steps}", f"train.checkpoint_every={max(1, args.steps // 2)}"],
    )
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    model = create_random_model(work / "tiny") if args.tiny else ensure_demo_model(cfg.data_dir / "models")
    splits = write_splits(generate(cfg.data.demo), work / "data")
    spec = build_job_spec(cfg.train, cfg.model, str(model), splits, work / "run")
    spec = spec.model_copy(update={"mlflow_tracking_uri": None})  # the baseline logs nowhere either
    spec_path = spec.write(work / "job.json")
    compare(
        "trainer_overhead" + ("_tiny" if args.tiny else ""),
        baseline=[sys.executable, str(ROOT / "bench" / "plain_trl.py"), "--spec", str(spec_path)],
        candidate=[sys.executable, "-m", "grpo_pipeline.trainer", "--spec", str(spec_path)],
        metric="metrics.train_runtime",
        repeats=args.repeats,
        before_each=lambda: shutil.rmtree(work / "run", ignore_errors=True),
        model=str(model),
        steps=args.steps,
        precision="bf16" if node_default_bf16() else "fp32",  # both sides: the node's choice (plain_trl.py)
    )


def table_rows(load) -> list[Row]:
    result = load("trainer_overhead")
    steps = result["steps"] if result else 6
    precision = f", {result['precision']}" if result and "precision" in result else ""
    return [
        from_compare(
            result,
            f"trainer overhead (`bench.trainer_overhead`, {steps} steps, 2 checkpoints{precision})",
            "plain TRL script",
            "`python -m grpo_pipeline.trainer`",
            "<= 1.0",
        )
    ]


if __name__ == "__main__":
    main()
