"""Benchmark: what surviving preemption costs, against a real S3 API (SeaweedFS on loopback).

1. Step time with a checkpoint every step to S3 against no checkpoints at all.   Goal: ratio <= 1.10.
2. Time from a restart to its first new step (fetch + resume) against a cold start. Goal: ratio <= 1.5.
3. Seconds of work a preemption costs with the demo config's checkpoint interval (derived from 1 and 2).

    python -m bench.checkpoint_overhead [--steps 6] [--repeats 2] [--tiny]
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.harness import RESULTS, compare, training_bench_args
from bench.table import Row, from_compare
from bench.training_setup import BUCKET, clear_store, training_setup
from grpo_pipeline.infra.services import seaweedfs_s3
from grpo_pipeline.trainer.checkpoints import FINAL, checkpoint_name

TRAINER = [sys.executable, "-m", "grpo_pipeline.trainer", "--spec"]


def main() -> None:
    args = training_bench_args(__doc__)
    setup = training_setup(args, "bench-ckpt-")
    demo, work, model, suffix = setup.demo, setup.work, setup.model, setup.suffix

    with seaweedfs_s3(work / "s3", bucket=BUCKET) as endpoint:

        def spec_file(name: str, *overrides: str):
            return setup.spec_file(name, *overrides, endpoint=endpoint), setup.store(name, endpoint)

        steps = f"train.grpo.max_steps={args.steps}"
        none_path, none_store = spec_file("none", steps, "train.checkpoint_every=100000")
        every_path, every_store = spec_file("every", steps, "train.checkpoint_every=1", "train.keep_checkpoints=2")
        steady = compare(
            "checkpoint_every_step_s3" + suffix,
            baseline=[*TRAINER, str(none_path)],
            candidate=[*TRAINER, str(every_path)],
            metric="metrics.train_runtime",
            repeats=args.repeats,
            before_each=lambda: (clear_store(none_store), clear_store(every_store)),
            steps=args.steps,
            model=str(model),
        )

        three = ["train.grpo.max_steps=3", "train.checkpoint_every=1", "train.keep_checkpoints=3"]
        cold_path, cold_store = spec_file("cold", *three)
        warm_path, warm_store = spec_file("warm", *three)
        subprocess.run([*TRAINER, str(warm_path)], check=True, capture_output=True)  # checkpoints 1..3

        def reset() -> None:  # cold: an empty store; warm: checkpoints 1-2 in the store, so it resumes at 2
            clear_store(cold_store)
            warm_store.delete(FINAL)
            warm_store.delete(checkpoint_name(3))

        restart = compare(
            "restart_vs_cold_start" + suffix,
            baseline=[*TRAINER, str(cold_path)],
            candidate=[*TRAINER, str(warm_path)],
            metric="first_step_s",
            repeats=args.repeats,
            before_each=reset,
            model=str(model),
        )

    step_s = steady["median"]["baseline"] / args.steps
    restart_extra_s = restart["median"]["candidate"] - step_s
    interval = demo.train.checkpoint_every
    lost = {
        "checkpoint_every": interval,
        "step_s": step_s,
        "restart_to_first_step_s": restart["median"]["candidate"],
        # on average a preemption lands mid-interval; then the restart loads, fetches and resumes
        "expected_lost_s": interval / 2 * step_s + restart_extra_s,
    }
    (RESULTS / f"preemption_cost{suffix}.json").write_text(json.dumps(lost, indent=1))
    print(f"[preemption_cost] {json.dumps(lost)}")


def table_rows(load) -> list[Row]:
    steady, restart, lost = load("checkpoint_every_step_s3"), load("restart_vs_cold_start"), load("preemption_cost")
    steps = steady["steps"] if steady else 6
    rows = [
        from_compare(
            steady,
            f"checkpoint every step to S3 (`bench.checkpoint_overhead`, SeaweedFS, {steps} steps)",
            "no checkpoints",
            "every step",
            "<= 1.10",
        ),
        from_compare(restart, "restart to first new step (same)", "cold start", "fetch + resume", "<= 1.5"),
    ]
    if lost:
        n = lost["checkpoint_every"]
        rows.append(
            Row(
                f"work lost per preemption, checkpoint every {n} steps (same)",
                f"one step: {lost['step_s']:.1f} s",
                f"{n / 2:g} steps + restart: {lost['expected_lost_s']:.0f} s",
                lost["expected_lost_s"] / lost["step_s"],
                "",
                note="reported (in steps)",
            )
        )
    return rows


if __name__ == "__main__":
    main()
