"""Benchmark: what orchestration costs. The whole pipeline flow against the same stages as plain functions.

- flow (candidate): `grpo-pipeline run --config configs/demo-cpu.yaml --set ... --json`, what a user or CI
  runs: Prefect (ephemeral API, task runs, caching with persisted results), MLflow (SQLite: parent and stage
  runs, per-sample tables, registry and aliases, report artifacts) and the trainer with its checkpoint store,
  manifests and committed metrics, as a subprocess through the local launcher.
- plain (baseline): `python -m bench.orchestration_overhead --plain`, the same stage functions with the same
  config and no Prefect, MLflow or checkpoints: demo data, model resolution, quantization cost, plan and budget,
  evaluate base, a plain TRL GRPOTrainer subprocess (`bench/plain_trl.py`), evaluate candidate, decision,
  Markdown report and chart.

Both sides: a fresh process and a fresh data folder per run, the same cached model, wall time from start to
exit measured here; sides alternate. Goal: ratio <= 1.05. Most of the overhead is a fixed cost per run
(Prefect's ephemeral server, MLflow's database), so a short run shows it at its largest: the fixed seconds and
the ratio they imply for the demo config's full run are reported too.

    python -m bench.orchestration_overhead [--steps 4] [--repeats 2] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.harness import ROOT, save, spread
from bench.table import Row

CONFIG = ROOT / "configs" / "demo-cpu.yaml"


def plain(cfg) -> dict:
    """The flow's stages as plain function calls: same inputs, same order, no orchestration."""
    from grpo_pipeline.tasks.data.demo_task import generate
    from grpo_pipeline.tasks.data.splits import write_splits
    from grpo_pipeline.tasks.evaluate import evaluate_model
    from grpo_pipeline.tasks.job import build_job_spec
    from grpo_pipeline.tasks.model import resolve_base_model
    from grpo_pipeline.tasks.plan import apply_plan, check_budget, plan_run
    from grpo_pipeline.tasks.promote.decide import decide_promotion
    from grpo_pipeline.tasks.quantize import measure_quantization_cost, require_accepted
    from grpo_pipeline.tasks.report import plot_comparison, render_markdown
    from grpo_pipeline.tasks.summary import Holdout, RegistryOutcome

    rewards = cfg.train.reward_set()
    run_dir = (cfg.data_dir / "runs" / "plain").resolve()
    splits = write_splits(generate(cfg.data.demo), run_dir / "data")
    model_path = resolve_base_model(cfg.model, cfg.data_dir / "models")
    require_accepted(measure_quantization_cost(model_path, cfg.model, splits["val"], rewards, cfg.evaluate))
    plan = plan_run(cfg.model, cfg.train, cfg.plan, model_path)
    check_budget(plan, cfg.plan.budget_usd)
    cfg = apply_plan(cfg, plan)
    base = evaluate_model(model_path, cfg.model, splits["holdout"], rewards, cfg.evaluate)
    spec = build_job_spec(cfg.train, cfg.model, model_path, splits, run_dir)
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plain_trl.py"), "--spec", str(spec.write(run_dir / "job.json"))],
        check=True,
        capture_output=True,
    )
    trained = evaluate_model(model_path, cfg.model, splits["holdout"], rewards, cfg.evaluate, adapter=spec.adapter_dir)
    decision = decide_promotion(trained.rows, base.rows, cfg.promote, rewards)
    holdout = Holdout.of(base, trained, None, rewards.skill)
    registry = RegistryOutcome(model="-", candidate_version="-", decided_against=None, moves=[], aliases={})
    (run_dir / "report.md").write_text(render_markdown(holdout, decision, registry))
    plot_comparison(holdout.baseline, holdout.trained, decision.stats, run_dir / "comparison.png")
    summary = {"holdout": holdout.model_dump(), "decision": decision.model_dump()}
    return summary


def overrides(data_dir: Path, model_dir: Path, steps: int, tiny: bool) -> list[str]:
    """The short configuration both sides run: the demo config with fewer steps and a smaller holdout."""
    out = [
        f"data_dir={data_dir}",
        f"model.base={model_dir}",
        f"train.grpo.max_steps={steps}",
        f"train.checkpoint_every={max(1, steps // 2)}",
        "data.demo.n_holdout=32",
    ]
    if tiny:
        out += [
            "train.grpo.num_generations=4",
            "train.grpo.per_device_train_batch_size=4",
            "train.grpo.max_completion_length=6",
            "evaluate.max_new_tokens=6",
            "data.demo.n_holdout=8",
            "data.demo.max_operand=9",
            "data.demo.n_val=4",
        ]
    return out


def _timed(cmd: list[str]) -> tuple[float, dict]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return seconds, last_json(proc.stdout)


def last_json(stdout: str) -> dict:
    """The JSON object a command printed last, on one line or pretty-printed over several.

    >>> last_json('progress\\n{"a": 1}\\n'), last_json('log\\n{\\n "a": {\\n  "b": 2\\n }\\n}\\n')
    ({'a': 1}, {'a': {'b': 2}})
    """
    lines = stdout.strip().splitlines()
    for i in reversed(range(len(lines))):  # the last line that opens an object and parses to the end
        if lines[i].startswith("{"):
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    raise ValueError(f"no JSON object at the end of the output: {stdout[-300:]!r}")


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model: checks the code path")
    parser.add_argument(
        "--plain", nargs="*", help=argparse.SUPPRESS
    )  # internal: run the plain side with these overrides
    opts = parser.parse_args(argv)
    from grpo_pipeline.configs.schema import load_config

    if opts.plain is not None:
        summary = plain(load_config(CONFIG, opts.plain))
        print(json.dumps({"holdout": {k: summary["holdout"][k] for k in ("base_reward", "trained_reward")}}))
        return None

    from grpo_pipeline.tasks.model import ensure_demo_model
    from tests.tiny_model import create_random_model

    work = Path(tempfile.mkdtemp(prefix="bench-orchestration-"))
    demo = load_config(CONFIG)
    model = create_random_model(work / "tiny") if opts.tiny else ensure_demo_model(demo.data_dir / "models")
    model = Path(model).resolve()
    cli = str(Path(sys.executable).with_name("grpo-pipeline"))
    samples: dict[str, list[float]] = {"plain": [], "flow": []}
    rewards: dict[str, list[float]] = {"plain": [], "flow": []}
    for i in range(opts.repeats):
        for side in ("plain", "flow"):
            sets = overrides(work / f"{side}-{i}", model, opts.steps, opts.tiny)
            if side == "plain":
                cmd = [sys.executable, "-m", "bench.orchestration_overhead", "--plain", *sets]
            else:
                cmd = [cli, "run", "--config", str(CONFIG), "--json", *[a for s in sets for a in ("--set", s)]]
            seconds, out = _timed(cmd)
            samples[side].append(seconds)
            rewards[side].append(out["holdout"]["trained_reward"])
            print(
                f"[orchestration_overhead] round {i + 1}/{opts.repeats} {side}: {seconds:.1f} s "
                f"(holdout reward after training {out['holdout']['trained_reward']:.3f})",
                flush=True,
            )

    medians = {side: statistics.median(v) for side, v in samples.items()}
    fixed = medians["flow"] - medians["plain"]
    # the demo's full run, plain: its measured step time (the trainer overhead benchmark) times 40 steps,
    # plus this run's non-training time; the same fixed cost on top
    step_s = (
        json.loads((ROOT / "bench" / "results" / "trainer_overhead.json").read_text())["median"]["baseline"] / 6
        if (ROOT / "bench" / "results" / "trainer_overhead.json").is_file()
        else None
    )
    demo_steps = demo.train.grpo["max_steps"]
    projected = None
    if step_s and not opts.tiny:
        plain_demo = medians["plain"] + (demo_steps - opts.steps) * step_s
        projected = {"steps": demo_steps, "plain_s": plain_demo, "ratio": (plain_demo + fixed) / plain_demo}
    report = {
        "name": "orchestration_overhead" + ("_tiny" if opts.tiny else ""),
        "metric": "wall seconds, process start to exit",
        "ratio": medians["flow"] / medians["plain"],
        "median": {"baseline": medians["plain"], "candidate": medians["flow"]},
        "samples": {"baseline": samples["plain"], "candidate": samples["flow"]},
        "spread": {side: spread(v) for side, v in samples.items()},
        "fixed_overhead_s": fixed,
        "projected_demo": projected,
        "trained_reward": rewards,
        "steps": opts.steps,
        "baseline": "the stage functions called in order, plain TRL training (bench/plain_trl.py)",
        "candidate": "grpo-pipeline run --json (Prefect flow, MLflow, checkpoint store)",
        "model": str(model),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    save(report["name"], report)
    print(
        f"[orchestration_overhead] ratio flow / plain = {report['ratio']:.3f} (fixed cost {fixed:.1f} s)"
        + (f"; for the demo's {demo_steps} steps: {projected['ratio']:.3f}" if projected else "")
    )
    return report


def table_rows(load) -> list[Row]:
    from bench.table import from_compare

    r = load("orchestration_overhead")
    steps = r["steps"] if r else 4
    rows = [
        from_compare(
            r,
            f"orchestration overhead, whole pipeline, {steps} GRPO steps (`bench.orchestration_overhead`)",
            "stages as plain functions",
            "Prefect flow + MLflow + checkpoints",
            "<= 1.05",
        )
    ]
    if r and r.get("projected_demo"):
        p = r["projected_demo"]
        rows.append(
            Row(
                f"same fixed cost ({r['fixed_overhead_s']:.0f} s) on the demo's {p['steps']} steps (derived)",
                f"plain: {p['plain_s']:.0f} s",
                f"flow: {p['plain_s'] + r['fixed_overhead_s']:.0f} s",
                p["ratio"],
                "<= 1.05",
            )
        )
    return rows


if __name__ == "__main__":
    main()
