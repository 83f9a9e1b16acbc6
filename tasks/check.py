"""Can GRPO learn this task? Measured on the base model before anyone pays for training.

GRPO learns only from a group whose completions score apart: a prompt whose `num_generations` samples are all right
or all wrong has zero advantage everywhere and moves nothing. So the check samples the base as training will (the
recipe's `num_generations`, `temperature` and `max_completion_length`, seeded) on a few validation prompts, scores
each sample with the skill reward (`RewardSet.skill`) and reads:

- the base's accuracy (the mean skill over all samples) with a 95 % interval clustered by prompt;
- the share of prompts whose group is mixed (a right and a wrong answer): the prompts GRPO can learn from;
- how long the right answers were against `max_completion_length`, and the share of samples cut at the cap;
- the format reading: the share of wrong samples whose text still holds the reference answer (right, but not in a
  form the skill reward reads);
- the sampling throughput, and from it an estimate of the training's time.

`verdict` turns those into `learnable`, `too_hard`, `already_solved` or `format_first`, with the reason and the
fixes; `grpo-pipeline task check` prints it, and a run (`check.*`) refuses a `too_hard` task before training.

    check = check_task.fn(version, model_path, cfg.model, cfg.train.reward_set(), cfg.train, cfg.check, cache_dir)
    check.verdict, check.accuracy, check.mixed_fraction

Pure functions first (`pick_prompts`, `read_samples`, `verdict`, `estimate_training`, `cache_key`), the model's part
in `run_check`, and the Prefect task at the bottom. A result is cached on disk, keyed by everything it depends on.

One module, the stage's: its value (`TaskCheck`), its readings and verdict, its cache and its sampling are one
measurement's parts, each read by the others, as `tasks/evaluate.py` holds the evaluation's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from prefect import task
from pydantic import BaseModel, ValidationError
from scipy import stats

from grpo_pipeline.configs.library_fields import grpo_value
from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.tasks.evaluate import last_user_message, read_jsonl

if TYPE_CHECKING:
    from grpo_pipeline.configs.check import CheckConfig
    from grpo_pipeline.configs.rewards import RewardSet
    from grpo_pipeline.configs.schema import ModelConfig, TrainConfig
    from grpo_pipeline.tasks.data.versions import DatasetVersion

log = logging.getLogger(__name__)

Verdict = Literal["learnable", "too_hard", "already_solved", "format_first"]

CONFIDENCE = 0.95

# already_solved: the base is right this often on sampled answers, so training can add at most the rest; and few
# groups are mixed, so even dynamic sampling finds little to learn from. A base at 90 % with many mixed groups still
# has prompts it gets only sometimes right: that is learnable (GRPO sharpens exactly those).
ALREADY_SOLVED_ACCURACY = 0.9
ALREADY_SOLVED_MIXED = 0.25

# format_first: at least half of the wrong samples hold the reference answer in their text. Then most of what the
# skill reward calls wrong is a right answer in a form it does not read, and GRPO would spend its first steps
# learning that form (or, with no mixed groups, nothing at all): fix the reading or ask for the form first.
FORMAT_FIRST_SHARE = 0.5

# The training step's time over its generation's, on the shipped step (the cuts on: prefill once, merged-weight
# generation, compact LM head, shared prompt forward), fp32, 2 threads: 5.864 s a step of which 2.976 s generation
# (the candidate arm's medians, `groups` and `wall` in bench/results/step_profile_ab_all_fp32_avx2.json). The rest is
# the log-probability forward with grad (1.31 s), the backward (1.31 s) and the optimizer: so a step costs about
# twice its generation. tests/unit/test_task_check.py reads the file and checks the figure.
STEP_PROFILE = "bench/results/step_profile_ab_all_fp32_avx2.json"
STEP_OVER_GENERATION = 1.97


class TrainEstimate(BaseModel):
    """The training's time on this machine, from the check's own sampling (`estimate_training` says how)."""

    seconds: float  # steps x step_seconds
    steps: int  # train.grpo.max_steps, or the epochs' steps when it is unset
    step_seconds: float
    groups_per_step: float  # prompts a step trains on: per_device_train_batch_size x accumulation / num_generations
    oversample: float  # train.dynamic_sampling.oversample when enabled, else 1
    step_over_generation: float = STEP_OVER_GENERATION
    source: str = STEP_PROFILE  # where step_over_generation was measured
    how: str


class TaskCheck(BaseModel):
    """What `grpo-pipeline task check --json` prints and `RunSummary.task_check` holds."""

    verdict: Verdict
    reason: str  # the figures that decided it
    fixes: list[str] = []  # what to change, for every verdict but learnable
    skill: str  # the skill reward's name (`RewardSet.skill`)
    # the data stage's version: its fingerprint, rows kept, quarantined by reason, split sizes
    fingerprint: str
    rows_kept: int
    quarantined: dict[str, int]
    splits: dict[str, int]
    # what was sampled
    model_path: str
    prompts: int
    prompts_from_val: int
    prompts_from_train: int  # > 0: val had fewer rows than check.prompts, topped up from train (`note` says so)
    note: str | None = None
    num_generations: int
    temperature: float
    max_completion_length: int
    seed: int
    samples: int  # prompts x num_generations
    # what was measured (intervals: 95 %, clustered by prompt)
    accuracy: float  # mean skill score over every sample
    accuracy_ci: tuple[float, float]
    mixed_fraction: float  # prompts whose group holds a right (skill > 0) and a wrong (skill == 0) answer
    mixed_ci: tuple[float, float]
    mixed_prompts: int
    all_right_prompts: int
    all_wrong_prompts: int
    right_length_median: float | None  # tokens the right answers took; None: no right answer
    right_length_max: int | None
    cut_share: float  # samples that ran to max_completion_length
    wrong_samples: int
    format_share: float | None  # wrong samples whose text holds the reference answer; None: no reference to look for
    # what it cost, and what training would
    load_seconds: float
    generation_seconds: float
    samples_per_second: float
    tokens_per_second: float
    estimate: TrainEstimate
    seconds: float  # the check's wall time, loading included (when it ran; a cached result keeps its own)
    cached: bool = False  # read from the cache under data_dir, not measured again

    def line(self) -> str:
        """The verdict line a run and the command print."""
        return f"task check: {self.verdict}: {self.reason}"

    def metrics(self) -> dict[str, float]:
        """The figures as MLflow metrics (the verdict is a tag)."""
        figures = {
            "accuracy": self.accuracy,
            "accuracy_ci_low": self.accuracy_ci[0],
            "accuracy_ci_high": self.accuracy_ci[1],
            "mixed_fraction": self.mixed_fraction,
            "mixed_ci_low": self.mixed_ci[0],
            "mixed_ci_high": self.mixed_ci[1],
            "cut_share": self.cut_share,
            "format_share": self.format_share,
            "right_length_median": self.right_length_median,
            "right_length_max": self.right_length_max,
            "samples_per_second": self.samples_per_second,
            "tokens_per_second": self.tokens_per_second,
            "estimated_train_seconds": self.estimate.seconds,
            "check_seconds": self.seconds,
            "prompts": self.prompts,
        }
        return {f"task_check/{k}": float(v) for k, v in figures.items() if v is not None}


# ------------------------------------------------------------------------------------------------ pure functions


def pick_prompts(val: list[dict], train: list[dict], n: int, seed: int) -> tuple[list[dict], int, str | None]:
    """The first `n` val rows, topped up with a seeded draw of train rows when val holds fewer; the rows, how many
    came from train, and a note saying so (None when val sufficed).

    >>> rows, topped, note = pick_prompts([{"key": "v"}], [{"key": f"t{i}"} for i in range(5)], 3, seed=0)
    >>> [r["key"] for r in rows][0], len(rows), topped
    ('v', 3, 2)
    >>> note
    'val holds 1 row, fewer than check.prompts=3: topped up with 2 train rows'
    >>> pick_prompts([{"key": "v"}] * 4, [], 3, seed=0)[1:]
    (0, None)
    """
    picked = val[:n]
    need = min(n - len(picked), len(train))
    if need <= 0:
        return picked, 0, None
    extra = [train[i] for i in sorted(random.Random(seed).sample(range(len(train)), need))]
    rows = "row" if len(val) == 1 else "rows"
    return (
        picked + extra,
        need,
        f"val holds {len(val)} {rows}, fewer than check.prompts={n}: topped up with {need} train rows",
    )


def _normal(text: str) -> str:
    return " ".join(text.casefold().split())


def holds_reference(completion: str, reference: Any, prompt: str = "") -> bool:
    """Whether a completion's text holds the reference answer (case and spacing aside, as a whole word). Where the
    prompt holds the reference too (a label the question lists), an echo proves nothing: the completion must end
    with it then.

    >>> holds_reference("The sum is 17.", "17"), holds_reference("3 + 14 = 18", "17"), holds_reference("170", "17")
    (True, False, False)
    >>> holds_reference("Is it positive or negative? Negative", "positive", "Positive or negative?")
    False
    >>> holds_reference("The sentiment is **Positive**.", "positive", "Positive or negative?")
    True
    """
    if isinstance(reference, bool) or not isinstance(reference, str | int | float):
        return False  # a structured reference (JSON fields, tests) is read by its reward, not found in text
    ref = _normal(str(reference)).strip(" .")
    if not ref:
        return False
    word = rf"(?<!\w){re.escape(ref)}(?!\w)"
    text = _normal(completion)
    if not re.search(word, text):
        return False
    if re.search(word, _normal(prompt)):
        return re.search(word + r"[\W_]*$", text) is not None
    return True


def proportion_interval(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson's interval on k of n (scipy).

    >>> [round(x, 3) for x in proportion_interval(0, 16)]
    [0.0, 0.194]
    """
    if n == 0:
        return 0.0, 1.0
    ci = stats.binomtest(k, n).proportion_ci(confidence, method="wilson")
    return float(ci.low), float(ci.high)


def clustered_interval(prompt_means: list[float], confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """The interval of the mean over prompts, each prompt one cluster of samples: a percentile bootstrap over the
    prompts (scipy). Where every prompt scored alike at 0 or 1 a bootstrap collapses to the point, so Wilson's
    interval on the prompts counted as trials gives how far that could be chance.

    >>> clustered_interval([0.0] * 16) == proportion_interval(0, 16)
    True
    >>> low, high = clustered_interval([0.0, 0.25, 0.5, 0.75, 1.0] * 4)
    >>> 0.3 < low < 0.5 < high < 0.7
    True
    """
    values = np.asarray(prompt_means, dtype=float)
    n = len(values)
    if n == 0:
        return 0.0, 1.0
    if np.all(values == values[0]):
        if values[0] in (0.0, 1.0):
            return proportion_interval(int(values[0]) * n, n, confidence)
        return float(values[0]), float(values[0])
    res = stats.bootstrap(
        (values,),
        np.mean,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
        n_resamples=4999,
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def read_samples(
    skill: list[list[float]], lengths: list[list[int]], holds: list[list[bool | None]], cap: int, seed: int = 0
) -> dict[str, Any]:
    """The measured figures from each prompt's group: skill scores, lengths in tokens, and whether each sample holds
    the reference (None: no reference to look for). A sample is right when its skill score is above 0.

    >>> r = read_samples([[1.0, 0.0], [0.0, 0.0]], [[3, 16], [16, 5]], [[None, True], [False, False]], cap=16)
    >>> r["accuracy"], r["mixed_fraction"], r["mixed_prompts"], r["all_wrong_prompts"], r["cut_share"]
    (0.25, 0.5, 1, 1, 0.5)
    >>> r["right_length_median"], r["right_length_max"], r["wrong_samples"], round(r["format_share"], 3)
    (3.0, 3, 3, 0.333)
    """
    means = [statistics.fmean(group) for group in skill]
    right = [[s > 0 for s in group] for group in skill]
    mixed = sum(any(g) and not all(g) for g in right)
    n = len(skill)
    right_lengths = [n_tok for g, ls in zip(right, lengths, strict=True) for r, n_tok in zip(g, ls, strict=True) if r]
    flat = [n_tok for ls in lengths for n_tok in ls]
    wrong_holds = [
        h for g, hs in zip(right, holds, strict=True) for r, h in zip(g, hs, strict=True) if not r and h is not None
    ]
    samples = sum(len(g) for g in skill)
    return {
        "accuracy": statistics.fmean(s for group in skill for s in group) if samples else 0.0,
        "accuracy_ci": clustered_interval(means, seed=seed),
        "mixed_fraction": mixed / n if n else 0.0,
        "mixed_ci": proportion_interval(mixed, n),
        "mixed_prompts": mixed,
        "all_right_prompts": sum(all(g) for g in right),
        "all_wrong_prompts": sum(not any(g) for g in right),
        "right_length_median": float(statistics.median(right_lengths)) if right_lengths else None,
        "right_length_max": max(right_lengths) if right_lengths else None,
        "cut_share": sum(n_tok >= cap for n_tok in flat) / len(flat) if flat else 0.0,
        "wrong_samples": sum(not r for g in right for r in g),
        "format_share": statistics.fmean(wrong_holds) if wrong_holds else None,
        "samples": samples,
    }


TOO_HARD_FIXES = [
    "a larger or stronger base model (model.base, or model.candidates to choose among several)",
    "an easier curriculum: start on easier rows (train.curriculum), or a simpler version of the task",
    "a hint in the prompt (data.prompt_template): the form of the answer, a worked example",
]
ALREADY_SOLVED_FIXES = [
    "harder rows: the base already answers these",
    "a stricter skill reward, if right here is not what the task needs",
]
FORMAT_FIRST_FIXES = [
    "a skill reward that reads the answer in the form the base writes it (grpo-pipeline rewards lists them)",
    "ask for the form in the prompt (data.prompt_template), e.g. 'Reply with just the answer.'",
]


def verdict(accuracy: float, mixed_fraction: float, format_share: float | None) -> tuple[Verdict, str, list[str]]:
    """The verdict on the measured figures, the reason, and the fixes. In order: already_solved (accuracy at least
    ALREADY_SOLVED_ACCURACY and at most ALREADY_SOLVED_MIXED of the groups mixed), format_first (at least
    FORMAT_FIRST_SHARE of the wrong samples hold the reference), too_hard (no mixed group), else learnable.

    >>> verdict(0.42, 0.69, 0.05)[0], verdict(0.0, 0.0, 0.0)[0], verdict(0.98, 0.1, None)[0]
    ('learnable', 'too_hard', 'already_solved')
    >>> verdict(0.05, 0.2, 0.8)[0], verdict(0.0, 0.0, 0.5)[0], verdict(1.0, 0.0, None)[0]
    ('format_first', 'format_first', 'already_solved')
    >>> verdict(0.9, 0.25, None)[0], verdict(0.9, 0.26, None)[0], verdict(0.89, 0.1, None)[0]  # the boundaries
    ('already_solved', 'learnable', 'learnable')
    >>> verdict(0.3, 0.01, 0.49)[0]
    'learnable'
    >>> print(verdict(0.5, 0.0, None)[1])  # doctest: +NORMALIZE_WHITESPACE
    no prompt's group holds both a right and a wrong answer (every group all right or all wrong; accuracy 0.500),
    so GRPO has no advantage to learn from
    """
    figures = f"accuracy {accuracy:.3f}, mixed groups {mixed_fraction:.0%}"
    if accuracy >= ALREADY_SOLVED_ACCURACY and mixed_fraction <= ALREADY_SOLVED_MIXED:
        return (
            "already_solved",
            f"the base is right on {accuracy:.1%} of sampled answers and {mixed_fraction:.0%} of the prompts' groups "
            "are mixed: little left to gain",
            ALREADY_SOLVED_FIXES,
        )
    if format_share is not None and format_share >= FORMAT_FIRST_SHARE:
        return (
            "format_first",
            f"{format_share:.0%} of the wrong answers hold the reference answer in a form the skill reward does not "
            f"read ({figures})",
            FORMAT_FIRST_FIXES,
        )
    if mixed_fraction == 0:
        flat = "every group all wrong" if accuracy == 0 else "every group all right or all wrong"
        return (
            "too_hard",
            f"no prompt's group holds both a right and a wrong answer ({flat}; accuracy {accuracy:.3f}), so GRPO has "
            "no advantage to learn from",
            TOO_HARD_FIXES,
        )
    return "learnable", f"{figures}: GRPO has groups to learn from", []


def recipe(train: TrainConfig) -> dict[str, Any]:
    """The training settings the check samples with and estimates from: TRL's defaults where train.grpo is unset.

    >>> from grpo_pipeline.configs.schema import TrainConfig
    >>> r = recipe(TrainConfig(grpo={"num_generations": 4, "per_device_train_batch_size": 8}))
    >>> r["num_generations"], r["groups_per_step"], r["oversample"], r["temperature"]
    (4, 2.0, 1.0, 1.0)
    """
    grpo = train.grpo
    pdb, gens = int(grpo_value(grpo, "per_device_train_batch_size")), int(grpo_value(grpo, "num_generations"))
    accumulation = int(grpo_value(grpo, "gradient_accumulation_steps") or 1)
    sampling = train.dynamic_sampling
    return {
        "num_generations": gens,
        "temperature": float(grpo_value(grpo, "temperature")),
        "max_completion_length": int(grpo_value(grpo, "max_completion_length")),
        "max_steps": int(grpo_value(grpo, "max_steps")),
        "num_train_epochs": float(grpo_value(grpo, "num_train_epochs")),
        "groups_per_step": pdb * accumulation / gens,
        "oversample": float(sampling.oversample) if sampling.enabled else 1.0,
    }


def estimate_training(
    generation_seconds: float, prompts: int, settings: dict[str, Any], train_rows: int
) -> TrainEstimate:
    """The training's time: the measured generation time per group (one prompt's num_generations samples, generated
    as many groups at once as a step generates) times the groups a step generates (groups_per_step x oversample),
    plus the rest of the step (log-probabilities, backward, optimizer) as (STEP_OVER_GENERATION - 1) times the
    generation of the groups it trains on, times the steps (max_steps; unset: the epochs over the train rows).

    >>> settings = {"groups_per_step": 2.0, "oversample": 2.0, "max_steps": 40, "num_train_epochs": 3}
    >>> e = estimate_training(10.0, 4, settings, 2000)
    >>> round(e.step_seconds, 2), round(e.seconds), e.steps
    (14.85, 594, 40)
    """
    per_group = generation_seconds / max(prompts, 1)
    groups, oversample = settings["groups_per_step"], settings["oversample"]
    step = per_group * groups * (oversample + STEP_OVER_GENERATION - 1)
    steps = settings["max_steps"]
    if steps <= 0:  # GRPOConfig's max_steps=-1: the epochs decide
        steps = math.ceil(settings["num_train_epochs"] * train_rows / max(groups, 1e-9))
    how = (
        f"{per_group:.2f} s of generation per group, measured here, x {groups:g} groups a step"
        + (f" x {oversample:g} (dynamic sampling's oversample)" if oversample != 1 else "")
        + f", plus {STEP_OVER_GENERATION - 1:.2f} x the trained groups' generation for the log-probabilities, backward "
        f"and optimizer ({STEP_PROFILE}), x {steps} steps; this machine, transformers generation"
    )
    return TrainEstimate(
        seconds=step * steps, steps=steps, step_seconds=step, groups_per_step=groups, oversample=oversample, how=how
    )


def model_identity(model_path: str) -> list[tuple[str, int, int]]:
    """The base's files as (name, size, mtime in ns): a changed or rewritten weight file changes the cache key
    without hashing gigabytes. A hub id (not a directory) is its name alone."""
    root = Path(model_path)
    if not root.is_dir():
        return []
    return sorted(
        (str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file()
    )


def code_version() -> str:
    """This module's source: a change to how the check measures makes every cached result stale."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def cache_key(
    fingerprint: str,
    model_path: str,
    model_files: list[tuple[str, int, int]],
    model_load: dict[str, Any],
    rewards: dict[str, Any],
    generation: dict[str, Any],
    prompts: int,
    seed: int,
    code: str,
) -> str:
    """sha256 of everything a check's figures depend on: the dataset, the base (path, files, how it is loaded), the
    reward set, the generation settings (and how many prompts a generate call holds), the prompts, the seed and
    the code. The training's length is not in it: the estimate is recomputed from the cached generation time.

    >>> args = ("fp", "/m", [("model.safetensors", 10, 1)], {"quantization": "none"}, {"entries": []},
    ...         {"num_generations": 8}, 16, 0, "c0")
    >>> cache_key(*args) == cache_key(*args), cache_key(*args) == cache_key(*args[:-1], "c1")
    (True, False)
    """
    blob = json.dumps(
        [fingerprint, model_path, model_files, model_load, rewards, generation, prompts, seed, code],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_dir(data_dir: Path) -> Path:
    """Where checks are cached: beside the dataset versions they measured."""
    return Path(data_dir) / "task-checks"


def read_cached(path: Path) -> TaskCheck | None:
    """A cached check, or None when there is none; a corrupt entry is ignored with a warning (and measured again)."""
    if not path.is_file():
        return None
    try:
        return TaskCheck.model_validate_json(path.read_bytes())
    except (ValidationError, ValueError, OSError) as exc:
        log.warning("task check: ignoring the unreadable cache entry %s (%s); measuring again", path, exc)
        return None


def write_cached(path: Path, check: TaskCheck) -> None:
    """Written aside and renamed into place, so a reader never sees half an entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
    tmp.write_text(check.model_dump_json(indent=2))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ on the model


def run_check(
    version: DatasetVersion,
    model_path: str,
    model: ModelConfig,
    rewards: RewardSet,
    train: TrainConfig,
    cfg: CheckConfig,
    cache_dir: Path,
) -> TaskCheck:
    """Sample the base at `model_path` as training will on `cfg.prompts` prompts of the version's val split (topped
    up from train), score with the skill reward, and judge; or read the same check back from `cache_dir`.

    Raises ConfigError when the version holds no val or train row to sample."""
    from grpo_pipeline.configs.schema import EvalConfig
    from grpo_pipeline.tasks.evaluate import sample, score
    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.trainer.rewards import completion_text

    started = time.perf_counter()
    settings = recipe(train)
    val = read_jsonl(Path(version.splits["val"])) if "val" in version.splits else []
    train_rows = read_jsonl(Path(version.splits["train"])) if len(val) < cfg.prompts else []
    rows, topped, note = pick_prompts(val, train_rows, cfg.prompts, cfg.seed)
    if not rows:
        raise ConfigError(
            f"the dataset version {version.fingerprint[:16]} holds no val or train row to sample for the task check: "
            "check data.source and the data stage's report (grpo-pipeline data), or set check.enabled=false"
        )
    # as many prompts per generate call as a training step generates groups, so the throughput is the step's
    per_call = max(1, math.ceil(settings["groups_per_step"] * settings["oversample"]))
    generation = {k: settings[k] for k in ("num_generations", "temperature", "max_completion_length")} | {
        "prompts_per_call": per_call
    }
    load = model_load(model)
    key = cache_key(
        version.fingerprint,
        model_path,
        model_identity(model_path),
        load.model_dump(mode="json"),
        rewards.model_dump(mode="json"),
        generation,
        len(rows),
        cfg.seed,
        code_version(),
    )
    path = Path(cache_dir) / f"{key[:32]}.json"
    train_count = version.report.splits.get("train", 0)
    if (cached := read_cached(path)) is not None:
        estimate = estimate_training(cached.generation_seconds, cached.prompts, settings, train_count)
        return cached.model_copy(update={"cached": True, "estimate": estimate})

    from grpo_pipeline.trainer.callbacks import hide_library_bars, interactive
    from grpo_pipeline.trainer.loading import load_model

    if not interactive():  # a log, not a person: no model-loading bars
        hide_library_bars()
    k, cap = settings["num_generations"], settings["max_completion_length"]
    loading = time.perf_counter()
    lm, tokenizer = load_model(model_path, load)
    lm.eval()
    load_seconds = time.perf_counter() - loading
    sampling = EvalConfig(
        samples_k=k,
        temperature=settings["temperature"],
        max_new_tokens=cap,
        seed=cfg.seed,
        batch_size=per_call,
    )
    generating = time.perf_counter()
    completions, lengths = sample(lm, tokenizer, rows, sampling)
    generation_seconds = time.perf_counter() - generating
    del lm
    texts = [[completion_text(c) for c in group] for group in completions]
    scored = score(
        [row for row in rows for _ in range(k)],
        [t for group in texts for t in group],
        rewards.skill_only(),  # the skill alone: the shaping rewards decide nothing here
        [n for group in lengths for n in group],
        max_completion_length=cap,
    )
    flat = [float(r[rewards.skill]) for r in scored.rows]
    skill = [flat[i * k : (i + 1) * k] for i in range(len(rows))]
    holds = [
        [
            holds_reference(t, row["answer"], last_user_message(row.get("prompt", ""))) if "answer" in row else None
            for t in group
        ]
        for row, group in zip(rows, texts, strict=True)
    ]
    figures = read_samples(skill, lengths, holds, cap, seed=cfg.seed)
    decided, reason, fixes = verdict(figures["accuracy"], figures["mixed_fraction"], figures["format_share"])
    tokens = sum(n for group in lengths for n in group)
    report = version.report
    check = TaskCheck(
        verdict=decided,
        reason=reason,
        fixes=fixes,
        skill=rewards.skill,
        fingerprint=version.fingerprint,
        rows_kept=report.rows_kept,
        quarantined=dict(report.dropped),
        splits=dict(report.splits),
        model_path=model_path,
        prompts=len(rows),
        prompts_from_val=len(rows) - topped,
        prompts_from_train=topped,
        note=note,
        num_generations=k,
        temperature=settings["temperature"],
        max_completion_length=cap,
        seed=cfg.seed,
        **figures,
        load_seconds=load_seconds,
        generation_seconds=generation_seconds,
        samples_per_second=figures["samples"] / generation_seconds if generation_seconds else 0.0,
        tokens_per_second=tokens / generation_seconds if generation_seconds else 0.0,
        estimate=estimate_training(generation_seconds, len(rows), settings, train_count),
        seconds=time.perf_counter() - started,
    )
    write_cached(path, check)
    return check


check_task = task(name="task-check")(run_check)
