"""Benchmark: how long must a search trial be to tell configurations apart? The evidence for `hpo.steps` and the rungs.

A handful of configurations spanning the search space (learning rate over two decades, LoRA rank, alpha ratio,
sampling temperature; `CONFIGURATIONS`) each train the final number of steps (`--steps`, 40) on a task
(`--task demo | gsm8k`, as `bench.hpo_gain` sets them up). For each configuration and each k of `--ks` (4, 8, 16)
it records the two scores the search uses, and at the end its holdout reward:

- **the trial score** (what ranks a finished trial, `hpo.trial_score: greedy`): the greedy weighted total reward of
  the adapter saved at step k on the search's selection prompts (`grpo_pipeline.tasks.hpo.prepare_validation`:
  n = (sd / hpo.target_standard_error)^2 prompts, the same for every configuration). Its noise is known: the
  per-prompt standard deviation over n prompts, measured here and reported as a standard error. Chosen over the
  trainer's sampled reward because it pairs prompt by prompt across trials and does not favour a low sampling
  temperature (a sampled reward at temperature 0.6 looks better than at 1.0 for the same adapter);
- **the rung score** (what successive halving prunes on): the trainer's sampled validation reward at step k on
  the first `hpo.rung_prompts` of those prompts, `hpo.eval_generations` completions each (the tagged line
  `ReportValidation` prints). Noisier, sampled at each configuration's own temperature; free (no extra pass);
- **the final holdout reward**: the adapter after the final step, greedy on the task's holdout.

Per k and score: Spearman's rank correlation between the score at k and the final holdout reward
(`scipy.stats.spearmanr`) with a 95 % Fisher interval (z = atanh(rho), standard error 1.06 / sqrt(n - 3), Fieller,
Hartley and Pearson's for Spearman's rho; none below 4 configurations). `choose_schedule` then picks the trial
length (the shortest k whose trial-score correlation's lower bound reaches `--threshold`) and the rungs (the
shortest k whose rung-score correlation's lower bound is above `--rung-threshold`, then x the reduction factor up
to the trial length), or says that none does.

    python -m bench.trial_length                        # demo: 8 configurations x 40 steps (several hours on 2 cores)
    python -m bench.trial_length --task gsm8k
    python -m bench.trial_length --tiny                 # a tiny random model, 4 steps, k = 1, 2, 4: the chain runs

Resumable as `bench.hpo_gain` is: each finished configuration is kept in the work folder (`--work`, default
.grpo/bench-trial_length/<task>/) with the fingerprint of the configuration and the code; a folder of another
one is refused (exit 2, `--fresh` starts it over). The chosen schedule is saved in bench/results/trial_length.json,
where `python -m bench.hpo_gain --from-trial-length` reads it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness import (
    ROOT,
    MixedWorkFolder,
    add_threads_option,
    add_work_options,
    fingerprint,
    keep_runs,
    load_runs,
    open_work,
    save,
    stamp,
    torch_threads,
)
from bench.hpo_gain import TASKS, Setup, base_model, holdout, prepare
from bench.table import Row

NAME = "trial_length"
WORK = ROOT / ".grpo" / f"bench-{NAME}"
FINAL_STEPS = 40
KS = (4, 8, 16)
THRESHOLD = 0.6  # a trial length must rank configurations with rho >= 0.6 at its 95 % lower bound
RUNG_THRESHOLD = 0.0  # a rung must rank them better than chance at its lower bound (pruning on noise loses the best)
REDUCTION_FACTOR = 2
CODE = ("trainer", "tasks", "configs", "bench/trial_length.py", "bench/hpo_gain.py", "bench/harness.py")

# Spanning the space: learning rate over two decades (1e-5 .. 1e-3), rank 8..32, alpha ratio 1..2, temperature
# 0.6..1.0; every level of each appears more than once, and no two configurations share a learning rate and a rank.
CONFIGURATIONS: dict[str, dict[str, float]] = {
    "c1": {"learning_rate": 1e-5, "lora_r": 8, "lora_alpha_ratio": 1, "temperature": 1.0},
    "c2": {"learning_rate": 1e-5, "lora_r": 32, "lora_alpha_ratio": 2, "temperature": 0.7},
    "c3": {"learning_rate": 3e-5, "lora_r": 16, "lora_alpha_ratio": 2, "temperature": 0.8},
    "c4": {"learning_rate": 1e-4, "lora_r": 8, "lora_alpha_ratio": 2, "temperature": 0.6},
    "c5": {"learning_rate": 1e-4, "lora_r": 32, "lora_alpha_ratio": 1, "temperature": 0.9},
    "c6": {"learning_rate": 3e-4, "lora_r": 16, "lora_alpha_ratio": 1, "temperature": 1.0},
    "c7": {"learning_rate": 1e-3, "lora_r": 8, "lora_alpha_ratio": 1, "temperature": 0.8},
    "c8": {"learning_rate": 1e-3, "lora_r": 32, "lora_alpha_ratio": 2, "temperature": 0.6},
}
TINY_CONFIGURATIONS = ("c1", "c6", "c8")


# ---------------------------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Correlation:
    """Spearman's rho between a score at step k and the final holdout reward, over n configurations."""

    k: int
    n: int
    rho: float | None  # None: a constant column (no ranking) or fewer than 2 configurations
    low: float | None  # 95 % Fisher interval; None below 4 configurations
    high: float | None
    why: str = ""


def correlation(k: int, scores: list[float], final: list[float]) -> Correlation:
    """Spearman's rho of `scores` (at step k) against `final`, with a 95 % Fisher interval (standard error
    1.06 / sqrt(n - 3): Fieller, Hartley and Pearson's for Spearman's rho).

    >>> c = correlation(8, [0.1, 0.2, 0.3, 0.5, 0.4, 0.9], [0.0, 0.3, 0.2, 0.6, 0.7, 1.0])
    >>> round(c.rho, 3), round(c.low, 3), round(c.high, 3)
    (0.886, 0.199, 0.989)
    >>> correlation(4, [0.5, 0.5, 0.5, 0.5], [0.1, 0.2, 0.3, 0.4]).why
    'a score is the same for every configuration: no ranking'
    >>> correlation(4, [0.1, 0.2, 0.3], [0.1, 0.3, 0.2]).why
    '3 configurations: no interval (4 needed)'
    """
    from scipy import stats

    n = len(scores)
    if n < 2 or len(set(scores)) < 2 or len(set(final)) < 2:
        return Correlation(k, n, None, None, None, "a score is the same for every configuration: no ranking")
    rho = float(stats.spearmanr(scores, final).statistic)
    if n < 4:
        return Correlation(k, n, rho, None, None, f"{n} configurations: no interval (4 needed)")
    z, se = math.atanh(max(-0.9999, min(0.9999, rho))), 1.06 / math.sqrt(n - 3)
    return Correlation(k, n, rho, math.tanh(z - 1.96 * se), math.tanh(z + 1.96 * se))


@dataclass(frozen=True)
class Schedule:
    """The trial length and the successive-halving rungs a correlation table supports, as `hpo.*` settings."""

    steps: int | None  # hpo.steps; None: no measured length ranks configurations well enough
    eval_every: int | None  # hpo.eval_every: the first rung
    reduction_factor: int | None
    rungs: tuple[int, ...]
    reason: str

    def sets(self) -> list[str]:
        """The schedule as `--set` overrides (none when no length was chosen)."""
        if self.steps is None:
            return []
        return [
            f"hpo.steps={self.steps}",
            f"hpo.eval_every={self.eval_every}",
            f"hpo.reduction_factor={self.reduction_factor}",
            "hpo.pruner=successive_halving",
        ]


def _ladder(first: int, last: int, preferred: int) -> int:
    """The reduction factor whose rungs first, first x f, ... land on `last`: `preferred` when they do, else the
    smallest that does (last / first itself: one step up).

    >>> _ladder(4, 16, 2), _ladder(4, 36, 2), _ladder(4, 20, 2)
    (2, 3, 5)
    """
    ratio = last // first
    for factor in [preferred, *range(2, ratio + 1)]:
        power = 1
        while power < ratio:
            power *= factor
        if power == ratio:
            return factor
    return ratio


def choose_schedule(
    trial: list[Correlation],
    rung: list[Correlation],
    final_steps: int,
    threshold: float = THRESHOLD,
    rung_threshold: float = RUNG_THRESHOLD,
    reduction_factor: int = REDUCTION_FACTOR,
) -> Schedule:
    """The trial length: the shortest k (at most `final_steps`) whose trial-score correlation with the final
    holdout reward has its 95 % lower bound at `threshold` or above. The rungs: from the shortest k below it that
    divides it and whose rung-score correlation's lower bound is above `rung_threshold`, x the reduction factor
    (`reduction_factor` when its ladder lands on the trial length, else the smallest that does) up to the trial
    length; no such k: one rung, at the trial's end (nothing is pruned). None clears: no length, and why.

    >>> def table(*rows): return [Correlation(k, 8, r, lo, None) for k, r, lo in rows]
    >>> s = choose_schedule(table((4, 0.5, 0.1), (8, 0.8, 0.65), (16, 0.9, 0.8)), table((4, 0.4, 0.05), (8, 0.7, 0.3)), 40)
    >>> s.steps, s.eval_every, s.reduction_factor, s.rungs
    (8, 4, 2, (4, 8))
    >>> choose_schedule(table((8, 0.8, 0.65)), table((4, 0.4, 0.3)), 40, rung_threshold=0.5).reason
    "k=8: trial-score rho 0.80, 95 % lower bound 0.65 >= 0.6; no shorter rung's score has its 95 % lower bound above 0.5: no pruning"
    >>> choose_schedule(table((4, 0.3, -0.2), (8, 0.5, 0.1)), [], 40).reason
    'no trial length clears the threshold: the best is k=8 (rho 0.50, 95 % lower bound 0.10 < 0.6); a search on trials this short ranks configurations by noise: keep the configured values, or measure longer trials, a less noisy score (more validation prompts) or a narrower space'
    """
    usable = sorted((c for c in trial if c.k <= final_steps), key=lambda c: c.k)
    chosen = next((c for c in usable if c.low is not None and c.low >= threshold), None)
    if chosen is None:
        ranked = [c for c in usable if c.low is not None]
        if not ranked:
            return Schedule(
                None,
                None,
                None,
                (),
                "no trial length has an interval: too few configurations, or every score was the same (no ranking)",
            )
        best = max(ranked, key=lambda c: c.low or -1.0)
        return Schedule(
            None,
            None,
            None,
            (),
            f"no trial length clears the threshold: the best is k={best.k} (rho {best.rho:.2f}, 95 % lower bound "
            f"{best.low:.2f} < {threshold:g}); a search on trials this short ranks configurations by noise: keep the "
            "configured values, or measure longer trials, a less noisy score (more validation prompts) or a narrower "
            "space",
        )
    steps = chosen.k
    why = f"k={steps}: trial-score rho {chosen.rho:.2f}, 95 % lower bound {chosen.low:.2f} >= {threshold:g}"
    first = next(
        (
            c
            for c in sorted(rung, key=lambda c: c.k)
            if c.k < steps and steps % c.k == 0 and c.low is not None and c.low > rung_threshold
        ),
        None,
    )
    if first is None:
        return Schedule(
            steps,
            steps,
            reduction_factor,
            (steps,),
            f"{why}; no shorter rung's score has its 95 % lower bound above {rung_threshold:g}: no pruning",
        )
    factor = _ladder(first.k, steps, reduction_factor)
    rungs, at = [], first.k
    while at <= steps:
        rungs.append(at)
        at *= factor
    return Schedule(
        steps,
        first.k,
        factor,
        tuple(rungs),
        f"{why}; first rung k={first.k}: rung-score rho {first.rho:.2f}, lower bound {first.low:.2f} > {rung_threshold:g}",
    )


def table(runs: dict[str, dict], ks: list[int]) -> dict[str, list[Correlation]]:
    """The correlation table from the finished configurations: per score ("trial", "rung"), one row per k."""
    done = [r for r in runs.values() if "holdout_reward" in r]
    out: dict[str, list[Correlation]] = {"trial": [], "rung": []}
    for k in ks:
        for score, key in (("trial", "greedy"), ("rung", "rung")):
            have = [r for r in done if str(k) in r[key]]
            out[score].append(correlation(k, [r[key][str(k)] for r in have], [r["holdout_reward"] for r in have]))
    return out


# ---------------------------------------------------------------------------------------------- measuring


def run_configuration(params: dict[str, float], setup: Setup, validation, ks: list[int], folder: Path) -> dict:
    """Train one configuration to the final step with a rung check and a checkpoint every min(ks) steps; score each
    checkpoint at k greedily on the selection prompts, and the final adapter on the holdout."""
    from grpo_pipeline.infra.launch.local import LocalLauncher
    from grpo_pipeline.tasks.evaluate import evaluate_model
    from grpo_pipeline.tasks.hpo import to_overrides, trial_train
    from grpo_pipeline.tasks.job import build_job_spec
    from grpo_pipeline.trainer.spec import parse_progress

    cfg = setup.cfg
    steps = cfg.train.grpo["max_steps"]
    every = min(ks)
    train = cfg.train.model_copy(update={"checkpoint_every": every, "keep_checkpoints": steps // every + 1})
    hpo = cfg.hpo.model_copy(update={"steps": steps, "eval_every": every, "enabled": False})
    section = trial_train(train, hpo, to_overrides(params, cfg.train.lora))
    spec = build_job_spec(section, cfg.model, setup.model, {**setup.splits, "val": validation.rungs}, folder)
    spec = spec.model_copy(update={"val_file": str(Path(validation.rungs).resolve())})
    rung: dict[str, float] = {}

    def on_line(line: str) -> None:
        if report := parse_progress(line):
            rung.setdefault(str(int(report["step"])), float(report["val_reward"]))

    started = time.monotonic()
    launcher = LocalLauncher(0, on_line=on_line)
    result = launcher.wait(launcher.launch(spec))
    train_s = time.monotonic() - started
    rewards, scoring = cfg.train.reward_set(), cfg.evaluate.model_copy(update={"samples_k": 0})
    greedy, sd = {}, {}
    for k in ks:
        found = sorted(Path(spec.checkpoint_uri).glob(f"checkpoint-{k}/**/adapter_config.json"))
        if not found:
            continue
        scored = evaluate_model(
            setup.model, cfg.model, validation.select, rewards, scoring, adapter=str(found[0].parent)
        )
        totals = [float(r["total"]) for r in scored.rows]
        greedy[str(k)], sd[str(k)] = statistics.fmean(totals), statistics.pstdev(totals)
    final = holdout(setup, result.adapter_dir)
    return {
        "params": params,
        "greedy": greedy,
        "greedy_sd": sd,
        "rung": rung,
        "holdout_reward": final.reward,
        "steps": result.global_step,
        "train_s": train_s,
    }


def noise(runs: dict[str, dict], prompts: int, rung_prompts: int, generations: int, span: float) -> dict:
    """Each score's noise: the trial score's measured per-prompt SD (mean over configurations and k) over its n
    prompts; the rung score's bound, the worst-case SD (half the reward's span) over its prompts alone (a
    prompt's completions are correlated, so they count as one at worst).

    >>> noise({"a": {"greedy_sd": {"4": 0.5, "8": 0.3}}}, prompts=16, rung_prompts=4, generations=2, span=2.0)
    {'trial_score_se': 0.1, 'trial_prompts': 16, 'rung_score_se_at_most': 0.5, 'rung_samples': 8}
    """
    sds = [v for r in runs.values() for v in r.get("greedy_sd", {}).values()]
    return {
        "trial_score_se": round(statistics.fmean(sds) / math.sqrt(prompts), 4) if sds and prompts else None,
        "trial_prompts": prompts,
        "rung_score_se_at_most": round(span / 2 / math.sqrt(rung_prompts), 4),
        "rung_samples": rung_prompts * generations,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), default="demo")
    parser.add_argument(
        "--steps", type=int, default=None, help=f"the final training's steps ({FINAL_STEPS}; --tiny: 4)"
    )
    parser.add_argument(
        "--ks",
        nargs="+",
        type=int,
        default=None,
        help=f"trial lengths to score ({' '.join(map(str, KS))}; --tiny: 1 2 4)",
    )
    parser.add_argument("--configurations", nargs="+", choices=list(CONFIGURATIONS), default=None)
    parser.add_argument("--threshold", type=float, default=THRESHOLD, help="a trial length's lower bound on rho")
    parser.add_argument("--rung-threshold", type=float, default=RUNG_THRESHOLD, help="a rung's lower bound on rho")
    parser.add_argument("--seed", type=int, default=0, help="train.grpo.seed of every configuration")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model, 4 steps: the chain, not the figures")
    parser.add_argument("--report-only", action="store_true", help="run nothing: report what the work folder holds")
    add_work_options(parser, WORK)
    add_threads_option(parser)
    opts = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    steps = opts.steps or (4 if opts.tiny else FINAL_STEPS)
    ks = sorted(opts.ks or ([1, 2, 4] if opts.tiny else list(KS)))
    names = opts.configurations or list(TINY_CONFIGURATIONS if opts.tiny else CONFIGURATIONS)
    if any(k % ks[0] for k in ks) or ks[-1] > steps or steps % ks[0]:
        print(f"[{NAME}] --ks {ks}: each k must be a multiple of the first, and --steps {steps} too", file=sys.stderr)
        return 2
    task = TASKS[opts.task]
    work = (opts.work / task.name / ("tiny" if opts.tiny else "")).resolve()
    identity = json.dumps(
        {
            "task": task.name,
            "config": task.config.read_text(),
            "steps": steps,
            "ks": ks,
            "seed": opts.seed,
            "tiny": opts.tiny,
        },
        sort_keys=True,
    )
    try:
        state = open_work(work, fingerprint(identity, CODE), opts.fresh)
    except MixedWorkFolder as exc:
        print(f"[{NAME}] {exc}", file=sys.stderr)
        return 2
    threads = torch_threads(opts.threads)
    if threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    todo = [n for n in names if n not in state["runs"]]
    if todo and not opts.report_only:
        from bench.hpo_gain import overrides
        from grpo_pipeline.configs.schema import load_config
        from grpo_pipeline.tasks.hpo import prepare_validation

        work.mkdir(parents=True, exist_ok=True)
        model = base_model(work, opts.tiny)
        search = {
            "trial_steps": 1,
            "eval_every": 1,
            "reduction_factor": 2,
            "trials": 1,
            "min_configurations": 1,
            "budget_runs": 1,
            "target_se": task.target_se,
        }
        cfg = load_config(
            task.config, [*overrides(task, work, steps, search, opts.tiny, model), f"train.grpo.seed={opts.seed}"]
        )
        setup = Setup(cfg, model, prepare(task, cfg, work, opts.tiny))
        validation = prepare_validation(cfg.hpo, cfg.train.reward_set(), setup.splits["val"], work / "validation")
        state["validation"] = {
            "prompts": validation.needed,
            "rung_prompts": cfg.hpo.rung_prompts,
            "generations": cfg.hpo.eval_generations,
            "span": cfg.train.reward_set().span,
        }
        for name in todo:
            print(f"[{NAME}] {task.name}: {name} {CONFIGURATIONS[name]}", file=sys.stderr, flush=True)
            state["runs"][name] = run_configuration(CONFIGURATIONS[name], setup, validation, ks, work / name)
            keep_runs(work / "runs.json", state)
    report = build_report(task.name, state, ks, steps, opts)
    results = load_runs(_results_path(opts.tiny)) or {}
    saved = {"name": NAME + ("_tiny" if opts.tiny else ""), "tasks": {**results.get("tasks", {}), task.name: report}}
    save(saved["name"], saved | stamp())
    for line in lines(report):
        print(f"[{NAME}] {line}", flush=True)
    return 0


def _results_path(tiny: bool) -> Path:
    from bench import harness

    return harness.RESULTS / f"{NAME}{'_tiny' if tiny else ''}.json"


def build_report(task: str, state: dict, ks: list[int], steps: int, opts: argparse.Namespace) -> dict:
    runs = {n: r for n, r in state["runs"].items() if n in CONFIGURATIONS}
    correlations = table(runs, ks)
    choice = choose_schedule(correlations["trial"], correlations["rung"], steps, opts.threshold, opts.rung_threshold)
    v = state.get("validation") or {}
    return {
        "steps": steps,
        "ks": ks,
        "configurations": {n: r for n, r in runs.items()},
        "correlations": {score: [asdict(c) for c in rows] for score, rows in correlations.items()},
        "noise": noise(runs, v.get("prompts", 0), v.get("rung_prompts", 1), v.get("generations", 1), v.get("span", 1.0))
        if v
        else None,
        "threshold": opts.threshold,
        "rung_threshold": opts.rung_threshold,
        "choice": asdict(choice) | {"sets": choice.sets()},
        "fingerprint": state["fingerprint"],
        "tiny": opts.tiny,
    }


def lines(report: dict) -> list[str]:
    out = [f"{len(report['configurations'])} configurations x {report['steps']} steps; noise {report['noise']}"]
    for score, rows in report["correlations"].items():
        for c in rows:
            figures = (
                f"rho {c['rho']:+.2f}"
                + (f" (95 % CI {c['low']:+.2f} to {c['high']:+.2f})" if c["low"] is not None else "")
                if c["rho"] is not None
                else "no rho"
            )
            out.append(f"{score:5s} score at k={c['k']:>3}: {figures}, n={c['n']} {c['why']}".rstrip())
    choice = report["choice"]
    out.append(f"choice: {' '.join(choice['sets']) or 'none'}; {choice['reason']}")
    return out


def table_rows(load) -> list[Row]:
    r = load(NAME)
    bench = "search trial length: rank correlation of a k-step trial's score with the final holdout reward (`bench.trial_length`)"
    if r is None or not r.get("tasks"):
        return [Row(bench, "", "", None, "", note="not run yet")]
    rows = []
    for task, t in r["tasks"].items():
        trial = {c["k"]: c for c in t["correlations"]["trial"]}
        shown = ", ".join(
            f"k={k}: {c['rho']:+.2f}" + (f" ({c['low']:+.2f}–{c['high']:+.2f})" if c["low"] is not None else "")
            if c["rho"] is not None
            else f"k={k}: –"
            for k, c in trial.items()
        )
        rows.append(
            Row(
                f"{bench}, {task}, {len(t['configurations'])} configurations x {t['steps']} steps",
                "",
                shown,
                None,
                "",
                note=f"chosen: {' '.join(t['choice']['sets']) or 'none'} ({t['choice']['reason'][:140]})",
            )
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
