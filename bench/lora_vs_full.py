"""Benchmark: LoRA and QLoRA (NF4) GRPO against full-parameter GRPO, on the demo model and task.

The seed claims LoRA/QLoRA GRPO stays within 1-3 % of full fine-tuning quality, reaches quality 3-12x
faster, and saves memory. All three arms here run the same TRL GRPOTrainer on the same training rows in the
same order (same seed), with the demo config's GRPO settings (8 generations per prompt, 16 completions of at
most 16 tokens per step); they differ only in what trains:

- full: every weight (AdamW), learning rate `--full-lr` (default 3e-5: ~10x below LoRA's, the usual rule;
  the demo config's 3e-4 is a LoRA rate);
- lora: a rank-16 adapter on every linear layer over a frozen fp32 base (the demo config's adapter and rate);
- qlora: the same adapter over an NF4 (bitsandbytes 4-bit) base, kept in float32 as the trainer keeps it
  (`keep_adapter_fp32`; before, TRL's bfloat16 cast rounded its updates away: docs/training.md#qlora).

Full fine-tuning runs through TRL directly rather than `python -m grpo_pipeline.trainer`: the pipeline's trainer, evaluation,
merge and registry all deal in adapters, so the baseline is GRPOTrainer without a `peft_config`, and the two
adapter arms use the same code for a like-for-like comparison.

Measured per arm, each in its own process (so each peak RSS is its own):
- holdout reward (greedy, the two demo rewards summed, max 2) every `--eval-every` steps; evaluation time is
  excluded from the arm's training clock;
- quality gap after the fixed step budget: (full - arm) / full in %, with a paired-bootstrap 95 % interval;
- time to quality: training seconds until the holdout reward first reaches `--threshold`; ratio full / arm;
  the bracket is the previous evaluation's time (the crossing lies between the two). Counted in CPU seconds
  of the arm's process (wall seconds are saved too): the arms run one after another, and on a shared machine
  the neighbours' load changes between them, which moves wall time but hardly CPU time;
- peak RSS while training (model loading excluded; the whole-process peak is saved too).

    python -m bench.lora_vs_full [--steps 16] [--eval-every 4] [--holdout 48] [--threshold 0.8] [--tiny]

One module, past the ~600 lines a module is cut at, as every benchmark here: a benchmark is read whole, its arms,
its runner, its statistics and its report in one file, what it shares with the others in `bench/harness.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.harness import ROOT, peak_rss_mb, reset_peak_rss, save, spread
from bench.table import Row
from grpo_pipeline.configs.rewards import RewardSet

ARMS = ("full", "lora", "qlora")
LABEL = {"full": "full", "lora": "LoRA", "qlora": "QLoRA (NF4)"}


def _options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="GRPO steps per arm (the fixed budget)")
    parser.add_argument("--eval-every", type=int, default=4, help="steps between holdout evaluations")
    parser.add_argument("--holdout", type=int, default=48, help="held-out prompts per evaluation")
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.8,
        help="holdout reward (of 2) that counts as 'quality': most answers in the asked format",
    )
    parser.add_argument("--full-lr", type=float, default=3e-5, help="full fine-tuning's learning rate")
    parser.add_argument(
        "--full-lrs",
        default="",
        help="comma-separated learning rates to sweep for full fine-tuning "
        "(the best at the first seed is run at every seed); default: --full-lr alone",
    )
    parser.add_argument("--adapter-lrs", default="", help="the same for LoRA and QLoRA; default: the demo config's")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds (data order and sampling)")
    parser.add_argument(
        "--seeds-first",
        action="store_true",
        help="every seed at each arm's first rate before the other rates at the first seed (when "
        "the time may run out: the seeds' interval is then there first)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="work folder kept between invocations: finished runs are reused (default: a temp dir)",
    )
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of full,lora,qlora")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model: checks the code path in seconds")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- one arm (runs in its own process)


def _holdout_callback(rows: list[dict], tokenizer, every: int, max_new_tokens: int, rewards: RewardSet):
    from transformers import TrainerCallback

    from grpo_pipeline.tasks.evaluate import generate, score
    from grpo_pipeline.trainer.rewards import completion_text

    class HoldoutCurve(TrainerCallback):
        """Greedy holdout reward every `every` steps, off the training clock."""

        def __init__(self):
            self.curve: list[dict] = []
            self.step_s: list[float] = []
            self.eval_s = self.eval_cpu_s = 0.0
            self.last_totals: list[float] = []

        def evaluate(self, model, step: int) -> None:
            started, started_cpu = time.perf_counter(), time.process_time()
            was_training = model.training
            model.eval()
            completions, lengths = generate(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens, len(rows))
            model.train(was_training)
            result = score(rows, [completion_text(c) for c in completions], rewards, lengths)
            self.last_totals = [r["total"] for r in result.rows]
            train_s = (started - self.t0) - self.eval_s if step else 0.0
            train_cpu_s = (started_cpu - self.t0_cpu) - self.eval_cpu_s if step else 0.0
            self.curve.append(
                {
                    "step": step,
                    "train_s": train_s,
                    "train_cpu_s": train_cpu_s,
                    "reward": result.reward,
                    **result.per_reward,
                }
            )
            self.eval_s += time.perf_counter() - started
            self.eval_cpu_s += time.process_time() - started_cpu
            print(
                f"  step {step:3d}  train {train_s:7.1f} s ({train_cpu_s:7.1f} CPU s)  holdout reward "
                f"{result.reward:.3f}",
                flush=True,
            )

        def on_train_begin(self, args, state, control, **kw):
            # the step-0 evaluation ran before the clocks start
            self.t0, self.t0_cpu, self.eval_s, self.eval_cpu_s = time.perf_counter(), time.process_time(), 0.0, 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.step_started = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.step_s.append(time.perf_counter() - self.step_started)
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self.evaluate(model, state.global_step)

    return HoldoutCurve()


def run_arm(arm: str, model_path: str, train_file: str, holdout_file: str, opts: argparse.Namespace) -> dict:
    """Train one arm for the step budget; its holdout curve, step times and memory."""
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_pipeline.configs.schema import ModelConfig, load_config
    from grpo_pipeline.tasks.evaluate import read_jsonl
    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.trainer.loading import keep_adapter_fp32, load_model
    from grpo_pipeline.trainer.rewards import resolve_reward

    cfg = load_config(ROOT / "configs" / "demo-cpu.yaml")
    grpo = dict(cfg.train.grpo) | {
        "max_steps": opts.steps,
        "logging_steps": 1,
        "bf16": False,
        "report_to": [],
        "disable_tqdm": True,
        "seed": opts.seed,
    }
    if arm == "full":
        grpo["learning_rate"] = opts.full_lr
    if opts.lr is not None:
        grpo["learning_rate"] = opts.lr
    model, tokenizer = load_model(model_path, model_load(ModelConfig(quantization="nf4" if arm == "qlora" else "none")))
    load_peak = peak_rss_mb()
    reset_peak_rss()  # from here on, the peak is training's own

    holdout = read_jsonl(Path(holdout_file))
    curve = _holdout_callback(holdout, tokenizer, opts.eval_every, cfg.evaluate.max_new_tokens, cfg.train.reward_set())
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[resolve_reward(name) for name in cfg.train.rewards],
        args=GRPOConfig(output_dir=str(Path(opts.work) / f"{arm}-out"), save_strategy="no", **grpo),
        train_dataset=load_dataset("json", data_files=train_file, split="train"),
        processing_class=tokenizer,
        peft_config=None if arm == "full" else LoraConfig(task_type="CAUSAL_LM", **cfg.train.lora),
        callbacks=[curve, keep_adapter_fp32(model)],  # as the trainer runs QLoRA (docs/training.md#qlora)
    )
    trainer.remove_callback(PrinterCallback)  # the holdout curve prints one line per evaluation instead
    curve.t0, curve.t0_cpu = time.perf_counter(), time.process_time()
    curve.evaluate(trainer.model, 0)
    trainer.train()
    params = list(trainer.model.parameters())
    return {
        "arm": arm,
        "learning_rate": grpo["learning_rate"],
        "seed": opts.seed,
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "adapter_dtypes": sorted({str(p.dtype) for p in params if p.requires_grad}),
        "curve": curve.curve,
        "final_totals": curve.last_totals,
        "step_s": curve.step_s,
        "train_reward": [h["reward"] for h in trainer.state.log_history if "reward" in h],
        "peak_rss_train_mb": peak_rss_mb(),
        "peak_rss_load_mb": load_peak,
    }


# ---------------------------------------------------------------- analysis (pure)


def time_to_quality(curve: list[dict], threshold: float, clock: str = "train_s") -> dict | None:
    """The first evaluation at or above the threshold: its step and training time on `clock` ('train_s' wall,
    'train_cpu_s' CPU), and the previous evaluation's time (the crossing lies between the two).

    >>> c = [{"step": 0, "train_s": 0, "reward": 0.1}, {"step": 4, "train_s": 40, "reward": 0.8},
    ...      {"step": 8, "train_s": 80, "reward": 1.1}]
    >>> time_to_quality(c, 1.0)
    {'step': 8, 'train_s': 80, 'after_s': 40}
    >>> time_to_quality(c, 1.5) is None
    True
    """
    for before, point in zip([None, *curve], curve, strict=False):  # pairs each point with the one before
        if point["reward"] >= threshold:
            return {"step": point["step"], "train_s": point[clock], "after_s": before[clock] if before else 0.0}
    return None


def speedup(full_curve: list[dict], arm_curve: list[dict], threshold: float, clock: str = "train_s") -> dict:
    """full / arm training time to the threshold, bracketed by the evaluation interval on both sides.

    >>> f = [{"step": 0, "train_s": 0, "reward": 0}, {"step": 4, "train_s": 40, "reward": 0.6},
    ...      {"step": 8, "train_s": 80, "reward": 1.2}]
    >>> a = [{"step": 0, "train_s": 0, "reward": 0}, {"step": 4, "train_s": 20, "reward": 0.9},
    ...      {"step": 8, "train_s": 40, "reward": 1.3}]
    >>> s = speedup(f, a, 1.0); s["ratio"], s["spread"]
    (2.0, [1.0, 4.0])
    """
    full_hit, hit = time_to_quality(full_curve, threshold, clock), time_to_quality(arm_curve, threshold, clock)
    out = {"clock": clock, "full": full_hit, "arm": hit, "full_total_s": full_curve[-1][clock]}
    if hit and full_hit:
        out["ratio"] = full_hit["train_s"] / hit["train_s"]
        # the arm crossed after its previous evaluation; at the first one there is no upper bound
        out["spread"] = (
            [full_hit["after_s"] / hit["train_s"], full_hit["train_s"] / hit["after_s"]] if hit["after_s"] > 0 else None
        )
    elif hit:  # full never got there: the speedup is at least its whole budget over the arm's time
        out["ratio_at_least"] = out["full_total_s"] / hit["train_s"]
    elif full_hit:  # the arm never got there: the speedup is at most full's time over the arm's whole budget
        out["ratio_at_most"] = full_hit["train_s"] / arm_curve[-1][clock]
    return out


def quality_gap(full: list[float], arm: list[float], seed: int = 0) -> dict:
    """(full - arm) / full in % over paired holdout prompts, with a paired-bootstrap 95 % interval.

    >>> g = quality_gap([1.0, 2.0, 1.0, 2.0] * 10, [1.0, 2.0, 1.0, 1.0] * 10)
    >>> round(g["gap_pct"], 1), g["low_pct"] < g["gap_pct"] < g["high_pct"]
    (16.7, True)
    >>> quality_gap([0.0, 0.0], [1.0, 0.0])["gap_pct"] is None
    True
    """
    import numpy as np
    from scipy.stats import bootstrap

    f, a = np.asarray(full, float), np.asarray(arm, float)
    if f.mean() <= 0:  # nothing learned by the baseline (e.g. a tiny random model): no relative gap to give
        return {"gap_pct": None, "low_pct": None, "high_pct": None, "full": float(f.mean()), "arm": float(a.mean())}

    def gap(f, a, axis=-1):
        return (f.mean(axis=axis) - a.mean(axis=axis)) / f.mean(axis=axis) * 100

    ci = bootstrap((f, a), gap, paired=True, vectorized=True, n_resamples=4000, random_state=seed, method="percentile")
    return {
        "gap_pct": float(gap(f, a)),
        "low_pct": float(ci.confidence_interval.low),
        "high_pct": float(ci.confidence_interval.high),
        "full": float(f.mean()),
        "arm": float(a.mean()),
    }


def analyse(arms: dict[str, dict], threshold: float) -> dict:
    """Quality gap, time-to-quality ratio and memory ratio of each adapter arm against full fine-tuning."""
    full = arms["full"]
    out = {}
    for name in ("lora", "qlora"):
        if name not in arms:
            continue
        arm = arms[name]
        out[name] = {
            "quality": quality_gap(full["final_totals"], arm["final_totals"]),
            # CPU seconds: neighbours on a shared machine slow the wall clock of one arm and not another
            "time_to_quality": speedup(full["curve"], arm["curve"], threshold, "train_cpu_s"),
            "time_to_quality_wall": speedup(full["curve"], arm["curve"], threshold, "train_s"),
            "memory": {
                "full_mb": full["peak_rss_train_mb"],
                "arm_mb": arm["peak_rss_train_mb"],
                "ratio": arm["peak_rss_train_mb"] / full["peak_rss_train_mb"],
            },
            "step_s": {"full": spread(full["step_s"]), "arm": spread(arm["step_s"])},
        }
    return out


def paired_interval(diff) -> tuple[float, float]:
    """The 95 % t interval of the mean of paired differences; where every difference is the same (no spread, so
    no t interval) that difference as both ends.

    >>> paired_interval([0.2, 0.2]), [round(x, 3) for x in paired_interval([0.1, 0.3, 0.2])]
    ((0.2, 0.2), [-0.048, 0.448])
    """
    import numpy as np
    from scipy import stats

    diff = np.asarray(diff, float)
    if np.ptp(diff) == 0:
        return float(diff[0]), float(diff[0])
    ci = stats.ttest_1samp(diff, 0.0).confidence_interval(0.95)
    return float(ci.low), float(ci.high)


def final_reward(run: dict) -> float:
    return run["curve"][-1]["reward"]


def best_rates(runs: list[dict], seed: int) -> dict[str, float]:
    """Per arm, the learning rate whose run at `seed` ended with the highest holdout reward.

    >>> best_rates([{"arm": "lora", "learning_rate": 1e-4, "seed": 0, "curve": [{"reward": 0.5}]},
    ...             {"arm": "lora", "learning_rate": 3e-4, "seed": 0, "curve": [{"reward": 0.9}]}], 0)
    {'lora': 0.0003}
    """
    best: dict[str, dict] = {}
    for run in runs:
        if run["seed"] == seed and (run["arm"] not in best or final_reward(run) > final_reward(best[run["arm"]])):
            best[run["arm"]] = run
    return {arm: run["learning_rate"] for arm, run in best.items()}


def shared_threshold(curves: list[list[dict]], wanted: float, step: float = 0.05) -> float:
    """`wanted` when every curve reaches it; else the highest multiple of `step` that every curve reaches.

    >>> shared_threshold([[{"reward": 0.2}, {"reward": 1.1}], [{"reward": 0.9}]], 0.8)
    0.8
    >>> shared_threshold([[{"reward": 1.1}], [{"reward": 0.72}]], 0.8)
    0.7
    """
    reached = min(max(p["reward"] for p in c) for c in curves)
    return wanted if reached >= wanted else round(int(reached / step + 1e-9) * step, 10)


def sweep_analysis(runs: list[dict], seeds: list[int], wanted_threshold: float) -> dict:
    """The best learning rate per arm (at the first seed), then at that rate over every seed: each adapter arm's
    gap to full fine-tuning, (full - arm) / full in %, with a t interval over the seeds (the per-seed means are
    paired: same prompts, same data order), and training CPU time to a holdout reward every run reaches."""
    import numpy as np

    best = best_rates(runs, seeds[0])
    # the compared rate: the one run at the most seeds (the best at the first seed, when they tie)
    rates = {}
    for arm in best:
        counts = {}
        for r in runs:
            if r["arm"] == arm:
                counts[r["learning_rate"]] = counts.get(r["learning_rate"], 0) + 1
        rates[arm] = max(counts, key=lambda lr: (counts[lr], lr == best[arm]))
    at_best = {
        arm: {r["seed"]: r for r in runs if r["arm"] == arm and r["learning_rate"] == lr} for arm, lr in rates.items()
    }
    out: dict = {
        "best_learning_rate": best,
        "compared_learning_rate": rates,
        "sweep_seed": seeds[0],
        "by_rate": {
            arm: {f"{r['learning_rate']:g}": final_reward(r) for r in runs if r["arm"] == arm and r["seed"] == seeds[0]}
            for arm in rates
        },
        "arms": {},
    }
    if "full" not in at_best:
        return out
    full = at_best["full"]
    for arm, by_seed in at_best.items():
        if arm == "full":
            continue
        common = [s for s in seeds if s in by_seed and s in full]
        if not common:
            continue
        f = np.array([final_reward(full[s]) for s in common])
        a = np.array([final_reward(by_seed[s]) for s in common])
        entry: dict = {
            "seeds": common,
            "full": f.tolist(),
            "arm": a.tolist(),
            "full_mean": float(f.mean()),
            "arm_mean": float(a.mean()),
            "gap_pct": float((f.mean() - a.mean()) / f.mean() * 100) if f.mean() > 0 else None,
        }
        if len(common) >= 2 and f.mean() > 0:
            low, high = paired_interval(f - a)
            entry |= {"gap_low_pct": low / f.mean() * 100, "gap_high_pct": high / f.mean() * 100}
        # the same over prompts (every seed's prompts pooled, paired): the data's part of the noise alone
        entry["pooled_prompts"] = quality_gap(
            sum((full[s]["final_totals"] for s in common), []), sum((by_seed[s]["final_totals"] for s in common), [])
        )
        threshold = shared_threshold(
            [full[s]["curve"] for s in common] + [by_seed[s]["curve"] for s in common], wanted_threshold
        )
        per_seed = []
        for s in common:
            fh = time_to_quality(full[s]["curve"], threshold, "train_cpu_s")
            ah = time_to_quality(by_seed[s]["curve"], threshold, "train_cpu_s")
            per_seed.append(
                {
                    "seed": s,
                    "full": fh,
                    "arm": ah,
                    "ratio": fh["train_s"] / ah["train_s"] if fh and ah and ah["train_s"] > 0 else None,
                }
            )
        ratios = [p["ratio"] for p in per_seed if p["ratio"] is not None]
        entry["time_to_quality"] = {
            "threshold": threshold,
            "clock": "train_cpu_s",
            "per_seed": per_seed,
            "full_cpu_s": float(np.median([p["full"]["train_s"] for p in per_seed])),
            "arm_cpu_s": float(np.median([p["arm"]["train_s"] for p in per_seed])),
            "ratio": float(np.median(ratios)) if ratios else None,
            "spread": [min(ratios), max(ratios)] if len(ratios) > 1 else None,
        }
        out["arms"][arm] = entry
    return out


def adapter_gains(runs: list[dict], seeds: list[int]) -> dict | None:
    """QLoRA's gain over its own NF4 base against LoRA's over its base, seed by seed (same data order, same
    holdout): each run's final holdout reward minus its step-0 one (the base it started from, scored in the same
    process). The difference QLoRA - LoRA gets a t interval over the seeds, from 3 seeds up (fewer: none).

    >>> run = lambda arm, seed, base, end: {"arm": arm, "seed": seed, "curve": [{"reward": base}, {"reward": end}]}
    >>> g = adapter_gains([run("lora", 0, .1, .5), run("qlora", 0, .1, .4), run("lora", 1, .1, .7),
    ...                    run("qlora", 1, .0, .7), run("lora", 2, .2, .6), run("qlora", 2, .1, .4)], [0, 1, 2])
    >>> [round(x, 2) for x in g["lora"]], [round(x, 2) for x in g["qlora"]], round(g["difference"], 3)
    ([0.4, 0.6, 0.4], [0.3, 0.7, 0.3], -0.033)
    >>> g["low"] < g["difference"] < g["high"], round(g["ratio"], 3)
    (True, 0.929)
    >>> adapter_gains([run("lora", 0, .1, .5), run("qlora", 0, .1, .4)], [0])["low"] is None
    True
    >>> adapter_gains([run("lora", 0, .1, .5)], [0]) is None
    True
    """
    import numpy as np

    by = {(r["arm"], r["seed"]): r for r in runs if r["arm"] in ("lora", "qlora")}
    common = [s for s in seeds if ("lora", s) in by and ("qlora", s) in by]
    if not common:
        return None

    def gain(run: dict) -> float:
        return run["curve"][-1]["reward"] - run["curve"][0]["reward"]

    lora = np.array([gain(by["lora", s]) for s in common])
    qlora = np.array([gain(by["qlora", s]) for s in common])
    diff = qlora - lora
    low, high = paired_interval(diff) if len(common) >= 3 else (None, None)
    return {
        "seeds": common,
        "lora_base": [by["lora", s]["curve"][0]["reward"] for s in common],
        "qlora_base": [by["qlora", s]["curve"][0]["reward"] for s in common],
        "lora": lora.tolist(),
        "qlora": qlora.tolist(),
        "difference": float(diff.mean()),
        "low": low,
        "high": high,
        "ratio": float(qlora.mean() / lora.mean()) if lora.mean() > 0 else None,
    }


def gain_rows(result: dict) -> list[Row]:
    """QLoRA's gain against LoRA's (`--arms lora,qlora`): the ratio of the mean gains, goal >= 1; the spread is
    the difference's t interval over the seeds divided by LoRA's mean gain (1 inside it: within noise)."""
    g = adapter_gains(result["runs"], result["seeds"])  # from the saved runs: the table follows this code
    if not g:
        return []
    n, lora_mean = len(g["seeds"]), sum(g["lora"]) / len(g["lora"])
    spread = (1 + g["low"] / lora_mean, 1 + g["high"] / lora_mean) if g["low"] is not None and lora_mean > 0 else None
    status = "" if result.get("status") == "complete" else f" ({result['status']})"

    def side(label: str, bases: list[float], gains: list[float]) -> str:
        runs = ", ".join(f"{b:.3f} → {b + x:.3f}" for b, x in zip(bases, gains, strict=True))
        return f"{label}: {runs} (mean gain {sum(gains) / len(gains):+.3f})"

    interval = "" if g["low"] is None else f" (95 % CI {g['low']:+.3f} to {g['high']:+.3f})"
    return [
        Row(
            f"QLoRA (NF4) vs LoRA: gain over each one's own base after {result['steps']} steps, {n} seed"
            f"{'s' if n != 1 else ''}, difference {g['difference']:+.3f}{interval} (`bench.lora_vs_full --arms "
            f"lora,qlora`){status}",
            side("LoRA", g["lora_base"], g["lora"]),
            side("QLoRA", g["qlora_base"], g["qlora"]),
            g["ratio"],
            ">= 1",
            spread=spread,
            note="" if g["ratio"] is not None else "not measurable: LoRA gained nothing",
        )
    ]


# ---------------------------------------------------------------- table rows


def sweep_rows(result: dict) -> list[Row]:
    """The seeds' rows: the gap at the compared rates with its t interval over the seeds, and time to a holdout
    reward every run reached."""
    sweep, steps, rows = result["sweep"], result["steps"], []
    status = "" if result.get("status") == "complete" else f" ({result['status']})"
    for name, a in sweep["arms"].items():
        rate = sweep["compared_learning_rate"]
        n = len(a["seeds"])
        sweep_note = ""
        by_rate = sweep["by_rate"]
        if any(len(v) > 1 for v in by_rate.values()):
            sweep_note = "; rates at seed {}: {}".format(
                sweep["sweep_seed"],
                "; ".join(
                    f"{LABEL[arm]} "
                    + ", ".join(f"{lr} → {v:.3f}" for lr, v in sorted(rs.items(), key=lambda x: float(x[0])))
                    for arm, rs in by_rate.items()
                ),
            )
        label = f"{LABEL[name]} vs full: holdout reward after {steps} steps, {n} seed{'s' if n != 1 else ''}, gap % (`bench.lora_vs_full`)"
        spread = (a["gap_low_pct"], a["gap_high_pct"]) if "gap_low_pct" in a else None
        rows.append(
            Row(
                label,
                f"full (lr {rate['full']:g}): {a['full_mean']:.3f} ({', '.join(f'{v:.2f}' for v in a['full'])})",
                f"{LABEL[name]} (lr {rate[name]:g}): {a['arm_mean']:.3f} ({', '.join(f'{v:.2f}' for v in a['arm'])})",
                a["gap_pct"],
                "<= 3",
                unit="%",
                spread=spread,
                note=("" if a["gap_pct"] is not None else "not measurable: full scored 0")
                + (
                    f"{'within noise' if spread and spread[0] <= 3 <= spread[1] else ('meets' if a['gap_pct'] is not None and a['gap_pct'] <= 3 else 'misses')}{sweep_note}{status}"
                    if (sweep_note or status) and a["gap_pct"] is not None
                    else ""
                ),
            )
        )
        t = a["time_to_quality"]
        rows.append(
            Row(
                f"{LABEL[name]} vs full: training CPU time to holdout reward ≥ {t['threshold']:g} (reached by every run), "
                f"speedup, {n} seed{'s' if n != 1 else ''}",
                f"full: {t['full_cpu_s']:.0f} CPU s (median)",
                f"{LABEL[name]}: {t['arm_cpu_s']:.0f} CPU s (median)",
                t["ratio"],
                ">= 3",
                spread=tuple(t["spread"]) if t["spread"] else None,
            )
        )
    return rows


def table_rows(load) -> list[Row]:
    result = load("lora_vs_full")
    gains = load("qlora_vs_lora")  # QLoRA against LoRA alone, over seeds (no full arm)
    gain = gain_rows(gains) if gains is not None else []
    if result is None:
        return gain or [
            Row(
                "LoRA/QLoRA vs full fine-tuning (`bench.lora_vs_full`)",
                "full",
                "LoRA, QLoRA",
                None,
                "",
                note="not run yet",
            )
        ]
    rows = (sweep_rows(result) if result.get("sweep") and result["sweep"].get("arms") else []) + gain
    earlier = load("lora_vs_full_qlora_1seed")  # the earlier one-seed run: its QLoRA rows (not rerun)
    if earlier is not None:
        rows += [r for r in _single_rows(earlier) if r.benchmark.startswith("QLoRA")]
    if rows:
        return rows + [r for r in _single_rows(result) if "peak RSS" in r.benchmark]
    return _single_rows(result)


def _single_rows(result: dict) -> list[Row]:
    """The rows of one run per arm (the best rate at the first seed): gap, time to quality, memory."""
    steps, thr, rows = result["steps"], result["threshold"], []
    arms = result["arms"]
    analysis = analyse(arms, thr)  # from the saved measurements, so the table follows the analysis code
    for name, a in analysis.items():
        q = a["quality"]
        rows.append(
            Row(
                f"{LABEL[name]} vs full: holdout reward after {steps} steps, one seed, gap % (`bench.lora_vs_full`)",
                f"full: {q['full']:.3f}",
                f"{LABEL[name]}: {q['arm']:.3f}",
                q["gap_pct"],
                "<= 3",
                unit="%",
                spread=(q["low_pct"], q["high_pct"]) if q["gap_pct"] is not None else None,
                note="" if q["gap_pct"] is not None else "not measurable: full fine-tuning scored 0",
            )
        )
    for name, a in analysis.items():
        t, w = a["time_to_quality"], a["time_to_quality_wall"]

        def side(label, hit, wall, total):
            if hit is None:
                return f"{label}: not in {steps} steps" + (f" ({total:.0f} CPU s)" if total else "")
            return f"{label}: {hit['train_s']:.0f} CPU s, {wall['train_s']:.0f} s wall ({hit['step']} steps)"

        full_side = side("full", t["full"], w["full"], t["full_total_s"])
        arm_side = side(LABEL[name], t["arm"], w["arm"], result["arms"][name]["curve"][-1]["train_cpu_s"])
        bench = f"{LABEL[name]} vs full: training CPU time to holdout reward ≥ {thr:g}, speedup"
        if "ratio" in t:
            rows.append(
                Row(bench, full_side, arm_side, t["ratio"], ">= 3", spread=tuple(t["spread"]) if t["spread"] else None)
            )
        elif "ratio_at_least" in t:
            ok = "meets" if t["ratio_at_least"] >= 3 else "not measurable: full never got there"
            rows.append(
                Row(bench, full_side, arm_side, t["ratio_at_least"], ">= 3", note=f"{ok} (≥ {t['ratio_at_least']:.2f})")
            )
        elif "ratio_at_most" in t:
            ok = "misses" if t["ratio_at_most"] < 3 else "not measurable: the adapter never got there"
            rows.append(
                Row(bench, full_side, arm_side, t["ratio_at_most"], ">= 3", note=f"{ok} (≤ {t['ratio_at_most']:.2f})")
            )
        else:
            rows.append(Row(bench, full_side, arm_side, None, ">= 3", note="neither side got there"))
    for name, a in analysis.items():
        m = a["memory"]
        tp = arms[name]["trainable_params"] / arms["full"]["trainable_params"] * 100
        rows.append(
            Row(
                f"{LABEL[name]} vs full: peak RSS while training ({tp:.1f} % of the parameters trained)",
                f"full: {m['full_mb']:,.0f} MiB",
                f"{LABEL[name]}: {m['arm_mb']:,.0f} MiB",
                m["ratio"],
                "< 1",
            )
        )
    return rows


# ---------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> dict | None:
    opts = _options(argv)
    if opts.arm:  # child: one arm, result as JSON in the work folder
        work = Path(opts.work)
        result = run_arm(
            opts.arm,
            (work / "model_path").read_text(),
            str(work / "data" / "train.jsonl"),
            str(work / "data" / "holdout.jsonl"),
            opts,
        )
        (work / f"{opts.arm}.json").write_text(json.dumps(result))
        return None

    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.data.demo_task import generate
    from grpo_pipeline.tasks.data.splits import write_splits
    from grpo_pipeline.tasks.model import ensure_demo_model
    from tests.tiny_model import create_random_model

    arms = [a for a in opts.arms.split(",") if a]
    # full fine-tuning is the baseline of the gap; LoRA alone is QLoRA's (the gain over each arm's own base)
    if not set(arms) <= set(ARMS) or not ("full" in arms or {"lora", "qlora"} <= set(arms)):
        raise SystemExit(
            f"--arms {opts.arms!r}: give 'full' (the baseline) and any of lora, qlora; or lora,qlora (QLoRA's gain "
            "against LoRA's)"
        )
    demo = load_config(ROOT / "configs" / "demo-cpu.yaml")
    work = (opts.keep or Path(tempfile.mkdtemp(prefix="bench-lora-full-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model_path").is_file():
        model = create_random_model(work / "tiny") if opts.tiny else ensure_demo_model(demo.data_dir / "models")
        (work / "model_path").write_text(str(Path(model).resolve()))
        write_splits(generate(demo.data.demo.model_copy(update={"n_holdout": opts.holdout})), work / "data")
    model = (work / "model_path").read_text()

    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",") if x.strip()]

    rates = {
        arm: floats(opts.full_lrs if arm == "full" else opts.adapter_lrs)
        or [opts.full_lr if arm == "full" else demo.train.grpo["learning_rate"]]
        for arm in arms
    }
    seeds = [int(x) for x in opts.seeds.split(",") if x.strip()]
    runs: list[dict] = []
    started = time.monotonic()
    # without the full arm, a result of its own: the full-vs-adapter result stays as it was
    name = ("lora_vs_full" if "full" in arms else "qlora_vs_lora") + ("_tiny" if opts.tiny else "")

    def one(arm: str, lr: float, seed: int) -> dict:
        """One arm at one rate and seed, in its own process; reused when the work folder has it."""
        out = work / f"{arm}-lr{lr:g}-s{seed}.json"
        if not out.is_file():
            print(f"[lora_vs_full] {arm} lr={lr:g} seed={seed}", flush=True)
            # Waiting OpenMP threads sleep instead of spinning: on a shared machine spinning burns CPU seconds
            # that are not work, and the arms are compared on CPU seconds.
            env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
            passthrough = [f"--steps={opts.steps}", f"--eval-every={opts.eval_every}", f"--lr={lr}", f"--seed={seed}"]
            subprocess.run(
                [sys.executable, "-m", "bench.lora_vs_full", "--arm", arm, "--work", str(work), *passthrough],
                check=True,
                env=env,
            )
            (work / f"{arm}.json").replace(out)
        run = json.loads(out.read_text())
        if not any(r["arm"] == arm and r["learning_rate"] == run["learning_rate"] and r["seed"] == seed for r in runs):
            runs.append(run)
        return run

    def report(status: str) -> dict:
        first = {
            arm: next(
                (
                    r
                    for r in runs
                    if r["arm"] == arm
                    and r["seed"] == seeds[0]
                    and r["learning_rate"] == best_rates(runs, seeds[0]).get(arm)
                ),
                None,
            )
            for arm in arms
        }
        chosen = {arm: r for arm, r in first.items() if r is not None}
        out = {
            "name": name,
            "status": status,
            "baseline": "full-parameter GRPO (TRL GRPOTrainer, no peft_config)",
            "steps": opts.steps,
            "eval_every": opts.eval_every,
            "holdout": opts.holdout,
            "threshold": opts.threshold,
            "model": str(model),
            "rates": rates,
            "seeds": seeds,
            # the best rate's run at the first seed per arm: what the single-run analysis reads
            "analysis": analyse(chosen, opts.threshold) if "full" in chosen else {},
            "arms": chosen,
            "sweep": sweep_analysis(runs, seeds, opts.threshold) if len(runs) > len(arms) else None,
            "gains": adapter_gains(runs, seeds),
            "runs": runs,
            "seconds": time.monotonic() - started,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        save(name, out)
        return out

    if opts.seeds_first:
        for seed in seeds:
            for arm in arms:
                one(arm, rates[arm][0], seed)
                report(f"partial: seeds at the first rates, seed {seed}")
    # The rate sweep at the first seed, arms interleaved (a partial result stays balanced) ...
    for i in range(max(len(r) for r in rates.values())):
        for arm in arms:
            if i < len(rates[arm]):
                one(arm, rates[arm][i], seeds[0])
                report("partial: learning-rate sweep")
    # ... then every further seed at each arm's best rate.
    best = best_rates(runs, seeds[0])
    for seed in seeds[1:]:
        for arm in arms:
            if any(r["arm"] == arm and r["seed"] == seed for r in runs) and opts.seeds_first:
                continue  # this seed ran at the first rate; a better rate found later is reported, not rerun
            one(arm, best[arm], seed)
            report(f"partial: seeds at the best rates, seed {seed}")
    final = report("complete")
    analysis = final["analysis"]
    for label, a in analysis.items():
        q, t, m = a["quality"], a["time_to_quality"], a["memory"]
        speed = t.get("ratio") or t.get("ratio_at_least") or t.get("ratio_at_most")
        gap = (
            "n/a"
            if q["gap_pct"] is None
            else (f"{q['gap_pct']:+.1f} % (95 % CI {q['low_pct']:+.1f} to {q['high_pct']:+.1f})")
        )
        print(
            f"[lora_vs_full] {LABEL[label]}: holdout reward {q['arm']:.3f} vs full {q['full']:.3f}, gap {gap}; "
            f"time-to-quality speedup "
            f"{'n/a' if speed is None else f'{speed:.2f}x'}; peak RSS ratio {m['ratio']:.2f}"
        )
    for label, a in ((final["sweep"] or {}).get("arms") or {}).items():
        gap = "n/a" if a["gap_pct"] is None else f"{a['gap_pct']:+.1f} %"
        print(
            f"[lora_vs_full] over seeds {a['seeds']} at the best rates {final['sweep']['best_learning_rate']}: "
            f"{LABEL[label]} {a['arm']} vs full {a['full']}, gap {gap} "
            f"({a.get('gap_low_pct', float('nan')):+.1f} to {a.get('gap_high_pct', float('nan')):+.1f})"
        )
    g = final["gains"]
    if g:
        interval = "no interval under 3 seeds" if g["low"] is None else f"95 % CI {g['low']:+.3f} to {g['high']:+.3f}"
        print(
            f"[lora_vs_full] gains over each arm's own base, seeds {g['seeds']}: LoRA {g['lora']}, QLoRA {g['qlora']}; "
            f"QLoRA - LoRA {g['difference']:+.3f} ({interval})"
        )
    return final


if __name__ == "__main__":
    main()
