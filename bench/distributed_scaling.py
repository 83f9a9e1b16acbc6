"""Benchmark: one training process against two (torchrun, gloo) at the same global batch, on this CPU; and what
checkpointing every step costs the main process when two ranks train (their files gathered into its upload).

1. Step time, 1 process x 8 completions against 2 processes x 4 completions per step (same prompts, same
   global batch). Reported, no goal: both sides share the same two cores (one process uses both for its
   matmuls, two processes one each), so this measures the overhead of the second rank's collectives and
   of splitting generation, not GPU scaling.
2. Two ranks, a checkpoint every step to S3 (SeaweedFS on loopback) against none.  Goal: ratio <= 1.15 (on a
   GPU step the same fixed cost is a far smaller share).

    python -m bench.distributed_scaling [--steps 6] [--repeats 2] [--tiny]
"""

from __future__ import annotations

import shutil
import sys

from bench.harness import compare, training_bench_args
from bench.table import Row, from_compare
from bench.training_setup import BUCKET, clear_store, training_setup
from grpo_pipeline.infra.services import seaweedfs_s3

LAUNCH = [sys.executable, "-m", "grpo_pipeline.trainer.launch", "--spec"]


def main() -> None:
    args = training_bench_args(__doc__)
    setup = training_setup(args, "bench-dist-")
    demo, work, model, suffix = setup.demo, setup.work, setup.model, setup.suffix
    gens = demo.train.grpo.get("num_generations", 8)
    common = [
        f"train.grpo.max_steps={args.steps}",
        f"train.grpo.num_generations={gens}",
        "train.grpo.gradient_accumulation_steps=1",
        "train.grpo.logging_steps=1",
    ]

    def spec_file(name: str, *overrides: str, endpoint: str | None = None):
        return setup.spec_file(name, *common, *overrides, endpoint=endpoint)

    one = spec_file(
        "one",
        f"train.grpo.per_device_train_batch_size={2 * gens}",
        "train.distributed.processes_per_node=1",
        "train.checkpoint_every=100000",
    )
    two = spec_file(
        "two",
        f"train.grpo.per_device_train_batch_size={gens}",
        "train.distributed.processes_per_node=2",
        "train.checkpoint_every=100000",
    )

    def clean() -> None:  # each run starts afresh rather than resuming the last one's checkpoints
        for name in ("one", "two"):
            shutil.rmtree(work / name / "checkpoints", ignore_errors=True)

    compare(
        "distributed_1_vs_2" + suffix,
        baseline=[*LAUNCH, str(one)],
        candidate=[*LAUNCH, str(two)],
        metric="metrics.train_runtime",
        repeats=args.repeats,
        before_each=clean,
        steps=args.steps,
        completions_per_step=2 * gens,
        model=str(model),
    )

    with seaweedfs_s3(work / "s3", bucket=BUCKET) as endpoint:
        two_args = [f"train.grpo.per_device_train_batch_size={gens}", "train.distributed.processes_per_node=2"]
        none = spec_file("none2", *two_args, "train.checkpoint_every=100000", endpoint=endpoint)
        every = spec_file(
            "every2", *two_args, "train.checkpoint_every=1", "train.keep_checkpoints=2", endpoint=endpoint
        )
        stores = [setup.store(n, endpoint) for n in ("none2", "every2")]
        compare(
            "distributed_checkpoint_overhead" + suffix,
            baseline=[*LAUNCH, str(none)],
            candidate=[*LAUNCH, str(every)],
            metric="metrics.train_runtime",
            repeats=args.repeats,
            before_each=lambda: [clear_store(store) for store in stores],
            steps=args.steps,
            ranks=2,
            model=str(model),
        )


def table_rows(load) -> list[Row]:
    scaling, ckpt = load("distributed_1_vs_2"), load("distributed_checkpoint_overhead")
    steps = (scaling or ckpt or {}).get("steps", 6)
    return [
        from_compare(
            scaling,
            f"2 training processes vs 1, same global batch (`bench.distributed_scaling`, CPU, {steps} steps)",
            "1 process",
            "2 processes (torchrun, gloo)",
            "",
        ),
        from_compare(
            ckpt, "2 ranks: checkpoint every step to S3 vs none (same)", "no checkpoints", "every step", "<= 1.15"
        ),
    ]


if __name__ == "__main__":
    main()
