"""Trial scores with a known noise: how many validation prompts a target standard error needs, the prompt sets,
the greedy and sampled scorers, and the paired decision against the configured values."""

from __future__ import annotations

import functools
import logging
import math
import statistics
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import (
    ConfigError,
    EvalConfig,
    HPOConfig,
    ModelConfig,
)
from grpo_pipeline.tasks.evaluate import evaluate_model, read_jsonl, sampled_means, write_jsonl

log = logging.getLogger(__name__)


class Scorer(Protocol):
    """Scores an adapter on a JSONL prompt file: one skill score per prompt (`greedy_scorer`, `sampled_scorer`).
    `whole`: every prompt of the file (the re-scoring's looks line up only so); otherwise a sampled scoring may
    stop once it is precise enough."""

    def __call__(self, adapter_dir: str, prompts: Path, whole: bool = False) -> list[float]: ...


class Validation(BaseModel):
    """The validation prompts every trial is scored on, and how many the target standard error needs."""

    needed: int  # prompts per scoring: (sd / target_standard_error)^2
    available: int  # rows in the val split
    reward_sd: float  # what the sizing assumed
    select: Path  # n prompts: every finished trial's value
    rescore: Path  # n other prompts: the top trials and the configured one, again
    rungs: Path  # the first rung_prompts of `select`: the trainer's sampled rung checks


def prompts_needed(hpo: HPOConfig, rewards: RewardSet) -> tuple[int, float]:
    """Validation prompts per scoring for the target standard error, and the per-prompt SD assumed: by
    default the worst case for the skill reward, a score in [0, 1]: 0.5 (trials are scored on the skill alone,
    so the shaping rewards and their weights do not widen it).

    >>> two = RewardSet(names=("correct_answer", "number_only"))
    >>> prompts_needed(HPOConfig(target_standard_error=0.05), two)  # the skill in [0, 1]: SD at most 0.5
    (100, 0.5)
    >>> prompts_needed(HPOConfig(target_standard_error=0.05, reward_sd=0.3), two)
    (36, 0.3)
    """
    sd = hpo.reward_sd if hpo.reward_sd is not None else SKILL_SD
    return math.ceil((sd / hpo.target_standard_error) ** 2 - 1e-9), sd


SKILL_SD = 0.5  # the largest standard deviation of a score in [0, 1]


class NotEnoughPrompts(ConfigError):
    """The val split cannot give the target standard error (the CLI exits 2)."""


def prepare_validation(hpo: HPOConfig, rewards: RewardSet, val_file: Path | None, out_dir: Path) -> Validation:
    """Split the val split into the selection and re-scoring prompt sets (and the rung subset), after checking
    that it holds enough prompts for `hpo.target_standard_error` on `rewards`' skill reward."""
    needed, sd = prompts_needed(hpo, rewards)
    rows = read_jsonl(Path(val_file)) if val_file and Path(val_file).is_file() else []
    if hpo.trial_score == "trainer":  # no scoring pass: the trainer's rung checks use the first prompts
        needed = min(len(rows), hpo.rung_prompts)
    elif len(rows) < 2 * needed:
        raise NotEnoughPrompts(
            f"hpo.target_standard_error={hpo.target_standard_error:g} needs {needed} validation prompts per "
            f"scoring (per-prompt SD {sd:g}{'' if hpo.reward_sd else f', the worst case for the skill reward {rewards.skill} in [0, 1]'}), "
            f"{2 * needed} in all (the top trials are re-scored on {needed} fresh ones); the val split has {len(rows)}. "
            "Give more validation rows (data.demo.n_val, or a larger source), set hpo.reward_sd to a measured "
            "value, or loosen hpo.target_standard_error"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "select": rows[:needed],
        "rescore": rows[needed : 2 * needed],
        "rungs": rows[: min(hpo.rung_prompts, needed) or hpo.rung_prompts],
    }
    for name, part in files.items():
        write_jsonl(out_dir / f"val-{name}.jsonl", part)
    log.info(
        "validation: %d prompts per scoring for a standard error of %g (per-prompt SD %g); %d available",
        needed,
        hpo.target_standard_error,
        sd,
        len(rows),
    )
    return Validation(
        needed=needed, available=len(rows), reward_sd=sd, **{name: out_dir / f"val-{name}.jsonl" for name in files}
    )


def paired_decision(
    best: list[float], configured: list[float], trial: int, conf_trial: int, confidence: float = 0.95
) -> tuple[bool, str, float, tuple[float, float]]:
    """Whether the best trial beats the configured one beyond the noise: a paired t interval (at `confidence`)
    of the per-prompt differences lying above zero.

    >>> paired_decision([1, 1, 2, 2], [0, 1, 1, 1], 3, 0)[0]
    False
    >>> applied, why, diff, ci = paired_decision([2, 2, 2, 1, 2, 2], [0, 1, 0, 0, 1, 0], 3, 0)
    >>> applied, round(diff, 2)
    (True, 1.5)
    """
    import numpy as np
    from scipy import stats

    b, c = np.asarray(best, float), np.asarray(configured, float)
    d = b - c
    if np.ptp(d) == 0:  # every difference the same: the interval has no width
        low = high = float(d[0])
    else:
        ci = stats.ttest_rel(b, c).confidence_interval(confidence)
        low, high = float(ci.low), float(ci.high)
    diff = float(d.mean())
    figures = (
        f"trial {trial} {b.mean():.3f} vs the configured values (trial {conf_trial}) {c.mean():.3f} on "
        f"{len(d)} fresh prompts: difference {diff:+.3f} ({100 * confidence:.3g} % CI {low:+.3f} to {high:+.3f})"
    )
    if low > 0:
        return True, f"{figures}: better beyond the noise, applied", diff, (low, high)
    return False, f"{figures}: not better beyond the noise, the configured values are kept", diff, (low, high)


def greedy_scorer(model: ModelConfig, evaluate: EvalConfig, rewards: RewardSet, model_path: str) -> Scorer:
    """Scores an adapter greedily on a prompt file by the skill reward (`RewardSet.skill`, through
    `grpo_pipeline.tasks.evaluate.evaluate_model`): the search ranks trials by what promotion compares, not by a
    total a format alone can raise."""

    def score(adapter_dir: str, prompts: Path, whole: bool = False) -> list[float]:  # always whole
        result = evaluate_model(
            model_path,
            model,
            prompts,
            rewards,
            evaluate.model_copy(update={"samples_k": 0}),
            adapter=adapter_dir,
        )
        return [float(r[rewards.skill]) for r in result.rows]

    return score


def precise_enough(means: list[float], target_standard_error: float, min_prompts: int) -> bool:
    """Whether a scoring may stop: at least `min_prompts` prompts scored, and the standard error of their mean,
    measured from them, at most the target.

    >>> precise_enough([0.0, 1.0] * 8, 0.15, 16)  # SD 0.52 over 16 prompts: SE 0.13
    True
    >>> precise_enough([0.0, 2.0] * 8, 0.15, 16)  # SD 1.03: SE 0.26, more prompts needed
    False
    >>> precise_enough([0.0] * 8, 0.15, 16)  # no spread yet, but too few prompts to trust that
    False
    """
    n = len(means)
    return n >= min_prompts and statistics.stdev(means) / math.sqrt(n) <= target_standard_error


def sampled_scorer(
    model: ModelConfig, evaluate: EvalConfig, rewards: RewardSet, model_path: str, hpo: HPOConfig
) -> Scorer:
    """Scores an adapter on a prompt file by the mean skill score of `hpo.trial_samples` completions per prompt,
    sampled at `evaluate.temperature` with `evaluate.seed` (`grpo_pipeline.tasks.evaluate.sampled_means`): the
    same draws for every trial, so paired differences between trials are differences between their policies.

    The file holds the prompts sized for the worst-case SD; the scoring stops, `hpo.min_prompts` at a time, as soon
    as the SE measured on what it has scored reaches `hpo.target_standard_error` (`precise_enough`): a policy
    whose per-prompt SD is half the worst case needs a quarter of the prompts. Every scoring reads the same
    prompts in the same order, so two scores share the shorter one's prompts."""

    def score(adapter_dir: str, prompts: Path, whole: bool = False) -> list[float]:
        return sampled_means(
            model_path,
            model,
            prompts,
            rewards,
            evaluate.model_copy(update={"samples_k": hpo.trial_samples}),
            adapter_dir,
            enough=None
            if whole
            else functools.partial(
                precise_enough, target_standard_error=hpo.target_standard_error, min_prompts=hpo.min_prompts
            ),
            chunk=hpo.min_prompts,
        )

    return score
