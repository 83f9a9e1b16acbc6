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
import tempfile
from pathlib import Path

from bench.harness import ROOT, compare, training_bench_args
from bench.table import Row, from_compare
from configs.schema import load_config
from infra.services import seaweedfs_s3
from tasks.demo_task import generate
from tasks.job import build_job_spec
from tasks.model import ensure_demo_model
from tasks.splits import write_splits
from tests.tiny_model import create_random_model
from trainer.checkpoints import S3Store

LAUNCH = [sys.executable, "-m", "trainer.launch", "--spec"]


def _clear(store: S3Store) -> None:
    for key in store._keys(store.prefix + "/"):
        store.s3.delete_object(Bucket=store.bucket, Key=key)


def main() -> None:
    args = training_bench_args(__doc__)
    demo = load_config(ROOT / "configs" / "demo-cpu.yaml")
    work = Path(tempfile.mkdtemp(prefix="bench-dist-"))
    model = create_random_model(work / "tiny") if args.tiny else ensure_demo_model(demo.data_dir / "models")
    splits = write_splits(generate(demo.data.demo), work / "data")
    suffix = "_tiny" if args.tiny else ""
    gens = demo.train.grpo.get("num_generations", 8)
    common = [f"train.grpo.max_steps={args.steps}", f"train.grpo.num_generations={gens}",
              "train.grpo.gradient_accumulation_steps=1", "train.grpo.logging_steps=1"]

    def spec_file(name: str, *overrides: str, endpoint: str | None = None) -> Path:
        extra = [f"train.s3_endpoint_url={endpoint}"] if endpoint else []
        cfg = load_config(ROOT / "configs" / "demo-cpu.yaml", [*common, *extra, *overrides])
        spec = build_job_spec(cfg.train, cfg.model, str(model), splits, work / name)
        update = {"mlflow_tracking_uri": None}
        if endpoint:
            update["checkpoint_uri"] = f"s3://bench/{name}"
        return spec.model_copy(update=update).write(work / f"{name}.json")

    one = spec_file("one", f"train.grpo.per_device_train_batch_size={2 * gens}",
                    "train.distributed.processes_per_node=1", "train.checkpoint_every=100000")
    two = spec_file("two", f"train.grpo.per_device_train_batch_size={gens}",
                    "train.distributed.processes_per_node=2", "train.checkpoint_every=100000")
    def clean() -> None:  # each run starts afresh rather than resuming the last one's checkpoints
        for name in ("one", "two"):
            shutil.rmtree(work / name / "checkpoints", ignore_errors=True)

    compare("distributed_1_vs_2" + suffix, baseline=[*LAUNCH, str(one)], candidate=[*LAUNCH, str(two)],
            metric="metrics.train_runtime", repeats=args.repeats, before_each=clean, steps=args.steps,
            completions_per_step=2 * gens, model=str(model))

    with seaweedfs_s3(work / "s3", bucket="bench") as endpoint:
        two_args = [f"train.grpo.per_device_train_batch_size={gens}", "train.distributed.processes_per_node=2"]
        none = spec_file("none2", *two_args, "train.checkpoint_every=100000", endpoint=endpoint)
        every = spec_file("every2", *two_args, "train.checkpoint_every=1", "train.keep_checkpoints=2",
                          endpoint=endpoint)
        stores = [S3Store(f"s3://bench/{n}", endpoint_url=endpoint) for n in ("none2", "every2")]
        compare("distributed_checkpoint_overhead" + suffix, baseline=[*LAUNCH, str(none)],
                candidate=[*LAUNCH, str(every)], metric="metrics.train_runtime", repeats=args.repeats,
                before_each=lambda: [_clear(store) for store in stores], steps=args.steps, ranks=2, model=str(model))


def table_rows(load) -> list[Row]:
    scaling, ckpt = load("distributed_1_vs_2"), load("distributed_checkpoint_overhead")
    steps = (scaling or ckpt or {}).get("steps", 6)
    return [
        from_compare(scaling, f"2 training processes vs 1, same global batch (`bench.distributed_scaling`, CPU, "
                     f"{steps} steps)", "1 process", "2 processes (torchrun, gloo)", ""),
        from_compare(ckpt, "2 ranks: checkpoint every step to S3 vs none (same)", "no checkpoints", "every step",
                     "<= 1.15"),
    ]


if __name__ == "__main__":
    main()
