"""Benchmark: what the hyperparameter search buys, at equal total GRPO steps.

On the demo task (SmolLM2-135M, configs/demo-cpu.yaml's data and GRPO settings: 16 completions of at most 16
tokens per step), three arms get the same budget of `--budget` GRPO steps each, at every seed of `--seeds`:

- **defaults**: every hyperparameter the search may set at TRL's `GRPOConfig` / PEFT's `LoraConfig` default
  (learning rate, KL beta, temperature, completions per prompt, LoRA rank and alpha), `--budget` steps;
- **hand**: the demo config as hand-tuned (learning rate 3e-4, temperature 0.8, rank 16, alpha 32);
- **searched**: starts from the defaults; the search (`grpo_pipeline.tasks.hpo.search`: successive halving over short trials,
  the defaults themselves as the control trial, trials scored greedily on fixed validation prompts, the top
  ones re-scored on fresh prompts) spends `--search-fraction` of the budget in trial steps, and training with
  its outcome gets what is left. Its steps count against it.

Every adapter and the base model are scored greedily on the same 120 holdout prompts. Reported per arm: the
holdout reward at each seed, the mean with a 95 % t interval over the seeds, and the paired (same seed, same
prompts) differences searched - hand and searched - defaults with their 95 % t intervals; and how long the
search took against the training it feeds (wall seconds, within one run, so contention hits both sides).
Validation prompts for the search come from the val pool of operands up to 30 (the demo's own, up to 20, has
only 41): none is a training or holdout question, by the split hash every source shares.

    python -m bench.hpo_gain [--budget 16] [--seeds 0,1,2] [--arms defaults,hand,searched] [--work DIR] [--tiny]

Every (arm, seed) keeps its result in the work folder; a rerun with the same `--work` reuses them, and the
result file is rewritten after each one, so a partial run is saved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from bench.harness import ROOT, save
from bench.table import Row

ARMS = ("defaults", "hand", "searched")

# Config path -> (library class, field): the hyperparameters the search may set, and their library defaults.
LIBRARY_DEFAULTS = {
    "train.grpo.learning_rate": ("trl.GRPOConfig", "learning_rate"),
    "train.grpo.beta": ("trl.GRPOConfig", "beta"),
    "train.grpo.temperature": ("trl.GRPOConfig", "temperature"),
    "train.grpo.num_generations": ("trl.GRPOConfig", "num_generations"),
    "train.lora.r": ("peft.LoraConfig", "r"),
    "train.lora.lora_alpha": ("peft.LoraConfig", "lora_alpha"),
}


def library_defaults() -> dict[str, object]:
    """The defaults, read from the libraries' own dataclasses (nothing copied by hand)."""
    found = {}
    for path, (cls_path, name) in LIBRARY_DEFAULTS.items():
        module, _, cls_name = cls_path.rpartition(".")
        cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
        found[path] = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    return found


# ---------------------------------------------------------------------------------------------- statistics


def mean_ci(values: list[float]) -> dict:
    """Mean over seeds with a 95 % t interval (None below two values, or with no spread at all).

    >>> r = mean_ci([1.0, 1.2, 1.1]); round(r["mean"], 3), round(r["low"], 3), round(r["high"], 3)
    (1.1, 0.852, 1.348)
    """
    import numpy as np
    from scipy import stats

    a = np.asarray(values, float)
    out = {"mean": float(a.mean()), "n": len(a), "low": None, "high": None}
    if len(a) >= 2 and np.ptp(a) > 0:
        ci = stats.ttest_1samp(a, 0.0).confidence_interval(0.95)
        out |= {"low": float(ci.low), "high": float(ci.high)}
    elif len(a) >= 2:
        out |= {"low": float(a[0]), "high": float(a[0])}
    return out


def paired_ci(candidate: list[float], baseline: list[float]) -> dict:
    """candidate - baseline, paired by seed, with a 95 % t interval; 'beyond noise' when it excludes 0.

    >>> r = paired_ci([1.0, 1.1, 1.2], [0.1, 0.1, 0.3]); round(r["diff"], 3), r["verdict"]
    (0.933, 'above beyond noise')
    """
    import numpy as np

    d = np.asarray(candidate, float) - np.asarray(baseline, float)
    ci = mean_ci(d.tolist())
    verdict = "one seed: no interval"
    if ci["low"] is not None:
        verdict = "above beyond noise" if ci["low"] > 0 else "below beyond noise" if ci["high"] < 0 else "within noise"
    return {"diff": ci["mean"], "low": ci["low"], "high": ci["high"], "n": ci["n"], "verdict": verdict}


def summarize(runs: dict[str, dict[int, dict]], base_reward: float) -> dict:
    """Per arm the holdout rewards by seed and their mean with its interval; the paired comparisons."""
    out: dict = {"arms": {}, "comparisons": {}}
    runs = {arm: {s: r for s, r in by.items() if "holdout_reward" in r} for arm, by in runs.items()}
    for arm, by_seed in runs.items():
        if not by_seed:
            continue
        rewards = [by_seed[s]["holdout_reward"] for s in sorted(by_seed)]
        out["arms"][arm] = {
            "seeds": sorted(by_seed),
            "holdout_reward": rewards,
            **mean_ci(rewards),
            "gain_mean": mean_ci(rewards)["mean"] - base_reward,
        }
    for cand, base in (("searched", "hand"), ("searched", "defaults"), ("hand", "defaults")):
        if cand in runs and base in runs:
            common = sorted(set(runs[cand]) & set(runs[base]))
            if common:
                entry = {
                    "seeds": common,
                    **paired_ci(
                        [runs[cand][s]["holdout_reward"] for s in common],
                        [runs[base][s]["holdout_reward"] for s in common],
                    ),
                }
                # the holdout prompts' part of the noise alone (every common seed's prompts, paired)
                entry["prompts"] = paired_ci(
                    sum((runs[cand][s]["totals"] for s in common), []),
                    sum((runs[base][s]["totals"] for s in common), []),
                )
                out["comparisons"][f"{cand}-{base}"] = entry
    return out


# ---------------------------------------------------------------------------------------------- the arms


def _train(cfg, model: str, splits, run_dir: Path):
    from grpo_pipeline.infra.launch.local import LocalLauncher
    from grpo_pipeline.tasks.job import build_job_spec

    spec = build_job_spec(cfg.train, cfg.model, model, splits, run_dir)
    launcher = LocalLauncher(0, on_line=lambda line: None)
    return launcher.wait(launcher.launch(spec))


def _holdout(model: str, cfg, splits, adapter: str | None):
    from grpo_pipeline.tasks.evaluate import evaluate_model

    return evaluate_model(model, cfg.model, splits["holdout"], cfg.train.reward_set(), cfg.evaluate, adapter=adapter)


def run_fixed(cfg, model, splits, work: Path) -> dict:
    started = time.monotonic()
    result = _train(cfg, model, splits, work)
    train_s = time.monotonic() - started
    scored = _holdout(model, cfg, splits, result.adapter_dir)
    return {
        "holdout_reward": scored.reward,
        "per_reward": scored.per_reward,
        "steps": result.global_step,
        "train_s": train_s,
        "totals": [r["total"] for r in scored.rows],
    }


def run_searched(start, model, splits, work: Path, seed: int, budget: int, fraction: float) -> dict:
    """The search at this seed with `fraction` of the budget, then training with its outcome for the rest."""
    from mlflow import MlflowClient

    from grpo_pipeline.flows.runs import setup_tracking
    from grpo_pipeline.infra.launch import make_launcher
    from grpo_pipeline.tasks.hpo import HPOFailed, Tracking, apply_best, run_trial, search

    cfg = apply_best(
        start,
        {
            "hpo.seed": seed,
            "hpo.study_name": f"bench-hpo-gain-s{seed}",
            "hpo.budget_steps": max(1, int(budget * fraction)),
        },
    )
    exp_id = setup_tracking(cfg.mlflow_uri, cfg.tracking.experiment, work.parent / "mlartifacts")
    stage = MlflowClient(cfg.mlflow_uri).create_run(exp_id, run_name=f"hpo-s{seed}")
    tracking = Tracking(tracking_uri=cfg.mlflow_uri, experiment_id=exp_id, stage_run_id=stage.info.run_id)
    started = time.monotonic()
    try:
        result = search(
            cfg.hpo,
            cfg.train,
            cfg.model,
            cfg.evaluate,
            model,
            splits,
            work / "search",
            data_dir=cfg.data_dir,
            rewards=cfg.train.reward_set(),
            run_one=partial(run_trial, launcher_for=make_launcher),
            tracking=tracking,
        )
    except HPOFailed as exc:  # what the pipeline would do: fail, and train nothing
        return {"failed": str(exc), "search_s": time.monotonic() - started}
    search_s = time.monotonic() - started
    final_steps = budget - result.steps_spent
    if final_steps < 1:
        raise SystemExit(f"the search spent {result.steps_spent} of {budget} steps: nothing left to train")
    trained_cfg = apply_best(cfg, result.overrides | {"train.grpo.max_steps": final_steps})
    started = time.monotonic()
    trained = _train(trained_cfg, model, splits, work / "final")
    train_s = time.monotonic() - started
    scored = _holdout(model, cfg, splits, trained.adapter_dir)
    return {
        "holdout_reward": scored.reward,
        "per_reward": scored.per_reward,
        "totals": [r["total"] for r in scored.rows],
        "steps": {"search": result.steps_spent, "final_training": trained.global_step},
        "search_s": search_s,
        "train_s": train_s,
        "search_over_training": search_s / train_s,
        "applied": result.applied,
        "decision": result.decision,
        "overrides": result.overrides,
        "best_trial": result.best_trial,
        "best_params": result.best_params,
        "configurations": len([t for t in result.trials if t.params]),  # searched ones (not the control)
        "trials": [t.model_dump() for t in result.trials],
        "validation_prompts": result.prompts,
    }


# ---------------------------------------------------------------------------------------------- the driver


def _options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=16, help="GRPO steps per arm and seed")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (training data order, sampling, TPE)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument("--search-fraction", type=float, default=0.5, help="share of the budget the search may spend")
    parser.add_argument(
        "--trials", type=int, default=12, help="most trials per search (the step budget stops it first)"
    )
    parser.add_argument("--trial-steps", type=int, default=2, help="steps of a trial that is never pruned")
    parser.add_argument(
        "--reduction-factor", type=int, default=2, help="1 in this many trials goes on to the next rung"
    )
    parser.add_argument(
        "--min-configurations", type=int, default=3, help="configurations at the first rung before any goes past it"
    )
    parser.add_argument("--target-se", type=float, default=0.15, help="hpo.target_standard_error")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random model and tiny sizes: a quick check that it runs"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite the result file from the runs the work folder holds",
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="keep every run here; a rerun reuses them (default: a temp dir)"
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    opts = _options(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.data.demo_task import generate
    from grpo_pipeline.tasks.data.splits import write_splits
    from grpo_pipeline.tasks.evaluate import EvalResult
    from grpo_pipeline.tasks.hpo import apply_best
    from grpo_pipeline.tasks.model import ensure_demo_model
    from tests.tiny_model import create_random_model

    work = (opts.work or Path(tempfile.mkdtemp(prefix="bench-hpo-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in opts.seeds.split(",") if s.strip()]
    arms = [a for a in opts.arms.split(",") if a]
    overrides = [
        f"tracking.mlflow_tracking_uri=sqlite:///{work / 'mlflow.db'}",
        f"data_dir={work / 'data_dir'}",
        "hpo.enabled=true",
        "hpo.warm_start=false",
        "hpo.pruner=successive_halving",
        f"hpo.steps={opts.trial_steps}",
        "hpo.eval_every=1",
        f"hpo.trials={opts.trials}",
        f"hpo.target_standard_error={opts.target_se}",
        "hpo.rescore_top_k=2",
        "hpo.concurrency=1",
        f"hpo.reduction_factor={opts.reduction_factor}",
        f"hpo.min_configurations={opts.min_configurations}",
        "train.checkpoint_every=1000",
    ]
    if opts.tiny:
        overrides += [
            "data.demo.n_train=64",
            "data.demo.n_holdout=8",
            "train.grpo.max_completion_length=6",
            "evaluate.max_new_tokens=6",
            "hpo.target_standard_error=0.5",
            "hpo.rung_prompts=2",
        ]
    demo = load_config(ROOT / "configs" / "demo-cpu.yaml", overrides)
    tiny = work / "tiny"
    model = str(
        (tiny if (tiny / "config.json").is_file() else create_random_model(tiny))
        if opts.tiny
        else ensure_demo_model(ROOT / ".grpo" / "models")
    )
    data = generate(demo.data.demo.model_copy(update={"n_val": 0}))
    # validation questions from the wider val pool (operands up to 30): still none in train or holdout
    data["val"] = generate(
        demo.data.demo.model_copy(
            update={"max_operand": 30, "n_val": 16 if opts.tiny else 98, "n_holdout": 0, "n_train": 0}
        )
    )["val"]
    splits = write_splits(data, work / "data")
    defaults = library_defaults()
    start = apply_best(demo, defaults | {"train.grpo.max_steps": opts.budget})
    hand = apply_best(demo, {"train.grpo.max_steps": opts.budget})

    base_file = work / "base_eval.json"
    if not base_file.is_file():
        base_file.write_text(_holdout(model, demo, splits, None).model_dump_json())
    base = EvalResult.model_validate_json(base_file.read_text())
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
    started = time.monotonic()
    name = "hpo_gain" + ("_tiny" if opts.tiny else "")

    def report(status: str) -> dict:
        out = {
            "name": name,
            "status": status,
            "budget_steps": opts.budget,
            "seeds": seeds,
            "metric": f"holdout reward ({base.n} prompts, greedy; reward = sum of {demo.train.rewards}, max "
            f"{len(demo.train.rewards)})",
            "base_reward": base.reward,
            "summary": summarize({a: r for a, r in runs.items() if r}, base.reward),
            "hyperparameters": {
                "defaults": defaults,
                "hand": {k: hand.model_dump()["train"][k.split(".")[1]].get(k.split(".")[2]) for k in LIBRARY_DEFAULTS},
            },
            "search": {
                "fraction": opts.search_fraction,
                "trials_at_most": opts.trials,
                "trial_steps": opts.trial_steps,
                "pruner": "successive_halving",
                "reduction_factor": opts.reduction_factor,
                "min_configurations": opts.min_configurations,
                "target_standard_error": opts.target_se,
            },
            "runs": {a: {str(s): r for s, r in by.items()} for a, by in runs.items()},
            "wall_s_this_invocation": time.monotonic() - started,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "threads": os.environ.get("OMP_NUM_THREADS"),
            },
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "model": "tiny random llama" if opts.tiny else model,
        }
        save(name, out)
        return out

    for seed in seeds:  # seed by seed, every arm: a partial result compares arms at the same seeds
        for arm in arms:
            out = work / f"{arm}-s{seed}.json"
            if not out.is_file() and opts.report_only:
                continue
            if not out.is_file():
                print(f"[hpo_gain] {arm}, seed {seed}", file=sys.stderr, flush=True)
                folder = work / f"{arm}-s{seed}"
                if arm == "searched":
                    result = run_searched(
                        start.model_copy(deep=True), model, splits, folder, seed, opts.budget, opts.search_fraction
                    )
                else:
                    cfg = apply_best(start if arm == "defaults" else hand, {"train.grpo.seed": seed})
                    result = run_fixed(cfg, model, splits, folder)
                out.write_text(json.dumps(result, default=str))
            runs[arm][seed] = json.loads(out.read_text())
            report(f"partial: {arm} at seed {seed} done")
    missing = [f"{arm} at seed {seed}" for seed in seeds for arm in arms if seed not in runs[arm]]
    final = report("complete" if not missing else "partial: not run: " + ", ".join(missing))
    for arm, s in final["summary"]["arms"].items():
        print(f"{arm:10s} {s['mean']:.3f} (95 % CI {s['low']}, {s['high']}) by seed {s['holdout_reward']}")
    print(f"base model {base.reward:.3f}; {final['status']}")
    for name_, c in final["summary"]["comparisons"].items():
        print(f"{name_:18s} {c['diff']:+.3f} ({c['low']}, {c['high']}): {c['verdict']}")
    return final


# ---------------------------------------------------------------------------------------------- table rows


def _fmt(s: dict) -> str:
    ci = f" ({s['low']:.2f}–{s['high']:.2f})" if s.get("low") is not None else ""
    return f"{s['mean']:.3f}{ci}, {s['n']} seed{'s' if s['n'] != 1 else ''}"


def table_rows(load) -> list[Row]:
    r = load("hpo_gain")
    bench = "hyperparameter search, equal GRPO steps, holdout reward (`bench.hpo_gain`)"
    if r is None or "summary" not in r:
        return [Row(bench, "defaults / hand-tuned", "searched", None, "", note="not run yet (in this design)")]
    arms, comps = r["summary"]["arms"], r["summary"]["comparisons"]
    budget = r["budget_steps"]
    partial_note = "" if r["status"] == "complete" else f" ({r['status']})"
    rows = []
    for base in ("defaults", "hand"):
        key = f"searched-{base}"
        if key not in comps or base not in arms:
            continue
        c = comps[key]
        if c["low"] is None and c.get("prompts"):  # one seed: the holdout prompts' interval, labelled as such
            c = {**c["prompts"], "verdict": c["prompts"]["verdict"] + " (prompts only; one seed)"}
        goal = "beyond noise" if base == "defaults" else "within noise or above"
        met = (
            c["verdict"].startswith("above beyond noise")
            if base == "defaults"
            else not c["verdict"].startswith("below")
        )
        interval = (
            f"{c['diff']:+.3f} ({c['low']:+.3f} to {c['high']:+.3f})" if c["low"] is not None else f"{c['diff']:+.3f}"
        )
        rows.append(
            Row(
                f"{bench}, {budget} steps per arm, searched − {'TRL/PEFT defaults' if base == 'defaults' else 'hand-tuned demo'}",
                f"{base}: {_fmt(arms[base])}",
                f"searched: {_fmt(arms['searched'])}",
                None,
                "",
                note=f"difference {interval}: {c['verdict']}; goal {goal}: {'meets' if met else 'misses'}{partial_note}",
            )
        )
    if "hand-defaults" in comps:
        c = comps["hand-defaults"]
        interval = (
            f"{c['diff']:+.3f} ({c['low']:+.3f} to {c['high']:+.3f})" if c["low"] is not None else f"{c['diff']:+.3f}"
        )
        rows.append(
            Row(
                f"{bench}, {budget} steps per arm, hand-tuned demo − TRL/PEFT defaults (context)",
                f"defaults: {_fmt(arms['defaults'])}",
                f"hand: {_fmt(arms['hand'])}",
                None,
                "",
                note=f"difference {interval}: {c['verdict']}",
            )
        )
    failed = [s for s, v in r["runs"].get("searched", {}).items() if "failed" in v]
    if failed:
        rows.append(
            Row(
                f"{bench}: searches that failed (no searched trial completed)",
                "",
                "",
                None,
                "",
                note=f"seeds {', '.join(failed)}: the stage failed, nothing trained",
            )
        )
    searched = [v for v in r["runs"].get("searched", {}).values() if "train_s" in v]
    if searched:
        ratios = [v["search_over_training"] for v in searched]
        rows.append(
            Row(
                "search wall time against the final training it feeds (same run, same seed)",
                f"final training: {sum(v['train_s'] for v in searched) / len(searched):.0f} s "
                f"({searched[0]['steps']['final_training']} steps)",
                f"search: {sum(v['search_s'] for v in searched) / len(searched):.0f} s "
                f"({searched[0]['steps']['search']} trial steps)",
                sorted(ratios)[len(ratios) // 2],
                "",
                spread=(min(ratios), max(ratios)) if len(ratios) > 1 else None,
            )
        )
    if not rows:
        rows.append(
            Row(bench, "defaults / hand-tuned", "searched", None, "", note=f"no arms to compare yet{partial_note}")
        )
    return rows


if __name__ == "__main__":
    main()
