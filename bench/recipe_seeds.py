"""Does a recipe improve the skill, not only the format, on every seed and on tasks nobody tuned it for?

One module: the tasks, the per-prompt reading of each run and the goals' verdicts are one benchmark's parts, and
`bench.table` reads its rows from here.

The recipe (`--recipe`, default `configs/demo-cpu.yaml`: its GRPO and LoRA settings, publishing, health rules) runs
unchanged through the whole pipeline (`grpo-pipeline run --json`) at several seeds (`train.grpo.seed`: the LoRA
init, the prompt order, the sampling; not the data split, so every seed scores on the same holdout) on:

- `demo`: the demo task as the recipe ships it (the recipe was tuned on it), 5 seeds;
- `gsm8k`: GSM8K's calculator annotations (`bench.gsm8k_calc`'s slice of ../shared/data/gsm8k, its config's data,
  rewards and evaluation) with the recipe's `train` section laid over `configs/gsm8k-calc-cpu.yaml`'s; skipped,
  saying so, when that data is absent;
- `subtract`: "What is a - b?" for 0 <= b <= a <= 40;
- `compare`: "Which is the largest of 47, 83, 12 and 65?", four distinct two-digit numbers;
- `sequence`: "What number comes next in the sequence 3, 7, 11, 15?", an arithmetic sequence;

the last three written here as JSONL `data.source` files the recipe never saw and scored by its own rewards; 3 seeds
each. `--set KEY=VALUE` (repeatable) lays a change over the recipe for every task: a candidate recipe is the shipped
one plus its `--set`s, or a YAML of its own through `--recipe`.

Each task names its skill reward once (`Task.skill`: what says the task was done right, `correct_answer` or GSM8K's
`math_answer`) and its format reward (`Task.format`: shaping, `number_only`; none for GSM8K). Per task and seed the
report gives each one's holdout mean, base -> trained, with the paired 95 % interval of its gain over the holdout
prompts (the gate's own paired bootstrap, on the run's per-prompt evaluation tables), the steps and the minutes; then
the goals: **the skill's gain has its interval above zero on every seed of every task**, and **the demo's accuracy
reaches 50 % on every seed**, with the run time the recipe took beside them. The gate's decision (`promote.metric`,
the weighted total by default) is kept per seed as the pipeline made it, and so are the earlier goals on it (every
seed promoted, the worst seed's gain at least 0.6x the median's).

    python -m bench.recipe_seeds                                    # 5 tasks, 5 + 4 x 3 seeds (hours on 2 cores)
    python -m bench.recipe_seeds --tasks demo                       # the demo alone, its 5 seeds
    python -m bench.recipe_seeds --set train.grpo.max_steps=80 --work .grpo/bench-recipe_seeds-80   # a candidate
    python -m bench.recipe_seeds --tiny                             # a tiny random model, 2 steps: the chain runs

Resumable: each finished run is kept in the work folder (`--work`, default .grpo/bench-recipe_seeds/) with the
fingerprint of the recipe, its `--set`s and the code that ran it (the trainer, tasks, configs, flows and the
benchmark's modules); a folder holding runs of another recipe or code version is refused (exit 2), never mixed:
pass --fresh to start it over, or another --work.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.harness import (
    ROOT,
    MixedWorkFolder,
    add_threads_option,
    add_work_options,
    keep_runs,
    open_work,
    pipeline_run,
    prune_weights,
    save,
    torch_threads,
)
from bench.harness import fingerprint as harness_fingerprint
from bench.table import Row

NAME = "recipe_seeds"
WORK = ROOT / ".grpo" / f"bench-{NAME}"
RECIPE = ROOT / "configs" / "demo-cpu.yaml"
SEEDS = (0, 1, 2, 3, 4)  # the demo's
UNTUNED_SEEDS = (0, 1, 2)  # each task the recipe was not tuned on
WORST_TO_MEDIAN = 0.6  # goal: the worst seed's gain is at least this share of the median seed's
DEMO_ACCURACY = 0.5  # goal: the demo's trained accuracy on every seed
MIN_SEEDS_FOR_INTERVAL = 3  # an interval over fewer seeds says nothing a reader can use
CONFIDENCE = 0.95
CODE = (
    "trainer",
    "tasks",
    "configs",
    "flows",
    "grpo_pipeline",
    "bench/recipe_seeds.py",
    "bench/gsm8k_calc.py",
    "bench/harness.py",
)
SUBTRACT_MAX = 40
DATA_SEED = 0  # the generated tasks' one draw of rows: every seed and every recipe scores the same holdout
REPLY = " Reply with just the number."


def subtraction_rows(max_operand: int) -> list[dict]:
    """Every "a - b" with 0 <= b <= a <= max_operand, one row each (the data stage splits them by a hash).

    >>> rows = subtraction_rows(3); len(rows), rows[-1]
    (10, {'question': '3 - 3', 'answer': '0'})
    """
    return [{"question": f"{a} - {b}", "answer": str(a - b)} for a in range(max_operand + 1) for b in range(a + 1)]


def largest_rows(n: int, seed: int = DATA_SEED) -> list[dict]:
    """n distinct lists of four distinct two-digit numbers and the largest of each: a comparison, not a sum. The
    largest sits at each of the four places equally often (a model that always picks one place is right a quarter
    of the time at most).

    >>> rows = largest_rows(1600)
    >>> rows[0], len({r["question"] for r in rows}) == len(rows) == 1600
    ({'question': '63, 59, 15 and 43', 'answer': '63'}, True)
    >>> [sum(r["question"].replace(" and", ",").split(", ").index(r["answer"]) == i for r in rows) for i in range(4)]
    [400, 400, 400, 400]
    >>> largest_rows(5) == largest_rows(1600)[:5]  # one draw: the tiny mode's rows are the full task's first
    True
    """
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        numbers = rng.sample(range(10, 100), 4)
        top = max(numbers)
        place = len(rows) % 4  # the largest's place, in turn
        numbers.remove(top)
        numbers.insert(place, top)
        question = f"{numbers[0]}, {numbers[1]}, {numbers[2]} and {numbers[3]}"
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": str(top)})
    return rows


def sequence_rows(n: int, seed: int = DATA_SEED) -> list[dict]:
    """n distinct arithmetic sequences of four terms (start 1-99, step 2-15) and the term that comes next: a rule
    read off the examples, then applied.

    >>> rows = sequence_rows(1200)
    >>> rows[0], len({r["question"] for r in rows}) == len(rows) == 1200
    ({'question': '13, 28, 43, 58', 'answer': '73'}, True)
    >>> all(int(r["answer"]) - int(r["question"].split(", ")[-1]) == int(r["question"].split(", ")[1]) - int(r["question"].split(", ")[0]) for r in rows)
    True
    >>> sequence_rows(2000)
    Traceback (most recent call last):
    ...
    ValueError: 2000 sequences asked; there are 1386 distinct ones
    """
    pairs = [(start, step) for start in range(1, 100) for step in range(2, 16)]
    if n > len(pairs):
        raise ValueError(f"{n} sequences asked; there are {len(pairs)} distinct ones")
    random.Random(seed).shuffle(pairs)  # one order: the tiny mode's rows are the full task's first
    return [{"question": ", ".join(str(a + i * d) for i in range(4)), "answer": str(a + 4 * d)} for a, d in pairs[:n]]


@dataclass(frozen=True)
class Generated:
    """A task this module writes as a JSONL `data.source`, scored by the recipe's own rewards."""

    rows: Callable[[bool], list[dict]]  # tiny -> the rows (a handful in the tiny mode)
    template: str  # data.prompt_template around each row's question
    holdout_share: float  # of the distinct rows (split by the question): 250-280 holdout prompts in the full mode


@dataclass(frozen=True)
class Task:
    name: str
    what: str
    seeds: tuple[int, ...]
    # The reward that says the task was done right: its gain is what the goals judge. The one place a task names it.
    skill: str
    format: str | None  # the shaping reward reported beside it; None: the task's rewards have none
    config: Path | None = None  # the task's own config (its data, rewards, evaluation) laid under the recipe's train
    generated: Generated | None = None  # else: the recipe's own data (the demo) or the task's config's


TASKS = {
    "demo": Task("demo", "a + b, the task the recipe was tuned on", SEEDS, "correct_answer", "number_only"),
    "gsm8k": Task(
        "gsm8k",
        "GSM8K calculator annotations (untuned)",
        UNTUNED_SEEDS,
        "math_answer",
        None,  # its config scores the answer alone: the "a op b =" scratchpad is how a 135M model gets it right
        config=ROOT / "configs" / "gsm8k-calc-cpu.yaml",
    ),
    "subtract": Task(
        "subtract",
        f"a - b with 0 <= b <= a <= {SUBTRACT_MAX} (untuned)",
        UNTUNED_SEEDS,
        "correct_answer",
        "number_only",
        generated=Generated(
            lambda tiny: subtraction_rows(8 if tiny else SUBTRACT_MAX),
            "What is {prompt}?" + REPLY,
            0.28,  # 255 of the 861 questions in the holdout
        ),
    ),
    "compare": Task(
        "compare",
        "the largest of four two-digit numbers (untuned)",
        UNTUNED_SEEDS,
        "correct_answer",
        "number_only",
        generated=Generated(
            lambda tiny: largest_rows(40 if tiny else 1600),
            "Which is the largest of {prompt}?" + REPLY,
            0.15,  # 279 of the 1600 lists
        ),
    ),
    "sequence": Task(
        "sequence",
        "the next term of an arithmetic sequence (untuned)",
        UNTUNED_SEEDS,
        "correct_answer",
        "number_only",
        generated=Generated(
            lambda tiny: sequence_rows(40 if tiny else 1386),
            "What number comes next in the sequence {prompt}?" + REPLY,
            0.18,  # 254 of the 1386 sequences
        ),
    ),
}


def recipe_sets(recipe: dict) -> list[str]:
    """The recipe's `train` section as `--set` overrides, for laying it over another task's config; the rewards
    stay the task's own (they say what a right answer is there, not how to train).

    >>> recipe_sets({"train": {"rewards": ["x"], "grpo": {"learning_rate": 3e-4}, "lora": {"r": 16}, "checkpoint_every": 10}})
    ['train.checkpoint_every=10', 'train.grpo.learning_rate=0.0003', 'train.lora.r=16']
    """

    def leaves(prefix: str, value: object) -> list[str]:
        if isinstance(value, dict):
            return [leaf for k in sorted(value) for leaf in leaves(f"{prefix}.{k}", value[k])]
        return [f"{prefix}={json.dumps(value) if not isinstance(value, str) else value}"]

    train = {k: v for k, v in (recipe.get("train") or {}).items() if k != "rewards"}
    return leaves("train", train)


def task_sets(task: Task, recipe: dict, work: Path, tiny: bool) -> list[str]:
    """The overrides that put `task`'s data under the recipe (the demo needs none: it is the recipe's own); a
    generated task's rows are written into `work` (aside, then renamed: never half a file)."""
    if task.config is not None:  # GSM8K: its own config, the recipe's training laid over it
        from bench.gsm8k_calc import GSM8K, OUT, prepare

        paths = prepare(GSM8K, OUT)  # FileNotFoundError when the data is absent: the task is skipped
        return [f"data.source={paths['train']}", f"data.eval_sources=[{paths['test']}]", *recipe_sets(recipe)]
    if task.generated is None:
        return []
    source = work / f"{task.name}.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    tmp = source.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in task.generated.rows(tiny)))
    tmp.replace(source)
    return [
        f"data.source={source}",
        "data.prompt_column=question",
        "data.answer_column=answer",
        "data.key_column=question",  # the split by the question itself: its holdout is known before a run
        f"data.prompt_template={task.generated.template}",
        f"data.holdout_share={task.generated.holdout_share}",
        "data.val_share=0.05",
    ]


def tiny_sets(work: Path) -> list[str]:
    """A tiny random model of SmolLM2's architecture and 2 steps: the chain, not the figures."""
    from tests.tiny_model import create_random_model

    model = work / "tiny-model"
    if not (model / "config.json").is_file():
        create_random_model(model)
    return [
        f"model.base={model}",
        "train.grpo.max_steps=2",
        "train.checkpoint_every=1",
        "data.demo.n_train=32",
        "data.demo.n_holdout=8",
        "promote.min_samples=1",
    ]


def fingerprint(recipe_text: str, tiny: bool, root: Path = ROOT, sets: tuple[str, ...] | list[str] = ()) -> str:
    """What the runs in a work folder were made with: the recipe's text and the `--set`s laid over it, every source
    file of the code that trains, evaluates and decides (a changed file is another code version), and the mode.

    >>> a, b = fingerprint("train: {}", False), fingerprint("train: {grpo: {seed: 1}}", False)
    >>> a == fingerprint("train: {}", False), a == b, a == fingerprint("train: {}", True)
    (True, False, False)
    >>> a == fingerprint("train: {}", False, sets=["train.grpo.max_steps=80"])
    False
    """
    return harness_fingerprint(json.dumps({"recipe": recipe_text, "tiny": tiny, "sets": list(sets)}), CODE, root)


def check_sets(task: Task, recipe: Path, sets: list[str]) -> None:
    """Refuse, before any run, a task whose configuration does not load (a malformed or unknown `--set`), or whose
    skill or format reward its evaluation does not score: the figures the goals judge would be missing.

    Raises `grpo_pipeline.configs.schema.ConfigError` naming the task, the reward and what is scored."""
    from grpo_pipeline.configs.schema import ConfigError, load_config
    from grpo_pipeline.tasks.evaluate import score_columns

    try:
        cfg = load_config(task.config or recipe, sets)
    except ConfigError as exc:
        raise ConfigError(f"task {task.name}: {exc}") from None
    scored = score_columns(cfg.train.reward_set(), cfg.evaluate)
    for role, reward in (("skill", task.skill), ("format", task.format)):
        if reward and reward not in scored:
            raise ConfigError(
                f"task {task.name}: its {role} reward {reward!r} is not scored on the holdout (the evaluation scores "
                f"{', '.join(c for c in scored if c not in ('total', 'length'))}); add it to train.rewards or set "
                f"evaluate.{'accuracy' if role == 'skill' else 'format'}_reward={reward}"
            )


def evaluation_rows(summary: dict, dst: Path) -> tuple[list[dict], list[dict]]:
    """The per-prompt scores of the base and of the trained model on the holdout, as the run logged them (the
    `base_samples.json` and `candidate_samples.json` tables of its evaluate stages in MLflow), downloaded into dst."""
    from mlflow import MlflowClient

    ref = summary["mlflow"]
    client = MlflowClient(ref["tracking_uri"])
    tables = []
    for stage, table in (("evaluate-base", "base_samples.json"), ("evaluate-candidate", "candidate_samples.json")):
        found = client.search_runs(
            [ref["experiment_id"]],
            f"tags.mlflow.parentRunId = '{ref['run_id']}' and attributes.run_name = '{stage}'",
            max_results=1,
        )
        if not found:
            raise RuntimeError(f"run {ref['run_id']} has no {stage} stage run: its per-prompt scores are missing")
        path = Path(client.download_artifacts(found[0].info.run_id, table, str(dst)))
        logged = json.loads(path.read_text())
        tables.append([dict(zip(logged["columns"], row, strict=True)) for row in logged["data"]])
    return tables[0], tables[1]


def reward_figures(base: list[dict], trained: list[dict], reward: str) -> dict:
    """One reward's holdout mean, base -> trained, and the paired 95 % interval of its gain over the prompts (the
    gate's own paired bootstrap, `grpo_pipeline.tasks.promote.decide.paired_difference`).

    >>> base = [{"key": k, "acc": float(k < 2)} for k in range(10)]
    >>> trained = [{"key": k, "acc": float(k < 8)} for k in range(10)]
    >>> f = reward_figures(base, trained, "acc")
    >>> f["base"], f["trained"], round(f["gain"], 3), f["n"], f["ci_low"] > 0
    (0.2, 0.8, 0.6, 10, True)
    >>> reward_figures(base, trained, "number_only")
    Traceback (most recent call last):
    ...
    KeyError: "the holdout's scores have no 'number_only' column (they have: key, acc)"
    """
    from grpo_pipeline.tasks.promote.decide import paired_difference, paired_rows

    if base and reward not in base[0]:
        raise KeyError(f"the holdout's scores have no {reward!r} column (they have: {', '.join(base[0])})")
    cand, ref = paired_rows(trained, base)
    stats = paired_difference([r[reward] for r in cand], [r[reward] for r in ref], CONFIDENCE)
    return {
        "base": stats["mean_baseline"],
        "trained": stats["mean_candidate"],
        "gain": stats["mean_diff"],
        "ci_low": stats["ci_low"],
        "ci_high": stats["ci_high"],
        "n": stats["n"],
    }


def skill_and_format(summary: dict, task: Task) -> dict:
    """The task's skill and format rewards on the holdout (`reward_figures` of each; None for a task without a
    format reward), from the run's per-prompt tables: the summary's `holdout` holds each reward's means, not the
    gain's interval. Its means are checked against the tables', so the tables are this run's. The one place that
    reads a run's skill: a summary that carries the skill's base, trained, gain and interval itself is read here."""
    with tempfile.TemporaryDirectory() as dst:
        base, trained = evaluation_rows(summary, Path(dst))
    out: dict[str, dict | None] = {}
    for role, reward in (("skill", task.skill), ("format", task.format)):
        if reward is None:
            out[role] = None
            continue
        figures = reward_figures(base, trained, reward)
        logged = (summary.get("holdout") or {}).get("trained", {}).get(reward)
        if logged is not None and abs(logged - figures["trained"]) > 1e-6:
            raise RuntimeError(
                f"{reward}: the run's summary says {logged} on the holdout, its per-prompt table {figures['trained']}"
            )
        out[role] = {"reward": reward, **figures}
    return out


def measure(summary: dict, seconds: float, task: Task) -> dict:
    """One run's figures: the task's skill and format rewards (`skill_and_format`), the gate's decision on its metric
    (the weighted total by default) as the pipeline made it, the steps and the time."""
    decision = summary["decision"]
    metric = next(k for k in decision["stats"] if k != "guardrails")
    stats = decision["stats"][metric]
    train = summary["train"]
    return {
        **skill_and_format(summary, task),
        "metric": metric,
        "base": stats["mean_baseline"],
        "trained": stats["mean_candidate"],
        "gain": stats["mean_diff"],
        "ci_low": stats["ci_low"],
        "ci_high": stats["ci_high"],
        "n": stats["n"],
        "promoted": bool(decision["promote"]),
        "reasons": decision["reasons"],
        "steps": train["global_step"],
        "best_step": train.get("best_step"),
        "health": [f"{e['rule']}@{e['step']}: {e.get('taken') or e['action']}" for e in train.get("health") or []],
        "train_runtime_s": round(train["train_runtime_s"], 1),
        "wall_s": round(seconds, 1),
    }


def reward_over_seeds(by_seed: dict[int, dict], role: str) -> dict | None:
    """One reward (`skill` or `format`) over a task's seeds: the base, each seed's trained mean and its gain's
    interval, the mean gain, and how many seeds have their interval above zero. None where no seed has it (a task
    without a format reward, or runs kept by an earlier version of this module)."""
    runs = {s: r[role] for s, r in by_seed.items() if r.get(role)}
    if not runs:
        return None
    seeds = sorted(runs)
    return {
        "reward": runs[seeds[0]]["reward"],
        "base": statistics.mean(runs[s]["base"] for s in seeds),  # one holdout, one base model: one value
        "trained": {s: runs[s]["trained"] for s in seeds},
        "gain_ci": {s: [runs[s]["ci_low"], runs[s]["ci_high"]] for s in seeds},
        "mean_trained": statistics.mean(runs[s]["trained"] for s in seeds),
        "mean_gain": statistics.mean(runs[s]["gain"] for s in seeds),
        "seeds_above_zero": sum(runs[s]["ci_low"] > 0 for s in seeds),
        "seeds": len(seeds),
    }


def summarize(by_seed: dict[int, dict], task: str = "") -> dict:
    """A task's seeds: each seed's figures; the skill and the format apart (`reward_over_seeds`); on the gate's
    metric the mean, worst and best seed and the mean gain's interval over seeds; the time; the goals.

    >>> runs = {s: {"trained": t, "base": 0.1, "gain": t - 0.1, "ci_low": t - 0.3, "promoted": True, "wall_s": 600,
    ...             "steps": 40, "skill": {"reward": "correct_answer", "base": 0.075, "trained": a, "gain": a - 0.075,
    ...                                    "ci_low": a - 0.2, "ci_high": a + 0.05}}
    ...         for s, (t, a) in enumerate([(1.2, 0.6), (1.1, 0.5), (0.9, 0.1)])}
    >>> s = summarize(runs, "demo")
    >>> round(s["mean_trained"], 3), s["worst"]["seed"], s["best"]["seed"], round(s["worst_to_median"], 3)
    (1.067, 2, 0, 0.8)
    >>> s["skill"]["seeds_above_zero"], s["minutes"]
    (2, {'mean': 10.0, 'max': 10.0, 'total': 30.0})
    >>> s["goals"]
    {'skill_gain_every_seed': False, 'demo_accuracy_50': False, 'every_seed_promoted': True, 'worst_to_median': True}
    >>> summarize({0: runs[0], 1: runs[1]})["gain_interval"]
    'an interval over 2 seeds is not printed (3 needed)'
    >>> summarize({})
    Traceback (most recent call last):
    ...
    ValueError: no seed has finished: nothing to summarize
    """
    if not by_seed:
        raise ValueError("no seed has finished: nothing to summarize")
    from scipy import stats

    seeds = sorted(by_seed)
    gains = [by_seed[s]["gain"] for s in seeds]
    ranked = sorted(seeds, key=lambda s: by_seed[s]["gain"])
    median = statistics.median(gains)
    worst, best = ranked[0], ranked[-1]
    if len(seeds) >= MIN_SEEDS_FOR_INTERVAL:
        low, high = stats.t.interval(0.95, len(gains) - 1, loc=statistics.mean(gains), scale=stats.sem(gains))
        interval: list[float] | str = [float(low), float(high)]
    else:
        interval = f"an interval over {len(seeds)} seed{'s' if len(seeds) > 1 else ''} is not printed ({MIN_SEEDS_FOR_INTERVAL} needed)"
    ratio = by_seed[worst]["gain"] / median if median > 0 else None
    skill = reward_over_seeds(by_seed, "skill")
    walls = [by_seed[s]["wall_s"] / 60 for s in seeds if "wall_s" in by_seed[s]]
    goals: dict[str, bool | None] = {
        # the skill's gain beyond noise on every seed; None: runs kept without per-prompt skill scores
        "skill_gain_every_seed": skill["seeds_above_zero"] == len(seeds)
        if skill and skill["seeds"] == len(seeds)
        else None
    }
    if task == "demo":
        goals["demo_accuracy_50"] = (
            all(t >= DEMO_ACCURACY for t in skill["trained"].values())
            if skill and skill["seeds"] == len(seeds)
            else None
        )
    goals |= {
        "every_seed_promoted": all(by_seed[s]["promoted"] and by_seed[s]["ci_low"] > 0 for s in seeds),
        # a median gain of zero or less has no share to reach: the goal is not met
        "worst_to_median": ratio is not None and ratio >= WORST_TO_MEDIAN
        if len(seeds) >= MIN_SEEDS_FOR_INTERVAL
        else None,  # one or two seeds say nothing of the spread: not judged
    }
    return {
        "seeds": seeds,
        "per_seed": {s: by_seed[s] for s in seeds},
        "skill": skill,
        "format": reward_over_seeds(by_seed, "format"),
        "steps": [by_seed[s].get("steps") for s in seeds],
        "minutes": {"mean": statistics.mean(walls), "max": max(walls), "total": sum(walls)} if walls else None,
        "mean_trained": statistics.mean(by_seed[s]["trained"] for s in seeds),
        "mean_gain": statistics.mean(gains),
        "median_gain": median,
        "gain_interval": interval,
        "worst": {"seed": worst, **by_seed[worst]},
        "best": {"seed": best, **by_seed[best]},
        "worst_to_median": ratio,
        "goals": goals,
    }


def verdicts(tasks: dict[str, dict]) -> dict:
    """The goals over every task: the skill's gain beyond noise on every seed of every task (None until every task has
    run on its seeds: a task skipped or short of seeds leaves it unjudged), the demo's accuracy, and the time spent.

    >>> done = {"goals": {"skill_gain_every_seed": True}, "seeds": [0, 1, 2], "minutes": {"total": 30.0, "max": 11.0}}
    >>> tasks = {n: done for n in ("gsm8k", "subtract", "compare", "sequence")}
    >>> demo = {"goals": {"skill_gain_every_seed": True, "demo_accuracy_50": False}, "seeds": [0, 1, 2, 3, 4],
    ...         "minutes": {"total": 45.0, "max": 9.5}}
    >>> v = verdicts(tasks | {"demo": demo})
    >>> v["skill_gain_every_seed_of_every_task"], v["demo_accuracy_50"], v["minutes"], v["longest_run_minutes"]
    (True, False, 165.0, 11.0)
    >>> v = verdicts(tasks | {"demo": demo | {"seeds": [0, 1]}}); v["skill_gain_every_seed_of_every_task"], v["short"]
    (None, {'demo': 'ran 2 of 5 seeds'})
    >>> verdicts({"demo": demo})["missing"]
    ['gsm8k', 'subtract', 'compare', 'sequence']
    """
    missing = [name for name in TASKS if name not in tasks]
    short = {
        name: f"ran {len(t['seeds'])} of {len(TASKS[name].seeds)} seeds"
        for name, t in tasks.items()
        if len(t["seeds"]) < len(TASKS[name].seeds)
    }
    judged = [t["goals"]["skill_gain_every_seed"] for t in tasks.values()]
    every = False if False in judged else None if missing or short or None in judged else True
    minutes = [t["minutes"] for t in tasks.values() if t.get("minutes")]
    return {
        "skill_gain_every_seed_of_every_task": every,
        "demo_accuracy_50": tasks["demo"]["goals"].get("demo_accuracy_50") if "demo" in tasks else None,
        "missing": missing,
        "short": short,
        "minutes": sum(m["total"] for m in minutes) if minutes else None,
        "longest_run_minutes": max(m["max"] for m in minutes) if minutes else None,
    }


def _judged(ok: bool | None) -> str:
    return "met" if ok else "not judged" if ok is None else "missed"


def _reward_row(bench: str, task: str, s: dict, role: str) -> Row:
    """A task's skill (accuracy) or format row: the base, each seed's trained mean, each seed's gain with its 95 %
    interval, and for the skill the goals' verdicts and the run time beside them."""
    r = s[role]
    per = ", ".join(
        f"seed {seed} {r['trained'][seed] - r['base']:+.3f} ({low:+.3f} to {high:+.3f})"
        for seed, (low, high) in r["gain_ci"].items()
    )
    n = r["seeds"]
    note = f"gain (95% CI) {per}; interval above 0 on {r['seeds_above_zero']}/{n} seeds"
    if role == "skill":
        note += f": goal {_judged(s['goals']['skill_gain_every_seed'])}"
        if "demo_accuracy_50" in s["goals"]:
            reached = sum(t >= DEMO_ACCURACY for t in r["trained"].values())
            note += f"; accuracy >= {DEMO_ACCURACY:.0%} on {reached}/{n} seeds: goal {_judged(s['goals']['demo_accuracy_50'])}"
        if s.get("minutes"):
            steps = sorted({st for st in s["steps"] if st is not None})
            note += (
                f"; {'/'.join(map(str, steps))} steps, {s['minutes']['mean']:.1f} min a run "
                f"(longest {s['minutes']['max']:.1f})"
            )
    else:
        note += " (shaping: reported beside the skill, not a goal)"
    kind = "accuracy" if role == "skill" else "format"
    return Row(
        f"{bench}, {task}: {TASKS[task].what if task in TASKS else task}, {n} seed{'s' if n > 1 else ''}: "
        f"{kind} ({r['reward']})",
        f"base: {r['base']:.3f}",
        "trained: " + ", ".join(f"{t:.3f}" for t in r["trained"].values()),
        r["mean_gain"],
        "",
        note=note,
        unit="",
    )


def _total_row(bench: str, task: str, s: dict) -> Row:
    """The gate's metric over seeds, for results saved before the skill and the format were measured apart."""
    per = s["per_seed"]
    trained = ", ".join(f"{per[k]['trained']:.3f}" for k in sorted(per))
    interval = s["gain_interval"]
    spread = f"95% CI {interval[0]:+.3f} to {interval[1]:+.3f}" if isinstance(interval, list) else interval
    met = [goal for goal, ok in s["goals"].items() if ok]
    unjudged = [goal for goal, ok in s["goals"].items() if ok is None]
    return Row(
        f"{bench}, {task}: {TASKS[task].what if task in TASKS else task}, {len(per)} seed{'s' if len(per) > 1 else ''}",
        f"base: {s['worst']['base']:.3f}",
        f"trained: {trained}",
        s["mean_gain"],
        "> 0 on every seed",
        note=f"mean gain {s['mean_gain']:+.3f} ({spread}); worst seed {s['worst']['seed']} "
        f"{s['worst']['gain']:+.3f}, best {s['best']['seed']} {s['best']['gain']:+.3f}; goals met: "
        f"{', '.join(met) or 'none'}"
        + (f"; not judged on so few seeds: {', '.join(unjudged)}" if unjudged else "")
        + ("; total reward: skill and format not measured apart" if not s.get("skill") else ""),
        unit="",
    )


def table_rows(load) -> list[Row]:
    """Per task, its accuracy (the skill reward) and its format apart, each base -> trained over the seeds with the
    per-seed intervals and the goals' verdicts; a result saved before they were measured apart keeps its one row
    on the gate's metric."""
    r = load(NAME)
    bench = "a recipe over seeds, holdout base -> trained (`bench.recipe_seeds`)"
    if r is None:
        return [Row(bench, "base", "trained", None, "", note="not run yet")]
    rows = []
    for task, saved in r["tasks"].items():
        s = summarize(
            {int(seed): run for seed, run in saved["per_seed"].items()}, task
        )  # the goals as this code reads them
        if not s["skill"]:
            rows.append(_total_row(bench, task, s))
            continue
        rows += [_reward_row(bench, task, s, "skill")]
        rows += [_reward_row(bench, task, s, "format")] if s["format"] else []
    return rows or [Row(bench, "base", "trained", None, "", note="no task finished")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        help="train.grpo.seed of each run, for every task (default: 5 on the demo, 3 on the others)",
    )
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe's YAML (default: %(default)s)")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pipeline override laid over the recipe for every task (repeatable): a candidate recipe",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny random model, 2 steps: the chain, not the gain")
    add_work_options(parser, WORK)
    add_threads_option(parser)
    opts = parser.parse_args(argv)
    from grpo_pipeline.configs.schema import ConfigError

    if not opts.recipe.is_file():
        print(f"[{NAME}] --recipe {opts.recipe}: no such file; pass a pipeline YAML such as {RECIPE}", file=sys.stderr)
        return 2
    recipe_text = opts.recipe.read_text()
    try:
        recipe = yaml.safe_load(recipe_text) or {}
    except yaml.YAMLError as exc:
        print(f"[{NAME}] --recipe {opts.recipe} is not valid YAML: {exc}", file=sys.stderr)
        return 2
    work = opts.work / "tiny" if opts.tiny else opts.work
    try:
        state = open_work(work, fingerprint(recipe_text, opts.tiny, sets=opts.sets), opts.fresh)
    except MixedWorkFolder as exc:
        print(f"[{NAME}] {exc}", file=sys.stderr)
        return 2
    plans: dict[str, list[str]] = {}  # each task's overrides, all checked before the first run
    for name in opts.tasks:
        task = TASKS[name]
        try:
            sets = task_sets(task, recipe, work, opts.tiny)
        except FileNotFoundError as exc:
            print(f"[{NAME}] {name} skipped: {exc}", flush=True)
            continue
        sets += [*(tiny_sets(work) if opts.tiny else []), *opts.sets]
        try:
            check_sets(task, opts.recipe, sets)
        except ConfigError as exc:
            print(f"[{NAME}] {exc}", file=sys.stderr)
            return 2
        plans[name] = sets
    threads = torch_threads(opts.threads)
    for name, sets in plans.items():
        task = TASKS[name]
        for seed in opts.seeds or task.seeds:
            key = f"{name}/{seed}"
            if key in state["runs"]:
                print(f"[{NAME}] {key}: kept from an earlier run", flush=True)
                continue
            started = time.monotonic()
            # the recipe trains each task whatever the task check says (a benchmark measures what training does)
            run_sets = ["check.on_too_hard=warn", *sets, f"train.grpo.seed={seed}"]
            summary, seconds = pipeline_run(
                work / f"{name}-{seed}", run_sets, threads, config=task.config or opts.recipe
            )
            state["runs"][key] = measure(summary, seconds, task) | {"overrides": run_sets, "threads": threads}
            keep_runs(work / "runs.json", state)
            prune_weights(work / f"{name}-{seed}")  # measured: the records stay, the weights would fill the disk
            print(f"[{NAME}] {key}: {json.dumps(state['runs'][key])} ({(time.monotonic() - started) / 60:.1f} min)")
    tasks = {}
    for name in TASKS:
        by_seed = {int(k.split("/")[1]): v for k, v in state["runs"].items() if k.split("/")[0] == name}
        if by_seed:
            tasks[name] = summarize(by_seed, name)
    report = {
        "name": NAME,
        "tiny": opts.tiny,
        "recipe": str(opts.recipe),
        "sets": opts.sets,
        "fingerprint": state["fingerprint"],
        "tasks": tasks,
        "goals": verdicts(tasks),
    }
    save(f"{NAME}_tiny" if opts.tiny else NAME, report | {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    for row in table_rows(lambda _name: report):
        print(f"[{NAME}] {row.benchmark}: {row.baseline} | {row.candidate} | {row.note}", flush=True)
    goals = report["goals"]
    print(
        f"[{NAME}] skill gain above zero on every seed of every task: {_judged(goals['skill_gain_every_seed_of_every_task'])}"
        + (f" (not run: {', '.join(goals['missing'])})" if goals["missing"] else "")
        + (f" ({'; '.join(f'{k} {v}' for k, v in goals['short'].items())})" if goals["short"] else "")
        + f"; demo accuracy >= {DEMO_ACCURACY:.0%} on every seed: {_judged(goals['demo_accuracy_50'])}"
        + (
            f"; {goals['minutes']:.0f} min of runs, the longest {goals['longest_run_minutes']:.1f}"
            if goals["minutes"]
            else ""
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
