"""Benchmark: LoRA and QLoRA (NF4) GRPO against full-parameter GRPO, compared fairly, on the skill.

The seed claims LoRA/QLoRA GRPO stays "within 1-3 % of full fine-tuning quality" and reaches quality "3-12x
faster". This benchmark measures both on two tasks, the demo (sums asked in words; skill reward
`correct_answer`) and GSM8K's calculator annotations (`bench.gsm8k_calc`; skill reward `math_answer`), with
three arms that differ only in what trains:

- full: every weight (AdamW), through TRL's GRPOTrainer without a `peft_config`;
- lora: the task config's adapter (`train.lora`) over the frozen fp32 base;
- qlora: the same adapter over an NF4 (bitsandbytes 4-bit) base, kept in float32 (`keep_adapter_fp32`).

Every arm runs the pipeline trainer's step cuts that apply to it (`step_cuts`): prefill once, the shared prompt
forward, the compact LM head, the zero-advantage skip and no gradient checkpointing on a CPU apply to full
fine-tuning as to the adapters; generation from merged weights needs an adapter (and falls back on an NF4 base).

What makes the comparison fair, and is checked before a verdict is printed (`fairness_problems`):
- full and LoRA each at its best of at least 3 learning rates, chosen on the VALIDATION score at the first seed
  (`choose_rate`; the holdout is never read for it); a best rate on the grid's edge gets the next rate out
  (`next_rate_out`, said in the report); then every further seed at that rate; 3 seeds at least;
- QLoRA at LoRA's chosen rate (what the NF4 base costs at the same settings), at `--qlora-seeds` seeds: its figures
  are reported, its verdict only from 3 seeds on;
- each run trained to a plateau: it stops when two successive validation evaluations gain nothing over the best
  before them, by a one-sided paired t-test at 5 % on the validation prompts (`plateau`; the gain it can see,
  `detectable_gain`, is reported), or at the cap (`--max-steps`, at least 80);
- the same prompts in the same order: one seed gives every arm the same data order, and every evaluation scores
  the same validation and holdout prompts in the same order, so the holdout scores pair prompt by prompt;
- a holdout of at least `min_holdout(task)` prompts (`holdout_needed` at the task's planned accuracy), and the
  interval it achieves is reported with whether it can tell a 3 % gap from a 10 % one (`resolves`).

Fitted to a 2-core CPU: each base (fp32, NF4) is scored once on validation and the holdout, and every run on it
starts its curve from those scores (an adapter starts as the identity); validation every 16 steps keeps
evaluation under about half of a run; two runs side by side at one torch thread each (`--side-by-side`,
`--threads`).

Reported per task and arm: the holdout reward at the plateau, total and skill; the gap to full in % on both, with a
95 % interval from a two-way paired bootstrap over seeds and holdout prompts (`gap_interval`); the step and the CPU
time (process time, evaluations excluded: the machine is shared) at which each arm first reaches 95 % of full's
plateau on the validation curve (`time_to_target`); the verdict "within 3 %" on the skill reward; the NF4 base's
own holdout scores beside the fp32 base's. Plus what LoRA saves on this CPU (optimizer state, gradients,
checkpoint size, measured on the model).

    python -m bench.lora_vs_full                                  # the demo's comparison (hours on 2 cores)
    python -m bench.lora_vs_full --tasks demo,gsm8k               # and GSM8K's calculator task
    python -m bench.lora_vs_full --report-only                    # the comparison from the runs kept so far
    python -m bench.lora_vs_full --tiny                           # a tiny random model, 2 steps: the chain only
    python -m bench.lora_vs_full --set train.lora.r=1             # any task-config override, on every task

Every run happens in its own process and writes its small record (settings, per-evaluation means, the holdout's
per-prompt scores, times) under `bench/results/lora_vs_full/` as it ends: a stopped invocation loses at most the
runs in flight, and the next one runs only what has no record. A record made with other settings, another task
config or another version of the step's code (`RUN_CODE`) is refused (exit 2, naming what differs); `--fresh`
measures those runs again.

One module, past the ~600 lines a module is cut at, as every benchmark here: a benchmark is read whole, its arms,
its runner, its statistics and its report in one file, what it shares with the others in `bench/harness.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.harness import (
    ROOT,
    peak_rss_mb,
    reset_peak_rss,
    save,
    stamp,
)
from bench.table import Row
from grpo_pipeline.trainer.cuts import Cuts

ARMS = ("full", "lora", "qlora")
LABEL = {"full": "full", "lora": "LoRA", "qlora": "QLoRA (NF4)"}
TASKS = ("demo", "gsm8k")
CONFIGS = {"demo": ROOT / "configs" / "demo-cpu.yaml", "gsm8k": ROOT / "configs" / "gsm8k-calc-cpu.yaml"}
NAME = "lora_vs_full_fair"
# What a run's meaning depends on, besides the settings: a change here is another code version (`fingerprint`).
CODE = (
    "bench/lora_vs_full.py",
    "bench/gsm8k_calc.py",
    "trainer",
    "tasks/evaluate.py",
    "tasks/data/demo_task.py",
    "configs/demo-cpu.yaml",
    "configs/gsm8k-calc-cpu.yaml",
)
MIN_RATES = 3
MIN_SEEDS = 3
MIN_CAP = 80
TARGET = 0.95  # time to quality: the first evaluation at 95 % of full's plateau


def base_of(arm: str) -> str:
    """The quantization of an arm's base, which names its base's scores (`base_run`): NF4 for QLoRA.

    >>> base_of("qlora"), base_of("lora")
    ('nf4', 'none')
    """
    return "nf4" if arm == "qlora" else "none"


def skill_reward(task: str) -> str:
    """The reward that measures the task's skill (accuracy), apart from the format's shaping rewards; the verdict is
    judged on it. One place per task, so that it can follow the reward set's own declaration of its skill reward.

    >>> skill_reward("demo"), skill_reward("gsm8k")
    ('correct_answer', 'math_answer')
    """
    return {"demo": "correct_answer", "gsm8k": "math_answer"}[task]


def holdout_needed(
    accuracy: float = 0.5, discordant: float = 0.2, seeds: int = 3, half_width_pct: float = 3.5, z: float = 1.96
) -> int:
    """Holdout prompts for a 95 % interval on the relative skill gap of at most +-`half_width_pct` points, which
    cannot hold both 3 % and 10 % (width under 7). Planning figures, not a guarantee: full's skill at its plateau
    (`accuracy`), the share of prompts on which two runs' greedy answers differ in correctness (`discordant`: the
    variance of a paired difference of 0/1 scores is at most that share), `seeds` independent repeats. The
    interval the benchmark achieves is reported beside it (`resolves`).

    >>> holdout_needed(), holdout_needed(accuracy=0.7), holdout_needed(seeds=1)
    (837, 427, 2509)
    """
    return math.ceil(z**2 * discordant / (seeds * (half_width_pct / 100 * accuracy) ** 2))


# Full fine-tuning's planned skill at its plateau, per task: the demo's recipe reaches 0.77-0.82 on 5 seeds
# (bench/results/recipe_seeds.json), planned lower; GSM8K's calculator task at the conservative half.
PLANNING_ACCURACY = {"demo": 0.7, "gsm8k": 0.5}


def min_holdout(task: str) -> int:
    """The holdout a task needs for a fair verdict (`holdout_needed` at its planned accuracy).

    >>> min_holdout("demo"), min_holdout("gsm8k")
    (427, 837)
    """
    return holdout_needed(accuracy=PLANNING_ACCURACY[task])


MIN_HOLDOUT = holdout_needed()


def detectable_gain(prompts: int, discordant: float = 0.2, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest gain between two evaluations of `prompts` validation prompts that the plateau's paired
    one-sided test sees at `alpha` with `power` (planning: `discordant` as in `holdout_needed`); a smaller one
    passes as noise, so a curve that still rises more slowly than this per evaluation counts as a plateau.

    >>> round(detectable_gain(300), 3), round(detectable_gain(1200), 3)
    (0.064, 0.032)
    """
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(power)
    return z * math.sqrt(discordant / prompts)


# ---------------------------------------------------------------- the rules (pure)


def gained(before: Sequence[float], after: Sequence[float], alpha: float = 0.05) -> bool:
    """Whether `after` scores the same prompts better than `before` beyond noise: a one-sided paired t-test at
    `alpha`; differences that are all equal are a gain when positive (no spread, no test needed).

    >>> gained([0, 0, 1, 1] * 10, [1, 0, 1, 1] * 10), gained([0, 0, 1, 1] * 10, [0, 1, 1, 0] * 10)
    (True, False)
    >>> gained([0, 1] * 5, [0, 1] * 5), gained([0.0] * 3, [0.5] * 3)
    (False, True)
    """
    import numpy as np
    from scipy import stats

    diff = np.asarray(after, float) - np.asarray(before, float)
    if np.ptp(diff) == 0:
        return bool(diff[0] > 0)
    return bool(stats.ttest_1samp(diff, 0.0, alternative="greater").pvalue < alpha)


def plateau(evaluations: Sequence[Sequence[float]], alpha: float = 0.05) -> int | None:
    """The index of the evaluation at which a run has plateaued: the second of two successive evaluations that both
    gain nothing (`gained`) over the best one before them; None while the curve still rises. Each evaluation is the
    per-prompt scores of the same prompts, in the same order.

    >>> rising = [[1.0] * (5 * k) + [0.0] * (40 - 5 * k) for k in range(6)]  # 5 more prompts right each time
    >>> plateau(rising) is None
    True
    >>> flat = [[1.0] * 10 + [0.0] * 30] * 4
    >>> plateau(flat)
    2
    >>> plateau(rising[:3] + [rising[2]] * 3)  # rises, then stays: the second evaluation without a gain
    4
    >>> plateau(rising[:2]) is None  # two evaluations cannot show two without a gain
    True
    """
    import numpy as np

    for i in range(2, len(evaluations)):
        reference = max(evaluations[: i - 1], key=lambda scores: float(np.mean(scores)))
        if not gained(reference, evaluations[i - 1], alpha) and not gained(reference, evaluations[i], alpha):
            return i
    return None


def choose_rate(runs: Sequence[Mapping]) -> float:
    """The learning rate of the run with the best VALIDATION skill at its plateau (ties: the better validation
    total, then the lower rate). Reads each run's `learning_rate` and `validation` only: the holdout, which the
    verdict is measured on, never chooses.

    >>> run = lambda lr, skill, total, holdout: {"learning_rate": lr, "validation": {"skill": skill, "total": total},
    ...                                          "holdout": {"skill": holdout}}
    >>> choose_rate([run(1e-4, 0.40, 1.3, 0.9), run(3e-4, 0.55, 1.5, 0.1), run(1e-3, 0.55, 1.4, 0.5)])
    0.0003
    """
    if not runs:
        raise ValueError("no runs to choose a learning rate from")
    best = max(
        runs,
        key=lambda r: (r["validation"]["skill"], r["validation"]["total"], -r["learning_rate"]),
    )
    return float(best["learning_rate"])


def gap_interval(full, arm, resamples: int = 4000, seed: int = 0) -> dict:
    """(full - arm) / full in %, with a 95 % percentile interval from a two-way paired bootstrap: seeds and holdout
    prompts are each resampled with replacement, and each resample keeps a prompt's full and arm scores together
    (same seed, same prompt). `full` and `arm` are scores shaped (seeds, prompts), paired by seed and prompt.
    None where full scores 0 (no relative gap to give).

    >>> import numpy as np
    >>> rng = np.random.default_rng(1)
    >>> full = (rng.random((3, 400)) < 0.6).astype(float)
    >>> arm = full * (rng.random((3, 400)) > 0.1)  # 10 % of full's right answers lost
    >>> g = gap_interval(full, arm)
    >>> round(g["gap_pct"], 1), g["low_pct"] < g["gap_pct"] < g["high_pct"], 5 < g["low_pct"] and g["high_pct"] < 15
    (9.5, True, True)
    >>> gap_interval(full, full)["low_pct"], gap_interval(full, full)["high_pct"]
    (0.0, 0.0)
    >>> gap_interval(np.zeros((3, 4)), np.ones((3, 4)))["gap_pct"] is None
    True
    """
    import numpy as np

    f, a = np.asarray(full, float), np.asarray(arm, float)
    if f.shape != a.shape or f.ndim != 2:
        raise ValueError(f"full {f.shape} and arm {a.shape} must both be (seeds, prompts), paired")
    out = {
        "full": float(f.mean()),
        "arm": float(a.mean()),
        "seeds": f.shape[0],
        "prompts": f.shape[1],
        "method": f"two-way paired bootstrap (seeds x prompts, {resamples} resamples, percentile)",
    }
    if f.mean() <= 0:
        return out | {"gap_pct": None, "low_pct": None, "high_pct": None}
    rng = np.random.default_rng(seed)
    n_seeds, n_prompts = f.shape
    # a resample's mean is (how often each seed is drawn) @ scores @ (how often each prompt is drawn)
    seed_counts = rng.multinomial(n_seeds, np.full(n_seeds, 1 / n_seeds), size=resamples)
    prompt_counts = rng.multinomial(n_prompts, np.full(n_prompts, 1 / n_prompts), size=resamples)
    f_means = ((seed_counts @ f) * prompt_counts).sum(1)
    a_means = ((seed_counts @ a) * prompt_counts).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        gaps = np.where(f_means > 0, (f_means - a_means) / f_means * 100, np.nan)
    low, high = np.nanpercentile(gaps, [2.5, 97.5])
    return out | {
        "gap_pct": float((f.mean() - a.mean()) / f.mean() * 100),
        "low_pct": float(low),
        "high_pct": float(high),
    }


def resolves(low: float | None, high: float | None) -> bool:
    """Whether an interval on the gap can tell a 3 % gap from a 10 % one: narrower than 7 points, so it cannot hold
    both.

    >>> resolves(1.0, 6.5), resolves(-2.0, 9.0), resolves(None, None)
    (True, False, False)
    """
    return low is not None and high is not None and high - low < 7.0


def verdict(low: float | None, high: float | None, limit: float = 3.0) -> str:
    """ "within 3 %" judged on an interval of the gap: met when all of it lies at or under the limit, missed when all
    of it lies above, else undecided.

    >>> verdict(-1.0, 2.5), verdict(4.0, 12.0), verdict(-1.0, 8.0), verdict(None, None)
    ('met', 'missed', 'undecided: the interval holds 3 %', 'not measurable: full scored 0')
    """
    if low is None or high is None:
        return "not measurable: full scored 0"
    if high <= limit:
        return "met"
    if low > limit:
        return "missed"
    return f"undecided: the interval holds {limit:g} %"


def time_to_target(curve: Sequence[Mapping], target: float, key: str) -> dict | None:
    """The first evaluation of a run's curve at or above `target` on `key`: its step and training time (wall and
    CPU seconds, evaluations excluded); None if the run never got there.

    >>> c = [{"step": 0, "train_s": 0, "train_cpu_s": 0, "skill": 0.1}, {"step": 8, "train_s": 50, "train_cpu_s": 90,
    ...      "skill": 0.5}, {"step": 16, "train_s": 99, "train_cpu_s": 180, "skill": 0.7}]
    >>> time_to_target(c, 0.6, "skill"), time_to_target(c, 0.8, "skill")
    ({'step': 16, 'train_s': 99, 'train_cpu_s': 180}, None)
    """
    for point in curve:
        if point[key] >= target:
            return {"step": point["step"], "train_s": point["train_s"], "train_cpu_s": point["train_cpu_s"]}
    return None


def fairness_problems(
    rates: Mapping[str, Sequence[float]], seeds: Sequence[int], holdout: int, cap: int, min_holdout: int = MIN_HOLDOUT
) -> list[str]:
    """Why a comparison with these settings is not the fair one (empty: it is). A verdict is printed only without
    problems; the figures are still measured and marked not fair.

    >>> fairness_problems({"full": [1e-5, 3e-5, 1e-4], "lora": [1e-4, 3e-4, 1e-3]}, [0, 1, 2], 900, 80)
    []
    >>> for p in fairness_problems({"full": [3e-5], "lora": [1e-4, 3e-4, 1e-3]}, [0], 120, 40): print(p)
    full is tried at 1 learning rate (3e-05): its best of at least 3 is needed, or it may lose on a poor rate alone
    1 seed (0): at least 3 are needed for an interval over seeds
    a holdout of 120 prompts: at least 837 are needed for an interval that tells a 3 % gap from a 10 % one
    a cap of 40 steps: at least 80 are needed, so that runs stop at their plateau and not before it
    """
    problems = [
        f"{arm} is tried at {len(lrs)} learning rate{'s' if len(lrs) != 1 else ''} ({', '.join(f'{x:g}' for x in lrs)}): "
        f"its best of at least {MIN_RATES} is needed, or it may lose on a poor rate alone"
        for arm, lrs in rates.items()
        if len(set(lrs)) < MIN_RATES
    ]
    if len(set(seeds)) < MIN_SEEDS:
        problems.append(
            f"{len(set(seeds))} seed{'s' if len(set(seeds)) != 1 else ''} ({', '.join(map(str, seeds))}): at least "
            f"{MIN_SEEDS} are needed for an interval over seeds"
        )
    if holdout < min_holdout:
        problems.append(
            f"a holdout of {holdout} prompts: at least {min_holdout} are needed for an interval that tells a 3 % gap "
            "from a 10 % one"
        )
    if cap < MIN_CAP:
        problems.append(
            f"a cap of {cap} steps: at least {MIN_CAP} are needed, so that runs stop at their plateau and not before it"
        )
    return problems


# ---------------------------------------------------------------- the tasks' data


def task_rows(task: str, settings: Mapping, gsm8k: Path) -> dict[str, list[dict]]:
    """Train, validation and holdout rows of a task, each question once, no question in two splits.

    demo: `demo_task.generate` at `--demo-max-operand` (its hash split keeps the holdout apart from training; a
    larger operand range gives more distinct questions). gsm8k: the calculator annotations of GSM8K's test split
    are the holdout; those of its train split that are not test questions are split by the same hash into train
    and validation."""
    from grpo_pipeline.configs.schema import DemoTaskConfig
    from grpo_pipeline.tasks.data.demo_task import generate
    from grpo_pipeline.tasks.data.splits import split_of

    if task == "demo":
        cfg = DemoTaskConfig(
            max_operand=settings["demo_max_operand"],
            n_train=2000,
            n_val=settings["validation"],
            n_holdout=settings["holdout"],
        )
        return generate(cfg)
    from bench.gsm8k_calc import calculations

    template = _task_config(task, settings["overrides"]).data.prompt_template

    def questions(split: str) -> dict[str, str]:
        out: dict[str, str] = {}
        with open(gsm8k / f"{split}.jsonl", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    for row in calculations(json.loads(line)["answer"], settings["gsm8k_max_operand"]):
                        out.setdefault(row["question"], row["answer"])
        return out

    def row(question: str, answer: str) -> dict:
        return {
            "prompt": [{"role": "user", "content": template.format(prompt=question)}],
            "answer": answer,
            "key": question,
        }

    test, train = questions("test"), questions("train")
    pool = [q for q in train if q not in test]  # decontaminated: no holdout question is trained on
    val = [q for q in pool if split_of(q, 0.0, 0.25) == "val"][: settings["validation"]]
    return {
        "train": [row(q, train[q]) for q in pool if q not in set(val)],
        "val": [row(q, train[q]) for q in val],
        "holdout": [row(q, a) for q, a in list(test.items())[: settings["holdout"]]],
    }


def _task_config(task: str, overrides: Sequence[str]):
    from grpo_pipeline.configs.schema import load_config

    return load_config(CONFIGS[task], list(overrides))


# ---------------------------------------------------------------- what a kept run was made with

# The code a run's result depends on: the trainer's step and what it runs (generation, the rewards), the
# evaluation, the tasks' data. A change anywhere else (this file's report, the pipeline's flows) keeps the runs.
RUN_CODE = (
    "trainer/step.py",
    "trainer/cuts.py",
    "trainer/generation.py",
    "trainer/lm_head.py",
    "trainer/shared_prompt.py",
    "trainer/zero_advantage.py",
    "trainer/sampling.py",
    "trainer/loading.py",
    "trainer/rewards",
    "tasks/evaluate.py",
    "tasks/data/demo_task.py",
    "bench/gsm8k_calc.py",
)
RUNNER = 2  # how `train_run` and `base_run` make a record: raised when that changes what a record means


def code_hashes(paths: Sequence[str] = RUN_CODE, root: Path = ROOT) -> dict[str, str]:
    """Each source file of `paths` (files and folders under `root`) by a short hash of its bytes.

    >>> h = code_hashes(("bench/harness.py",)); list(h), len(h["bench/harness.py"])
    (['bench/harness.py'], 12)
    """
    import hashlib

    out = {}
    for entry in paths:
        path = root / entry
        files = sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts) if path.is_dir() else [path]
        for file in files:
            out[str(file.relative_to(root))] = hashlib.sha256(file.read_bytes()).hexdigest()[:12]
    return out


def differences(kept: Mapping, now: Mapping, prefix: str = "") -> list[str]:
    """What differs between the identity a run was kept with and this invocation's, one phrase per setting
    (nested settings by dotted name; a source file as changed, added or gone).

    >>> differences({"holdout": 1000, "config": {"lr": 1}, "code": {"a.py": "1"}},
    ...             {"holdout": 600, "config": {"lr": 1}, "code": {"a.py": "2", "b.py": "3"}})
    ['holdout 1000 (now 600)', 'code a.py changed', 'code b.py added']
    """
    out = []
    for key in dict.fromkeys([*kept, *now]):
        a, b = kept.get(key), now.get(key)
        name = f"{prefix}{key}"
        if a == b:
            continue
        if prefix.startswith("code"):
            out.append(f"{prefix.rstrip('.')} {key} " + ("added" if a is None else "gone" if b is None else "changed"))
        elif isinstance(a, Mapping) and isinstance(b, Mapping):
            out += differences(a, b, f"{name}.")
        else:
            out.append(f"{name} {json.dumps(a)} (now {json.dumps(b)})")
    return out


def next_rate_out(rates: Sequence[float], chosen: float) -> float | None:
    """The next rate beyond a grid's edge when the chosen rate lies on it (one grid step further, by the ratio of
    the two outermost rates on that side), else None: a best rate at an edge may be no best at all.

    >>> next_rate_out([1e-5, 3e-5, 1e-4], 1e-4), next_rate_out([1e-5, 3e-5, 1e-4], 1e-5)
    (0.000333, 3.33e-06)
    >>> next_rate_out([1e-5, 3e-5, 1e-4], 3e-5) is None, next_rate_out([1e-4], 1e-4)
    (True, None)
    """
    grid = sorted(set(rates))
    if len(grid) < 2 or grid[0] < chosen < grid[-1]:
        return None
    out = grid[-1] * grid[-1] / grid[-2] if chosen == grid[-1] else grid[0] * grid[0] / grid[1]
    return float(f"{out:.3g}")  # a rate as a person writes it: the record's name holds it


# ---------------------------------------------------------------- one run (in its own process)

# the step's cuts, each a train.* switch (grpo_pipeline.trainer.cuts.Cuts)
STEP_CUTS = ("prefill_once", "share_prompt_forward", "compact_lm_head", "skip_zero_advantage", "merged_generation")


def step_cuts(train_cfg, arm: str) -> tuple[Cuts, list[str]]:
    """The pipeline trainer's step cuts (`grpo_pipeline.trainer.step.StepTrainer` runs them) as the task config
    switches them, for one arm, and the names of those not switched off. Unset, a cut runs where it can apply, as in
    the trainer; generation from merged weights needs an adapter, so full fine-tuning goes without it. The curriculum
    and dynamic sampling change which prompts train, so they stay off: every arm sees the same prompts in order."""
    import torch

    switches = {name: getattr(train_cfg, name) for name in STEP_CUTS}
    if arm == "full":
        switches["merged_generation"] = False
    names = [name for name, value in switches.items() if value is not False]
    if not torch.cuda.is_available():
        names.append("no_gradient_checkpointing")
    return Cuts(**switches), names


def _evaluator(rows: list[dict], tokenizer, cfg, skill: str, batch: int):
    """Greedy scores of `rows`: per prompt, the weighted total and the skill reward, in the rows' order."""
    from grpo_pipeline.tasks.evaluate import generate, score
    from grpo_pipeline.trainer.rewards import completion_text

    max_new = cfg.evaluate.max_new_tokens

    def evaluate(model) -> dict[str, list[float]]:
        was_training = model.training
        model.eval()
        completions, lengths = generate(model, tokenizer, [r["prompt"] for r in rows], max_new, batch)
        model.train(was_training)
        texts = [completion_text(c) for c in completions]
        result = score(rows, texts, cfg.train.reward_set(), lengths, extra=(skill,), max_completion_length=max_new)
        return {"total": [round(r["total"], 4) for r in result.rows], "skill": [float(r[skill]) for r in result.rows]}

    return evaluate


def _mean(scores: Sequence[float]) -> float:
    return sum(scores) / len(scores)


def _curve_callback(evaluate, every: int, start: Mapping[str, list[float]]):
    """Validation every `every` steps off the training clocks (wall and CPU), and the stop at the plateau. The
    curve's step 0 is `start`, the base's validation scores (the same for every arm on that base: an adapter starts
    as the identity), scored once by `base_run`."""
    from transformers import TrainerCallback

    class Curve(TrainerCallback):
        def __init__(self):
            self.scores: list[Mapping[str, list[float]]] = [start]
            point = {"step": 0, "train_s": 0.0, "train_cpu_s": 0.0}
            self.curve: list[dict] = [point | {k: _mean(start[k]) for k in ("total", "skill")}]
            self.step_s: list[float] = []
            self.plateau_step: int | None = None
            self.eval_s = self.eval_cpu_s = 0.0

        def point(self, model, step: int) -> None:
            started, started_cpu = time.perf_counter(), time.process_time()
            scores = evaluate(model)
            self.scores.append(scores)
            self.curve.append(
                {
                    "step": step,
                    "train_s": round((started - self.t0) - self.eval_s, 2),
                    "train_cpu_s": round((started_cpu - self.t0_cpu) - self.eval_cpu_s, 2),
                    "total": _mean(scores["total"]),
                    "skill": _mean(scores["skill"]),
                }
            )
            self.eval_s += time.perf_counter() - started
            self.eval_cpu_s += time.process_time() - started_cpu
            p = self.curve[-1]
            print(
                f"  step {step:3d}  train {p['train_s']:7.1f} s ({p['train_cpu_s']:7.1f} CPU s)  validation total "
                f"{p['total']:.3f} skill {p['skill']:.3f}",
                flush=True,
            )

        def on_train_begin(self, args, state, control, **kw):
            self.t0, self.t0_cpu = time.perf_counter(), time.process_time()

        def on_step_begin(self, args, state, control, **kw):
            self.step_started = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.step_s.append(round(time.perf_counter() - self.step_started, 3))
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self.point(model, state.global_step)
                # the plateau rule on the total, the objective the run optimises (the skill is a part of it)
                if plateau([s["total"] for s in self.scores]) is not None:
                    self.plateau_step = state.global_step
                    control.should_training_stop = True

    return Curve()


def _load(settings: Mapping, task: str, quantization: str):
    """The task's config and data, and its base model (NF4 for QLoRA) with the settings' torch threads."""
    import torch

    from grpo_pipeline.tasks.evaluate import read_jsonl
    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.trainer.loading import load_model

    torch.set_num_threads(settings["threads"])  # before any torch work, as the trainer does
    cfg = _task_config(task, settings["overrides"])
    data = {s: read_jsonl(Path(settings["work"]) / task / f"{s}.jsonl") for s in ("train", "val", "holdout")}
    model, tokenizer = load_model(
        settings["model"], model_load(cfg.model.model_copy(update={"quantization": quantization}))
    )
    return cfg, data, model, tokenizer


def base_run(settings: Mapping, task: str, quantization: str) -> dict:
    """The base's greedy scores (fp32, or NF4 for QLoRA) on validation and the holdout: every run on that base
    starts its curve from them, and the NF4 base's holdout against the fp32 one's is what quantization alone costs."""
    started = time.perf_counter()
    cfg, data, model, tokenizer = _load(settings, task, quantization)
    skill, batch = skill_reward(task), settings["eval_batch"]
    return {
        "task": task,
        "kind": "base",
        "quantization": quantization,
        "validation": _evaluator(data["val"], tokenizer, cfg, skill, batch)(model),
        "holdout": _evaluator(data["holdout"], tokenizer, cfg, skill, batch)(model),
        "seconds": round(time.perf_counter() - started, 1),
    }


def train_run(settings: Mapping, task: str, arm: str, lr: float, seed: int, base: Mapping) -> dict:
    """One arm at one rate and seed, from its base's scores (`base_run`): trained to its plateau or the cap; its
    validation curve, its holdout scores at the end, step and evaluation times, memory."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback
    from trl import GRPOConfig

    from grpo_pipeline.trainer.loading import keep_adapter_fp32
    from grpo_pipeline.trainer.rewards import resolve_rewards
    from grpo_pipeline.trainer.step import StepTrainer

    started = time.perf_counter()
    quantization = base_of(arm)
    cfg, data, model, tokenizer = _load(settings, task, quantization)
    load_peak = peak_rss_mb()
    reset_peak_rss()  # from here on, the peak is training's own

    rewards, skill, batch = cfg.train.reward_set(), skill_reward(task), settings["eval_batch"]
    evaluate_holdout = _evaluator(data["holdout"], tokenizer, cfg, skill, batch)
    curve = _curve_callback(
        _evaluator(data["val"], tokenizer, cfg, skill, batch), settings["eval_every"], base["validation"]
    )
    cuts, cut_names = step_cuts(cfg.train, arm)
    grpo = dict(cfg.train.grpo) | {
        "max_steps": settings["max_steps"],
        "learning_rate": lr,
        "seed": seed,
        "logging_steps": 1,
        "bf16": False,  # fp32: the CPUs here compute bf16 natively only on one of their two kinds
        "report_to": [],
        "disable_tqdm": True,
    }
    if not torch.cuda.is_available():
        grpo["gradient_checkpointing"] = False  # as the trainer runs on a CPU node (trainer/train.py grpo_args)
    trainer = StepTrainer(
        model=model,
        cuts=cuts,
        reward_funcs=resolve_rewards(
            rewards.names, rewards.args, max_completion_length=grpo.get("max_completion_length")
        ),
        args=GRPOConfig(
            output_dir=str(Path(settings["work"]) / "hf" / f"{task}-{arm}-{lr:g}-{seed}"),
            save_strategy="no",
            reward_weights=list(rewards.weights),
            **grpo,
        ),
        train_dataset=Dataset.from_list(data["train"]),
        processing_class=tokenizer,
        peft_config=None if arm == "full" else LoraConfig(task_type="CAUSAL_LM", **cfg.train.lora),
        callbacks=[curve, keep_adapter_fp32(model)],  # as the trainer runs QLoRA (docs/training.md#qlora)
    )
    trainer.remove_callback(PrinterCallback)  # the curve prints one line per evaluation instead
    cpu_started = time.process_time()
    trainer.train()
    cpu_s = time.process_time() - cpu_started - curve.eval_cpu_s
    train_peak = peak_rss_mb()
    holdout_started = time.perf_counter()
    holdout = evaluate_holdout(trainer.model)
    holdout_s = time.perf_counter() - holdout_started
    params = list(trainer.model.parameters())
    seconds = time.perf_counter() - started
    return {
        "task": task,
        "arm": arm,
        "learning_rate": lr,
        "seed": seed,
        "quantization": quantization,
        "cuts": cut_names,
        "steps": trainer.state.global_step,
        "stopped": "plateau" if curve.plateau_step is not None else "cap",
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "total_params": sum(p.numel() for p in params),
        "adapter_dtypes": sorted({str(p.dtype) for p in params if p.requires_grad}),
        "curve": curve.curve,
        # the last evaluation's per-prompt scores, beside the base's (the run's first): did the run gain at all
        "validation": {"total": curve.curve[-1]["total"], "skill": curve.curve[-1]["skill"], "last": curve.scores[-1]},
        "holdout": holdout,
        "step_s": curve.step_s,
        "cpu_s": round(cpu_s, 1),
        "seconds": round(seconds, 1),
        # evaluation's share of the run: validation passes and the holdout, against the whole process
        "eval_share": round((curve.eval_s + holdout_s) / seconds, 3),
        "peak_rss_train_mb": round(train_peak),
        "peak_rss_load_mb": round(load_peak),
    }


def measure_savings(settings: Mapping) -> dict:
    """What LoRA saves on the demo model, measured: AdamW's state and the gradients after one real step (bytes of
    the tensors that exist), and the checkpoint each arm writes (a full model's safetensors against an adapter's)."""
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model

    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.trainer.loading import load_model

    cfg = _task_config("demo", settings["overrides"])
    out: dict = {}
    for arm in ("full", "lora"):
        model, tokenizer = load_model(settings["model"], model_load(cfg.model))
        if arm == "lora":
            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **cfg.train.lora))
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)
        batch = tokenizer(["What is 2 + 3? Reply with just the number. 5"] * 2, return_tensors="pt")
        model(**batch, labels=batch["input_ids"]).loss.backward()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None)
        optimizer.step()
        state = sum(
            t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        )
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)  # a PeftModel writes its adapter only
            checkpoint = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
        out[arm] = {
            "params": sum(p.numel() for p in model.parameters()),
            "trainable_params": sum(p.numel() for p in trainable),
            "optimizer_state_mb": state / 2**20,
            "gradients_mb": grads / 2**20,
            "checkpoint_mb": checkpoint / 2**20,
            "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        }
        del model, optimizer
    return out


def record_path(records: Path, key: str) -> Path:
    """Where a run's record is kept: one small JSON file per run, under the records folder by task.

    >>> [record_path(Path("r"), k).as_posix() for k in ("demo/full/3e-05/0", "demo/base/nf4", "savings")]
    ['r/demo/full-3e-05-s0.json', 'r/demo/base-nf4.json', 'r/savings.json']
    """
    parts = key.split("/")
    if parts == ["savings"]:
        return records / "savings.json"
    if parts[1] == "base":
        return records / parts[0] / f"base-{parts[2]}.json"
    task, arm, lr, seed = parts
    return records / task / f"{arm}-{lr}-s{seed}.json"


def _child(opts: argparse.Namespace) -> None:
    """One run of the parent's plan, its record written into the records folder as it ends (aside, then renamed:
    a run killed mid-way leaves no record, and the next invocation runs it again)."""
    settings = json.loads((Path(opts.work) / "settings.json").read_text())
    records, parts = Path(settings["records"]), opts.child.split("/")
    if parts == ["savings"]:
        task, result = "demo", measure_savings(settings)
    elif parts[1] == "base":
        task, result = parts[0], base_run(settings, parts[0], parts[2])
    else:
        task, arm, lr, seed = parts
        base = json.loads(record_path(records, f"{task}/base/{base_of(arm)}").read_text())
        result = train_run(settings, task, arm, float(lr), int(seed), base)
    path = record_path(records, opts.child)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result | {"identity": settings["identity"][task], **stamp()}))
    tmp.replace(path)


# ---------------------------------------------------------------- the comparison (pure, on the kept runs)


def summarise_task(
    runs: Sequence[Mapping],
    bases: Mapping[str, Mapping],
    arms: Sequence[str],
    seeds: Sequence[int],
    problems: Sequence[str],
    grids: Mapping[str, Mapping] | None = None,
) -> dict:
    """One task's comparison from its kept runs and its bases' scores (`base_run`, by quantization): each arm's
    rate chosen on validation at the first seed, its holdout scores at that rate over the seeds, the gaps to full
    (total and skill) with their intervals, time to 95 % of full's plateau, the verdict on the skill (only without
    `problems`, and for an arm run at fewer than `MIN_SEEDS` seeds none), the NF4 base against the fp32 one.
    `grids`: each swept arm's rates as tried, those added beyond the first grid's edge, and whether the chosen rate
    still lies on an edge."""
    import numpy as np

    out: dict = {"fair": not problems, "problems": list(problems), "arms": {}}
    at: dict[str, dict[int, Mapping]] = {}
    for arm in arms:
        sweep = [r for r in runs if r["arm"] == arm and r["seed"] == seeds[0]]
        if not sweep:
            continue
        rate = choose_rate(sweep)
        at[arm] = {r["seed"]: r for r in runs if r["arm"] == arm and r["learning_rate"] == rate}
        chosen = [at[arm][s] for s in seeds if s in at[arm]]
        base = bases.get(base_of(arm))
        out["arms"][arm] = {
            "learning_rate": rate,
            "grid": (grids or {}).get(arm),
            "validation_by_rate": {
                f"{r['learning_rate']:g}": {"total": r["validation"]["total"], "skill": r["validation"]["skill"]}
                for r in sorted(sweep, key=lambda r: r["learning_rate"])
            },
            "seeds": [r["seed"] for r in chosen],
            "holdout_total": float(np.mean([np.mean(r["holdout"]["total"]) for r in chosen])),
            "holdout_skill": float(np.mean([np.mean(r["holdout"]["skill"]) for r in chosen])),
            "per_seed": [
                {
                    "seed": r["seed"],
                    "steps": r["steps"],
                    "stopped": r["stopped"],
                    # a plateau at the level it started from: a rate that did not learn (the sweep's others may)
                    "gained_over_base": gained(base["validation"]["total"], r["validation"]["last"]["total"])
                    if base
                    else None,
                    "holdout_total": float(np.mean(r["holdout"]["total"])),
                    "holdout_skill": float(np.mean(r["holdout"]["skill"])),
                    "cpu_s": r["cpu_s"],
                    "minutes": r["seconds"] / 60,
                    "eval_share": r["eval_share"],
                }
                for r in chosen
            ],
            "trainable_params": chosen[0]["trainable_params"],
            "cuts": chosen[0]["cuts"],
        }
    if "full" not in at:
        return out
    full = at["full"]
    plateau_of = {key: float(np.mean([full[s]["validation"][key] for s in full])) for key in ("total", "skill")}
    for arm, by_seed in at.items():
        entry = out["arms"][arm]
        common = [s for s in seeds if s in by_seed and s in full]
        if arm != "full" and common:
            for key in ("total", "skill"):
                g = gap_interval(
                    [full[s]["holdout"][key] for s in common], [by_seed[s]["holdout"][key] for s in common]
                )
                g["resolves_3_vs_10"] = resolves(g["low_pct"], g["high_pct"])
                entry[f"gap_{key}"] = g
            if problems:
                entry["verdict"] = "not fair: " + "; ".join(problems)
            elif len(common) < MIN_SEEDS:
                entry["verdict"] = f"not judged: {len(common)} seed{'s' if len(common) != 1 else ''} (figures only)"
            else:
                entry["verdict"] = verdict(entry["gap_skill"]["low_pct"], entry["gap_skill"]["high_pct"])
        # time to 95 % of full's plateau, on the validation curves (the holdout is scored once, at the end)
        times = {}
        for key in ("total", "skill"):
            target = TARGET * plateau_of[key]
            start = float(np.mean([full[s]["curve"][0][key] for s in full]))
            if plateau_of[key] <= start:  # full gained nothing on this score: no quality to reach
                times[key] = {"target": target, "per_seed": [], "note": "full fine-tuning gained nothing"}
                continue
            hits = [time_to_target(by_seed[s]["curve"], target, key) for s in seeds if s in by_seed]
            reached = [h for h in hits if h]
            times[key] = {
                "target": target,
                "per_seed": hits,
                "reached": f"{len(reached)} of {len(hits)}",
                "step": float(np.median([h["step"] for h in reached])) if reached else None,
                "train_cpu_s": float(np.median([h["train_cpu_s"] for h in reached])) if reached else None,
            }
        entry["time_to_95"] = times
    summary = {
        q: {"total": float(np.mean(b["holdout"]["total"])), "skill": float(np.mean(b["holdout"]["skill"]))}
        for q, b in bases.items()
    }
    if {"none", "nf4"} <= set(bases):  # QLoRA's starting point apart from its training
        loss = {
            key: gap_interval([bases["none"]["holdout"][key]], [bases["nf4"]["holdout"][key]])
            for key in ("total", "skill")
        }
        out["nf4_base"] = {"fp32": summary["none"], "nf4": summary["nf4"], "loss": loss}
    out["bases"] = summary
    return out


def report_lines(summary: Mapping) -> list[str]:
    """The comparison as the terminal shows it: per task, each arm's plateau scores, gaps, time to 95 % and the
    verdict, or why there is none."""
    lines = []
    for task, t in summary["tasks"].items():
        if "skipped" in t:
            lines.append(f"[{NAME}] {task}: skipped: {t['skipped']}")
            continue
        skill = skill_reward(task)
        lines.append(
            f"[{NAME}] {task}: holdout {t['holdout']} prompts, validation {t['validation']} (the plateau sees a gain "
            f"of {t['plateau_sees']:.3f} between evaluations); skill reward {skill}"
            + ("" if t["fair"] else " -- NOT FAIR, no verdict: " + "; ".join(t["problems"]))
        )
        for arm, a in t["arms"].items():
            grid = a.get("grid") or {}
            how = "at LoRA's rate" if arm == "qlora" and not grid else "chosen on validation"
            if grid.get("added"):
                how += f", {', '.join(f'{x:g}' for x in grid['added'])} added beyond the grid's edge"
            if grid.get("at_edge"):
                how += ", still at its grid's edge"
            per = a["per_seed"]
            line = (
                f"[{NAME}]   {LABEL[arm]:12s} lr {a['learning_rate']:g} ({how}), seeds {a['seeds']}: "
                f"holdout total {a['holdout_total']:.3f}, {skill} {a['holdout_skill']:.3f}; steps "
                f"{[p['steps'] for p in per]} ({', '.join(p['stopped'] for p in per)}); "
                f"{sum(p['minutes'] for p in per) / len(per):.1f} min a run, evaluation "
                f"{sum(p['eval_share'] for p in per) / len(per):.0%} of it"
            )
            for key in ("total", "skill"):
                g = a.get(f"gap_{key}")
                if g and g["gap_pct"] is not None:
                    line += (
                        f"; gap {key} {g['gap_pct']:+.1f} % (95 % {g['low_pct']:+.1f} to {g['high_pct']:+.1f}"
                        f"{'' if g['resolves_3_vs_10'] else ', cannot tell 3 % from 10 %'})"
                    )
            hit = a.get("time_to_95", {}).get("skill", {})
            if hit.get("train_cpu_s") is not None:
                line += f"; 95 % of full's {skill} at step {hit['step']:g}, {hit['train_cpu_s']:.0f} CPU s ({hit['reached']})"
            lines.append(line)
            if "verdict" in a:
                lines.append(f"[{NAME}]   {LABEL[arm]} within 3 % of full on {skill}: {a['verdict']}")
        if "nf4_base" in t:
            n = t["nf4_base"]
            lines.append(
                f"[{NAME}]   bases before training: fp32 {skill} {n['fp32']['skill']:.3f}, NF4 {n['nf4']['skill']:.3f}"
            )
    if "savings" in summary:
        s = summary["savings"]
        lines.append(
            f"[{NAME}] LoRA saves on the demo model: optimizer state {s['full']['optimizer_state_mb']:.1f} -> "
            f"{s['lora']['optimizer_state_mb']:.1f} MiB, gradients {s['full']['gradients_mb']:.1f} -> "
            f"{s['lora']['gradients_mb']:.1f} MiB, checkpoint {s['full']['checkpoint_mb']:.1f} -> "
            f"{s['lora']['checkpoint_mb']:.1f} MiB"
        )
    return lines


def gap_row(benchmark: str, full: str, arm: str, gap: Mapping, note: str) -> Row:
    """A table row of an adapter's holdout gap to full fine-tuning in % against the claim's 3 %: `gap` holds
    `gap_pct` (None: not measurable) and its interval `low_pct`..`high_pct` (`gap_interval`, `quality_gap`)."""
    measurable = gap["gap_pct"] is not None
    return Row(
        benchmark,
        full,
        arm,
        gap["gap_pct"],
        "<= 3",
        unit="%",
        spread=(gap["low_pct"], gap["high_pct"]) if measurable else None,
        note=note,
    )


def fair_rows(result: Mapping) -> list[Row]:
    """The table's rows of the fair comparison: per task and adapter arm, the skill gap (the verdict's figure), and
    the CPU time to 95 % of full's plateau skill against full's own."""
    rows = []
    for task, t in result["tasks"].items():
        if "skipped" in t or "full" not in t["arms"]:
            continue
        skill, full = skill_reward(task), t["arms"]["full"]
        fair = "" if t["fair"] else " (not fair: see the JSON's problems)"
        for arm, a in t["arms"].items():
            if arm == "full" or "gap_skill" not in a:
                continue
            rows.append(
                gap_row(
                    f"{LABEL[arm]} vs full, {task}: holdout {skill} at the plateau, {len(a['seeds'])} "
                    f"seed{'s' if len(a['seeds']) != 1 else ''}, "
                    + (
                        "at LoRA's rate"
                        if arm == "qlora" and "lora" in t["arms"]
                        else "each at its best rate on validation"
                    )
                    + f", gap % (`bench.lora_vs_full`){fair}",
                    f"full (lr {full['learning_rate']:g}): {full['holdout_skill']:.3f}",
                    f"{LABEL[arm]} (lr {a['learning_rate']:g}): {a['holdout_skill']:.3f}",
                    a["gap_skill"],
                    note=a["verdict"] if t["fair"] else "not fair",
                )
            )
            mine, theirs = a["time_to_95"]["skill"], full["time_to_95"]["skill"]
            if mine.get("train_cpu_s") and theirs.get("train_cpu_s"):
                rows.append(
                    Row(
                        f"{LABEL[arm]} vs full, {task}: CPU time to 95 % of full's plateau {skill}, speedup{fair}",
                        f"full: {theirs['train_cpu_s']:.0f} CPU s (step {theirs['step']:g})",
                        f"{LABEL[arm]}: {mine['train_cpu_s']:.0f} CPU s (step {mine['step']:g})",
                        theirs["train_cpu_s"] / mine["train_cpu_s"],
                        ">= 3",
                    )
                )
    return rows


def table_rows(load) -> list[Row]:
    """The fair comparison's rows, once it has run."""
    fair = load(NAME)
    if fair is None:
        return [
            Row(
                "LoRA and QLoRA vs full, on the skill (`bench.lora_vs_full`)",
                "full",
                "LoRA",
                None,
                "<= 3",
                note="not run yet",
                unit="%",
            )
        ]
    return fair_rows(fair)


# ---------------------------------------------------------------- driver


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="demo", help="comma-separated subset of demo,gsm8k")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of full,lora,qlora (with full)")
    parser.add_argument(
        "--full-rates", default="1e-5,3e-5,1e-4", help="full fine-tuning's learning rates (its best is chosen)"
    )
    parser.add_argument(
        "--adapter-rates",
        default="1e-4,3e-4,1e-3",
        help="LoRA's (~10x full's: the usual rule); QLoRA's too when LoRA is not an arm",
    )
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (data order and sampling); rates at the first")
    parser.add_argument(
        "--qlora-seeds", type=int, default=1, help="QLoRA runs at LoRA's chosen rate at this many of the seeds"
    )
    parser.add_argument(
        "--max-extensions",
        type=int,
        default=1,
        help="rates added beyond a grid's edge when the chosen rate lies on it, per arm",
    )
    parser.add_argument("--max-steps", type=int, default=MIN_CAP, help="the cap of a run that has not plateaued")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=16,
        help="steps between validation evaluations: at 16, evaluation stays under half a run's time on a CPU",
    )
    parser.add_argument("--validation", type=int, default=300, help="validation prompts (the plateau and the rate)")
    parser.add_argument(
        "--holdout",
        type=int,
        default=600,
        help="holdout prompts per task, at most what it has (fair: "
        + ", ".join(f"{t} >= {min_holdout(t)}" for t in TASKS)
        + ")",
    )
    parser.add_argument(
        "--demo-max-operand",
        type=int,
        default=60,
        help="the demo's operands are 0..this: 60 gives 1,108 distinct holdout questions (the demo config's 20: 130)",
    )
    parser.add_argument(
        "--gsm8k-max-operand",
        type=int,
        default=50,
        help="GSM8K calculator questions with operands up to this: 50 gives 910 distinct test questions (20: 465)",
    )
    parser.add_argument("--gsm8k", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k", help="GSM8K's folder")
    parser.add_argument("--eval-batch", type=int, default=64, help="prompts per greedy evaluation batch")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="task-config override for both tasks, repeatable"
    )
    parser.add_argument("--side-by-side", type=int, default=2, help="runs at a time, each in its own process")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per run (2 side by side at 1 each on 2 cores)"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="where each run's record is kept (default bench/results/lora_vs_full)",
    )
    parser.add_argument("--work", type=Path, default=None, help="the data and logs (default .grpo/bench-lora-vs-full)")
    parser.add_argument("--fresh", action="store_true", help="forget the kept records of these tasks, measure again")
    parser.add_argument("--report-only", action="store_true", help="summarise the kept records; run nothing")
    parser.add_argument("--no-savings", action="store_true", help="skip the memory and checkpoint measurement")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model, 2 steps: the chain in seconds")
    parser.add_argument(
        "--child", help=argparse.SUPPRESS
    )  # internal: one run, task/arm/rate/seed, task/base/q, savings
    opts = parser.parse_args(argv)
    if opts.tiny:  # small everything, unless given
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, value in (("--max-steps", 2), ("--eval-every", 1), ("--validation", 8), ("--holdout", 8)):
            if not any(g == flag or g.startswith(flag + "=") for g in given):
                setattr(opts, flag[2:].replace("-", "_"), value)
    return opts


def _settings(opts: argparse.Namespace, tasks: list[str]) -> dict:
    """The invocation's settings, as the children read them (`settings.json`)."""
    return {
        "tasks": tasks,
        "max_steps": opts.max_steps,
        "eval_every": opts.eval_every,
        "validation": opts.validation,
        "holdout": opts.holdout,
        "demo_max_operand": opts.demo_max_operand,
        "gsm8k_max_operand": opts.gsm8k_max_operand,
        "eval_batch": opts.eval_batch,
        "threads": opts.threads,
        "overrides": list(opts.overrides),
        "tiny": opts.tiny,
    }


def identity(settings: Mapping, task: str, data: Path) -> dict:
    """What a task's runs mean, kept in each record: the settings that change a result, the task config's training
    settings as resolved (not its file: a comment changes nothing), the data's bytes and the step's code
    (`RUN_CODE`). A kept record whose identity differs is refused, naming the difference (`differences`)."""
    import hashlib

    cfg = _task_config(task, settings["overrides"])
    per_run = ("max_steps", "learning_rate", "seed", "logging_steps", "report_to", "disable_tqdm", "output_dir")
    rewards = cfg.train.reward_set()
    resolved = {
        "grpo": {k: v for k, v in dict(cfg.train.grpo).items() if k not in per_run},
        "lora": dict(cfg.train.lora),
        "rewards": {"names": rewards.names, "weights": rewards.weights, "args": rewards.args},
        "cuts": {name: getattr(cfg.train, name) for name in STEP_CUTS},
        "max_new_tokens": cfg.evaluate.max_new_tokens,
    }
    digest = hashlib.sha256()
    for split in ("train", "val", "holdout"):
        digest.update((data / f"{split}.jsonl").read_bytes())
    return json.loads(
        json.dumps(
            {
                "runner": RUNNER,
                "model": Path(settings["model"]).name,
                "threads": settings["threads"],
                **{k: settings[k] for k in ("max_steps", "eval_every", "validation", "holdout", "eval_batch")},
                "max_operand": settings[f"{task}_max_operand"],
                "config": resolved,
                "data": digest.hexdigest()[:16],
                "code": code_hashes(),
            },
            default=str,
        )
    )


def _bad_input(message: str) -> SystemExit:
    print(f"[{NAME}] {message}", file=sys.stderr)
    return SystemExit(2)


class RunFailed(Exception):
    """A child run exited non-zero; the records before it are kept."""


def main(argv: list[str] | None = None) -> dict | None:
    opts = options(argv)
    if opts.child:
        _child(opts)
        return None
    arms = [a for a in opts.arms.split(",") if a]
    tasks = [t for t in opts.tasks.split(",") if t]
    if not set(arms) <= set(ARMS) or "full" not in arms or len(arms) < 2:
        raise _bad_input(f"--arms {opts.arms!r}: give full (the baseline) and lora and/or qlora")
    if not set(tasks) <= set(TASKS) or not tasks:
        raise _bad_input(f"--tasks {opts.tasks!r}: give demo and/or gsm8k")
    # QLoRA follows LoRA: it runs at LoRA's chosen rate (what quantization costs at the same settings); without a
    # LoRA arm it is swept on its own
    follows = "qlora" in arms and "lora" in arms
    swept = [a for a in arms if not (a == "qlora" and follows)]
    rates = {arm: _floats(opts.full_rates if arm == "full" else opts.adapter_rates) for arm in swept}
    seeds = [int(x) for x in opts.seeds.split(",") if x.strip()]
    if not seeds or any(not r or min(r) <= 0 for r in rates.values()):
        raise _bad_input("--seeds and each rate list need at least one value, rates above 0")
    if opts.eval_every < 1 or opts.max_steps < opts.eval_every:
        raise _bad_input(f"--eval-every {opts.eval_every} must be at least 1 and at most --max-steps {opts.max_steps}")
    if opts.side_by_side < 1 or opts.threads < 1 or opts.qlora_seeds < 0 or opts.max_extensions < 0:
        raise _bad_input("--side-by-side and --threads must be at least 1, --qlora-seeds and --max-extensions >= 0")
    for override in opts.overrides:  # an override either task config refuses is bad input before anything runs
        for task in tasks:
            try:
                _task_config(task, [override])
            except Exception as exc:  # the config's own error names the field
                raise _bad_input(f"--set {override}: {exc}") from None

    from bench.harness import RESULTS
    from grpo_pipeline.tasks.evaluate import read_jsonl, write_jsonl

    suffix = "-tiny" if opts.tiny else ""
    work = (opts.work or ROOT / ".grpo" / f"bench-lora-vs-full{suffix}").resolve()
    records = (opts.results or RESULTS / f"lora_vs_full{suffix.replace('-', '_')}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    settings = _settings(opts, tasks) | {"work": str(work), "records": str(records)}
    if opts.tiny:
        from tests.tiny_model import create_random_model

        settings["model"] = str(create_random_model(work / "tiny").resolve())
    else:
        from grpo_pipeline.tasks.model import ensure_demo_model

        demo = _task_config("demo", opts.overrides)
        settings["model"] = str(ensure_demo_model(ROOT / demo.data_dir / "models").resolve())

    # each task's data (rebuilt every time: it follows from the settings), then its identity
    available = []
    settings["identity"] = {}
    for task in tasks:
        if task == "gsm8k" and not (opts.gsm8k / "test.jsonl").is_file():
            print(
                f"[{NAME}] gsm8k: skipped: {opts.gsm8k} has no GSM8K (train.jsonl, test.jsonl); pass --gsm8k DIR, "
                "or --tasks demo",
                flush=True,
            )
            continue
        folder = work / task
        folder.mkdir(exist_ok=True)
        try:
            rows = task_rows(task, settings, opts.gsm8k)
        except ValueError as exc:  # e.g. more demo questions asked than the operand range has
            raise _bad_input(f"{task}: {exc}") from None
        for split, split_rows in rows.items():
            write_jsonl(folder / f"{split}.jsonl", split_rows)
        settings["identity"][task] = identity(settings, task, folder)
        available.append(task)
    # kept records of other settings are refused before any work, naming what differs
    for task in available:
        for path in sorted((records / task).glob("*.json")):
            if opts.fresh:
                path.unlink()
                continue
            try:
                kept_identity = json.loads(path.read_text()).get("identity", {})
            except (OSError, ValueError):
                continue  # unreadable: measured again when the plan reaches it
            if diff := differences(kept_identity, settings["identity"][task]):
                raise _bad_input(
                    f"{path} was measured with other settings: {'; '.join(diff)}. Its runs cannot be compared with "
                    "new ones: pass --fresh to measure them again (the kept records are replaced), or --results DIR "
                    "to keep both."
                )
    (work / "settings.json").write_text(json.dumps(settings, indent=1))
    started = time.monotonic()

    def kept(key: str) -> dict | None:
        path = record_path(records, key)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"[{NAME}] {path}: unreadable ({exc}); measured again", flush=True)
            return None

    def child(key: str) -> dict | None:
        """One run in its own process (its memory and CPU time its own), its record kept as soon as it ends."""
        if (record := kept(key)) is not None or opts.report_only:
            return record
        log = work / "logs" / (key.replace("/", "_") + ".log")
        print(f"[{NAME}] {key}: started (log {log})", flush=True)
        # Waiting OpenMP threads sleep instead of spinning: spinning burns CPU seconds that are not work, and
        # the arms are compared on CPU seconds. One thread per run: two side by side on two cores.
        threads = str(opts.threads)
        env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        cmd = [sys.executable, "-m", "bench.lora_vs_full", "--child", key, "--work", str(work)]
        with open(log, "w") as out:
            code = subprocess.run(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
        if code != 0:
            tail = log.read_text(errors="replace")[-1500:]
            raise RunFailed(f"the run {key} exited {code} (its log: {log}); the records before it are kept:\n{tail}")
        record = kept(key)
        done = f"{record['seconds'] / 60:.1f} min" if record and "seconds" in record else "done"
        print(f"[{NAME}] {key}: {done}", flush=True)
        return record

    grids: dict[str, dict[str, dict]] = {task: {} for task in available}

    def arm_plan(task: str, arm: str) -> None:
        """An arm's rate sweep at the first seed (one grid step further where the chosen rate lies on an edge), its
        further seeds at the chosen rate, and QLoRA at LoRA's chosen rate after LoRA."""
        tried = list(rates[arm])
        sweep = [r for r in (child(f"{task}/{arm}/{lr:g}/{seeds[0]}") for lr in tried) if r]
        for _ in range(opts.max_extensions):
            out = next_rate_out(tried, choose_rate(sweep)) if sweep else None
            if out is None:
                break
            tried.append(out)
            if (record := child(f"{task}/{arm}/{tried[-1]:g}/{seeds[0]}")) is not None:
                sweep.append(record)
        if not sweep:
            return
        chosen = choose_rate(sweep)
        grids[task][arm] = {
            "rates": sorted(tried),
            "added": tried[len(rates[arm]) :],
            "at_edge": next_rate_out(tried, chosen) is not None,
        }
        for seed in seeds[1:]:
            child(f"{task}/{arm}/{chosen:g}/{seed}")
        if arm == "lora" and follows:
            for seed in seeds[: opts.qlora_seeds]:
                child(f"{task}/qlora/{chosen:g}/{seed}")

    from concurrent.futures import ThreadPoolExecutor

    failures: list[str] = []

    def side_by_side(jobs) -> None:
        with ThreadPoolExecutor(opts.side_by_side) as pool:  # a failed run is named at the end; the others go on
            for future in [pool.submit(fn, *args) for fn, *args in jobs]:
                try:
                    future.result()
                except RunFailed as exc:
                    failures.append(str(exc))

    quantizations = ["none"] + (["nf4"] if "qlora" in arms else [])
    planned = sum(len(rates[a]) + len(seeds) - 1 for a in swept) + (min(opts.qlora_seeds, len(seeds)) if follows else 0)
    done = [r for t in available for r in (records / t).glob("*-s*.json")]
    minutes = [json.loads(p.read_text()).get("seconds", 0) / 60 for p in done]
    left = max(0, planned * len(available) - len(done))
    print(
        f"[{NAME}] plan: {planned * len(available)} runs (and the bases), {len(done)} kept"
        + (
            f", about {left * sum(minutes) / len(minutes) / opts.side_by_side:.0f} min left at {opts.side_by_side} "
            f"side by side (the kept runs took {sum(minutes) / len(minutes):.1f} min each)"
            if minutes and not opts.report_only
            else ""
        ),
        flush=True,
    )
    savings = None if opts.no_savings or not available else child("savings")
    side_by_side([(child, f"{task}/base/{q}") for task in available for q in quantizations])
    if not failures:
        side_by_side([(arm_plan, task, arm) for task in available for arm in swept])

    summary: dict = {"tasks": {}}
    for task in tasks:
        if task not in available:
            summary["tasks"][task] = {"skipped": f"{opts.gsm8k} has no GSM8K"}
            continue
        runs = [json.loads(p.read_text()) for p in sorted((records / task).glob("*-s*.json"))]
        runs = [r for r in runs if r["arm"] in arms and r["seed"] in seeds]
        bases = {q: b for q in quantizations if (b := kept(f"{task}/base/{q}"))}
        tried = {a: grids[task].get(a, {}).get("rates", rates[a]) for a in swept}
        problems = fairness_problems(
            {a: tried[a] for a in swept if a != "qlora"} or tried,
            seeds,
            len(read_jsonl(work / task / "holdout.jsonl")),
            opts.max_steps,
            min_holdout(task),
        )
        missing = [
            f"{a} seed {s}" for a in swept for s in seeds if not any(r["arm"] == a and r["seed"] == s for r in runs)
        ]
        if missing:
            problems.append(f"runs not made yet: {', '.join(missing)}")
        summary["tasks"][task] = summarise_task(runs, bases, arms, seeds, problems, grids[task]) | {
            "validation": opts.validation,
            "holdout": opts.holdout,
            "plateau_sees": detectable_gain(opts.validation),
        }
    if savings:
        summary["savings"] = {k: v for k, v in savings.items() if k in ("full", "lora")}

    result = {
        "name": NAME,
        "settings": {k: v for k, v in settings.items() if k not in ("work", "records", "identity", "model")},
        "rates": rates,
        "seeds": seeds,
        "arms": arms,
        "min_holdout": {t: min_holdout(t) for t in tasks},
        "max_steps": opts.max_steps,
        **summary,
        "failures": failures,
        "seconds": time.monotonic() - started,
        **stamp(),
    }
    save(NAME + ("_tiny" if opts.tiny else ""), result)
    for line in report_lines(result):
        print(line, flush=True)
    if failures:
        print(f"[{NAME}] " + "\n".join(failures), file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
