"""Benchmark: the health monitors' overhead per training step (goal: <= 1 %).

Two figures. End to end: the trainer with every health rule on (the defaults: all warn, non_finite rollback)
against the same trainer with every rule off, same model, data and steps, the two arms alternating
(`bench.harness.compare`), HF's own `train_runtime`; the ratio and its per-round spread. A 1 % difference
is inside a shared machine's run-to-run noise, so the second figure measures the monitors' own work
directly: the rule engine (`grpo_pipeline.trainer.health.Monitor.observe`, which the callback runs once per
logged step) on a step log shaped like TRL's, timed over many steps, divided by the median step time of the
end-to-end run.

    python -m bench.health_overhead [--steps 8] [--repeats 3] [--tiny]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import ROOT, compare, save, spread, training_bench_args
from bench.table import Row, from_compare
from grpo_pipeline.configs.health import RULES, HealthConfig
from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.tasks.data.demo_task import generate
from grpo_pipeline.tasks.data.splits import write_splits
from grpo_pipeline.tasks.job import build_job_spec
from grpo_pipeline.tasks.model import ensure_demo_model
from grpo_pipeline.trainer.health import Monitor
from tests.tiny_model import create_random_model

NAME = "health_overhead"


def step_log(step: int) -> dict:
    """A training step's log as TRL 1.x and HF write it (the keys the rules read and the others beside them),
    with values that move, so every window fills and the relative rules compare against a baseline."""
    wave = (step % 7) / 7
    return {
        "loss": 0.01 + 0.001 * wave,
        "grad_norm": 0.5 + wave,
        "learning_rate": 1e-5,
        "num_tokens": 1000.0 * step,
        "completions/mean_length": 120 + 10 * wave,
        "completions/min_length": 40.0,
        "completions/max_length": 256.0,
        "completions/clipped_ratio": 0.1 * wave,
        "completions/mean_terminated_length": 110.0,
        "completions/min_terminated_length": 40.0,
        "completions/max_terminated_length": 250.0,
        "rewards/math_answer/mean": 0.4 + 0.1 * wave,
        "rewards/math_answer/std": 0.3,
        "rewards/format/mean": 0.9,
        "rewards/format/std": 0.1,
        "reward": 1.3 + 0.1 * wave,
        "reward_std": 0.35,
        "frac_reward_zero_std": 0.25 * wave,
        "kl": 0.02 * wave,
        "entropy": 0.8 - 0.1 * wave,
        "clip_ratio/region_mean": 0.0,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/high_mean": 0.0,
        "epoch": step / 100,
    }


def rules_seconds_per_step(steps: int = 20000, rounds: int = 5) -> dict:
    """The rule engine's time per logged step, every rule on (warn, so no action ends the loop): the median
    and spread over `rounds` timings of `steps` steps each."""
    settings = HealthConfig(**{name: {"action": "warn"} for name in RULES})
    logs = [step_log(s) for s in range(1, 101)]
    per_step = []
    for _ in range(rounds):
        monitor = Monitor(settings)
        started = time.perf_counter()
        for s in range(1, steps + 1):
            monitor.observe(s, logs[s % 100])
        per_step.append((time.perf_counter() - started) / steps)
    return spread(per_step)


def main() -> None:
    args = training_bench_args(__doc__)
    name = NAME + ("_tiny" if args.tiny else "")
    common = [f"train.grpo.max_steps={args.steps}", f"train.checkpoint_every={max(1, args.steps // 2)}"]
    off = [f"train.health.{rule}.action=off" for rule in RULES]
    work = Path(tempfile.mkdtemp(prefix="bench-health-"))
    on_cfg = load_config(ROOT / "configs" / "demo-cpu.yaml", common)
    off_cfg = load_config(ROOT / "configs" / "demo-cpu.yaml", [*common, *off])
    model = create_random_model(work / "tiny") if args.tiny else ensure_demo_model(on_cfg.data_dir / "models")
    splits = write_splits(generate(on_cfg.data.demo), work / "data")
    paths = {}
    for arm, cfg in (("off", off_cfg), ("on", on_cfg)):
        spec = build_job_spec(cfg.train, cfg.model, str(model), splits, work / arm).model_copy(
            update={"mlflow_tracking_uri": None}  # MLflow's cost is the same in both arms; leave it out
        )
        paths[arm] = spec.write(work / f"{arm}.json")
    trainer = [sys.executable, "-m", "grpo_pipeline.trainer", "--spec"]
    report = compare(
        name,
        baseline=[*trainer, str(paths["off"])],
        candidate=[*trainer, str(paths["on"])],
        metric="metrics.train_runtime",
        repeats=args.repeats,
        before_each=lambda: [shutil.rmtree(work / arm, ignore_errors=True) for arm in ("off", "on")],
        model=str(model),
        steps=args.steps,
        arms={"baseline": "every train.health rule off", "candidate": "the default rules on"},
    )
    rules = rules_seconds_per_step(2000 if args.tiny else 20000)
    step_s = report["median"]["candidate"] / args.steps
    report["rules"] = {"seconds_per_step": rules, "step_s": step_s, "fraction": rules["median"] / step_s}
    save(name, report)
    print(
        f"[{name}] the rules: {rules['median'] * 1e6:.1f} us per step ({rules['min'] * 1e6:.1f}-"
        f"{rules['max'] * 1e6:.1f}), {100 * report['rules']['fraction']:.4f} % of a {step_s:.2f} s step"
    )
    shutil.rmtree(work, ignore_errors=True)


def table_rows(load) -> list[Row]:
    result = load(NAME)
    steps = result["steps"] if result else 8
    rows = [
        from_compare(
            result,
            f"health monitors, end to end (`bench.health_overhead`, {steps} steps)",
            "every rule off",
            "default rules on",
            "<= 1.01",
        )
    ]
    bench = "health rules' own time per step / step time (`bench.health_overhead`)"
    if result is None or "rules" not in result:
        rows.append(Row(bench, "step time", "the rules' time", None, "<= 1", note="not run yet", unit="%"))
    else:
        r = result["rules"]
        rows.append(
            Row(
                bench,
                f"step: {r['step_s']:.2f} s",
                f"rules: {r['seconds_per_step']['median'] * 1e6:.0f} us ({100 * r['fraction']:.2g} %)",
                100 * r["fraction"],
                "<= 1",
                spread=(
                    100 * r["seconds_per_step"]["min"] / r["step_s"],
                    100 * r["seconds_per_step"]["max"] / r["step_s"],
                ),
                unit="%",
            )
        )
    return rows


if __name__ == "__main__":
    main()
