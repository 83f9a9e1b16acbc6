"""Hyperparameter search stage: an Optuna study over LoRA rank, alpha, learning rate (and optionally KL
beta, num_generations, temperature), many short GRPO trials promoted on rungs, each finished trial scored
greedily on fixed validation prompts, and the best applied only when it beats the configured values beyond
the noise.

- **Scores with a known noise.** A finished trial's value is its adapter's mean greedy weighted total
  (`RewardSet.total`, what training optimises and promotion compares) on the same validation prompts for every
  trial (`grpo_pipeline.tasks.evaluate.evaluate_model`), so trials compare as pairs. How many prompts:
  `hpo.target_standard_error` and the per-prompt standard deviation (`hpo.reward_sd`, or the worst case for
  rewards in [0, 1], half the weights' span) give n = (sd / se)^2; the stage logs n and fails (a `ConfigError`, exit 2)
  naming it when the val split holds fewer than 2n (n to select, n fresh ones to re-score).
- **No winner's curse.** The top `hpo.rescore_top_k` trials and the configured values' trial are scored again
  on n prompts no selection saw; the best of those re-scores is compared with the configured trial, paired
  per prompt (a t interval, `scipy.stats.ttest_rel`). Only when the interval lies above zero are its values
  applied; otherwise the configured values stay and the result says so (`applied`, `decision`).
- **Multi-fidelity.** Trials run up to `hpo.steps`, with a rung check every `hpo.eval_every` steps (the
  trainer's sampled validation reward on the first `hpo.rung_prompts` scoring prompts, as a tagged line
  `grpo_pipeline.trainer.callbacks.ReportValidation` prints); Optuna's successive halving / Hyperband promote a third of
  the trials at each rung and stop the rest (SIGTERM locally, a cancel for SkyPilot). The configured values'
  trial is never stopped: it is the control. The search stops launching trials once `hpo.budget_steps` (default:
  `hpo.budget_fraction` of the training run's steps; for SkyPilot, the same share of its planned USD) are
  spent; a trial in flight may overshoot it by its own remaining steps.
- The study lives in Optuna's journal file under `data_dir` by default (a file lock serialises every write, so
  parallel trials, threads or processes, never take the same queued trial: SQLite cannot lock the row Optuna's
  `SELECT ... FOR UPDATE` asks for), or in PostgreSQL when `hpo.storage` says so. It is opened with
  `load_if_exists`: a crashed search (or a retried flow run) resumes where it stopped, and only the rest of
  its budget runs. A new study is warm-started with the best trial of each earlier study of the same base model.
- A daily run that continues yesterday's adapter (`model.init_adapter`) searches from that adapter too: every
  trial, the configured control included, trains it further, so the values chosen are the ones that work for
  the run they feed. A study records where its trials started, and refuses to mix starts.
- No heartbeats: a trial runs on a thread of the search process, so a heartbeat only proves the process is
  alive, and under load a late one marked live trials stale. A trial whose trainer dies is FAIL with its
  reason; a trial left RUNNING by a search process that died (same host, its pid gone) is marked FAIL and
  queued again when the study is next opened.
- Parallel trials: Optuna's own `optimize(n_jobs=concurrency)` keeps that many trials in flight and asks the
  sampler for the next one as soon as any finishes, so TPE learns from every result; each trial body is a
  Prefect task run.
- When no trial completes, the stage raises `HPOFailed` with each trial's reason rather than fall back to the
  configured values.

The result's `overrides` (`{"train.lora.r": 16, "train.grpo.learning_rate": 2e-4, ...}`, empty when the
configured values stay) go into training with `apply_best(cfg, result.overrides)`.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import os
import queue
import socket
import statistics
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from pydantic import BaseModel, ConfigDict

from grpo_pipeline.configs.launchers import LAUNCHERS
from grpo_pipeline.configs.library_fields import grpo_value
from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import (
    ConfigError,
    EvalConfig,
    HPOConfig,
    ModelConfig,
    PipelineConfig,
    SearchDim,
    SearchSpace,
    TrainConfig,
    set_path,
)
from grpo_pipeline.tasks.job import WarmStart, build_job_spec
from grpo_pipeline.trainer.spec import TrainingFailed, parse_progress

if TYPE_CHECKING:
    from mlflow import MlflowClient

# Builds the launcher a trial runs on (`grpo_pipeline.infra.launch.make_launcher`): passed in by the flow, which owns the
# launch; called with the trial's `train` section and a callback for each line of the trainer's output.
LauncherFactory = Callable[[TrainConfig, Callable[[str], None]], Any]
# Scores an adapter on a JSONL prompt file: one weighted total per prompt, greedy (`greedy_scorer`).
Scorer = Callable[[str, Path], list[float]]

log = logging.getLogger(__name__)

# Searched name -> the config path it sets (lora_alpha_ratio sets train.lora.lora_alpha = ratio x rank).
TARGETS = {
    "lora_r": "train.lora.r",
    "learning_rate": "train.grpo.learning_rate",
    "beta": "train.grpo.beta",
    "num_generations": "train.grpo.num_generations",
    "temperature": "train.grpo.temperature",
}
ALPHA = "train.lora.lora_alpha"
DEFAULT_LORA_R = 8  # peft.LoraConfig's default rank, when neither the space nor train.lora sets one


class HPOFailed(RuntimeError):
    """No trial completed; the message says why each one did not."""


class TrialFailed(RuntimeError):
    """One trial crashed; Optuna marks it FAIL and the study goes on."""


class TrialOutcome(BaseModel):
    value: float | None  # sampled validation reward at the last rung; None when pruned
    pruned_at: int | None = None
    steps: int  # the last step that reported a validation reward
    adapter_dir: str | None = None  # what the trainer left, for greedy scoring


class TrialSummary(BaseModel):
    number: int
    state: str
    value: float | None
    params: dict[str, Any]
    reason: str | None = None


class Validation(BaseModel):
    """The validation prompts every trial is scored on, and how many the target standard error needs."""

    needed: int  # prompts per scoring: (sd / target_standard_error)^2
    available: int  # rows in the val split
    reward_sd: float  # what the sizing assumed
    select: Path  # n prompts: every finished trial's value
    rescore: Path  # n other prompts: the top trials and the configured one, again
    rungs: Path  # the first rung_prompts of `select`: the trainer's sampled rung checks


class HPOResult(BaseModel):
    study_name: str
    storage: str  # without a password
    best_trial: int  # the best searched trial after re-scoring (the configured trial when no other completed)
    best_value: float  # its greedy validation reward on the selection prompts
    best_params: dict[str, Any]  # as Optuna names them
    best_overrides: dict[str, Any]  # the best trial's values as config paths, applied or not
    overrides: dict[str, Any]  # what `apply_best` applies to training: best_overrides, or {} (configured kept)
    applied: bool  # False: the configured values stay
    decision: str  # why, in one sentence with the figures
    configured_trial: int | None = None
    rescored: dict[int, float] = {}  # trial -> mean greedy reward on the fresh prompts
    difference: float | None = None  # best - configured on the fresh prompts
    difference_ci: tuple[float, float] | None = None  # 95 % paired t interval
    prompts: dict[str, Any] = {}  # needed, available, select, rescore, reward_sd
    steps_spent: int = 0  # trial GRPO steps, every trial of the study
    budget_steps: int | None = None
    budget_usd: float | None = None
    spent_usd: float | None = None
    trials: list[TrialSummary]
    mlflow_run_id: str | None = None

    def set_args(self) -> list[str]:
        """The overrides as `--set` arguments, to train with them by hand."""
        return [f"{path}={value}" for path, value in self.overrides.items()]


# ---------------------------------------------------------------------------------------------- pure parts


def suggest(trial: optuna.trial.BaseTrial, space: SearchSpace) -> dict[str, Any]:
    """Ask the trial for a value of every searched dimension.

    >>> space = SearchSpace(lora_alpha_ratio=None)
    >>> suggest(optuna.trial.FixedTrial({"lora_r": 16, "learning_rate": 2e-4}), space)
    {'lora_r': 16, 'learning_rate': 0.0002}
    """
    params: dict[str, Any] = {}
    for name, dim in space.active().items():
        integer = name in ("lora_r", "num_generations")
        if dim.choices is not None:
            choices = [int(c) for c in dim.choices] if integer else [float(c) for c in dim.choices]
            params[name] = trial.suggest_categorical(name, choices)
        elif integer:
            assert dim.low is not None and dim.high is not None  # SearchDim: a range without choices
            params[name] = trial.suggest_int(name, int(dim.low), int(dim.high), log=dim.log)
        else:
            assert dim.low is not None and dim.high is not None
            params[name] = trial.suggest_float(name, dim.low, dim.high, log=dim.log)
    return params


def to_overrides(params: dict[str, Any], lora: dict[str, Any]) -> dict[str, Any]:
    """Config paths and values for a trial's parameters; `lora` (train.lora) gives the rank the alpha ratio
    scales when the trial does not search it.

    >>> to_overrides({"lora_r": 16, "lora_alpha_ratio": 2.0, "learning_rate": 3e-4}, {})
    {'train.lora.r': 16, 'train.grpo.learning_rate': 0.0003, 'train.lora.lora_alpha': 32}
    >>> to_overrides({"lora_alpha_ratio": 2.0}, {"r": 4})
    {'train.lora.lora_alpha': 8}
    """
    overrides = {TARGETS[name]: value for name, value in params.items() if name in TARGETS}
    if "lora_alpha_ratio" in params:
        rank = params.get("lora_r", lora.get("r", DEFAULT_LORA_R))
        overrides[ALPHA] = max(1, round(params["lora_alpha_ratio"] * rank))
    return overrides


def apply_best(cfg: PipelineConfig, best: dict[str, Any]) -> PipelineConfig:
    """A new config with `best` (config path -> value, e.g. `HPOResult.overrides`) applied and validated.

    >>> from grpo_pipeline.configs.schema import load_config
    >>> cfg = apply_best(load_config(None), {"train.lora.r": 32, "train.grpo.learning_rate": 1e-4})
    >>> cfg.train.lora["r"], cfg.train.grpo["learning_rate"]
    (32, 0.0001)
    """
    tree = cfg.model_dump()
    for path, value in best.items():
        set_path(tree, path.split("."), value, f"{path}: ")
    return PipelineConfig.model_validate(tree)


def trial_train(train: TrainConfig, hpo: HPOConfig, overrides: dict[str, Any]) -> TrainConfig:
    """The `train` section of one trial: the overrides (`train.*` paths, `to_overrides`) validated as the whole
    config validates them (the section's own rules, then `hpo.check_against` it), `hpo.steps` steps, a
    validation reward every `hpo.eval_every` steps, no relaunch after a crash (a crashed trial is a result), no
    early stopping (the pruner decides)."""
    tree = train.model_dump()
    for path, value in overrides.items():
        section, _, rest = path.partition(".")
        if section != "train":
            raise ConfigError(f"{path}: a trial sets train.* fields only")
        set_path(tree, rest.split("."), value, f"{path}: ")
    tuned = TrainConfig.model_validate(tree)
    hpo.check_against(tuned)
    grpo = dict(tuned.grpo)
    per_device = grpo_value(grpo, "per_device_train_batch_size")
    grpo |= {
        "max_steps": hpo.steps,
        "eval_strategy": "steps",
        "eval_steps": hpo.eval_every,
        "num_generations_eval": hpo.eval_generations,
        # as many completions per evaluation batch as per training batch, in whole prompt groups
        "per_device_eval_batch_size": max(
            hpo.eval_generations, per_device // hpo.eval_generations * hpo.eval_generations
        ),
    }
    trial = tuned.model_copy(update={"grpo": grpo, "early_stopping_patience": None, "max_restarts": 0})
    if not LAUNCHERS[trial.launcher].local:  # the trial YAML's cheaper GPU list, not the one planned for training
        trial = trial.model_copy(
            update={"sky": trial.sky.model_copy(update={"task_yaml": hpo.sky_task_yaml, "accelerators": None})}
        )
    return trial


FROM_BASE = "the base model"  # a study's start when its trials train fresh adapters


def storage_url(hpo: HPOConfig, data_dir: Path) -> str:
    """Where the study lives: a database URL (`hpo.storage`), or the journal file under `data_dir`."""
    return hpo.storage or str((data_dir / "optuna-journal.log").resolve())


def open_storage(hpo: HPOConfig, data_dir: Path) -> optuna.storages.BaseStorage:
    url = storage_url(hpo, data_dir)
    if hpo.storage:
        return optuna.storages.RDBStorage(url)
    Path(url).parent.mkdir(parents=True, exist_ok=True)
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(url))


def redact(url: str) -> str:
    """A storage URL fit for logs.

    >>> redact("postgresql+psycopg2://user:secret@db:5432/optuna")
    'postgresql+psycopg2://user:***@db:5432/optuna'
    >>> redact("/data/optuna-journal.log")
    '/data/optuna-journal.log'
    """
    if "://" not in url:
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def study_name(hpo: HPOConfig, today: datetime | None = None) -> str:
    """
    >>> study_name(HPOConfig(), datetime(2025, 6, 1, tzinfo=UTC))
    'grpo-hpo-2025-06-01'
    """
    return hpo.study_name.format(date=(today or datetime.now(UTC)).strftime("%Y-%m-%d"))


def fits(params: dict[str, Any], space: SearchSpace) -> bool:
    """Whether earlier parameters lie in this search space (same dimensions, values inside).

    >>> space = SearchSpace(lora_alpha_ratio=None)
    >>> fits({"lora_r": 16, "learning_rate": 2e-4}, space), fits({"lora_r": 12, "learning_rate": 2e-4}, space)
    (True, False)
    """
    active = space.active()
    if set(params) != set(active):
        return False
    return all(_inside(params[name], dim) for name, dim in active.items())


def _inside(value: Any, dim: SearchDim) -> bool:
    if dim.choices is not None:
        return value in dim.choices
    return dim.low <= value <= dim.high


def make_sampler(hpo: HPOConfig) -> optuna.samplers.BaseSampler:
    """Seeded TPE; a third of the budget samples at random first (TPE's default of 10 exceeds small budgets).
    Multivariate, because LoRA's best learning rate moves with its rank and alpha."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=hpo.seed, n_startup_trials=max(1, hpo.trials // 3), multivariate=True, constant_liar=True
        )


class FirstRungFloor(optuna.pruners.BasePruner):
    """Optuna's successive halving / Hyperband, except that the first `floor - 1` searched trials stop at the first
    rung: promotion then compares against at least `floor` configurations, so a small budget explores that many
    rather than training its first few further. (Optuna's own `bootstrap_count` holds every rung to that count,
    which a small budget never fills at the upper rungs.)"""

    def __init__(self, inner: optuna.pruners.BasePruner, first_rung: int, floor: int):
        self.inner, self.first_rung, self.floor = inner, first_rung, floor

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        if trial.last_step == self.first_rung and self.floor > 1:
            reached = sum(
                1
                for t in study.get_trials(deepcopy=False)
                if t.number != trial.number
                and self.first_rung in t.intermediate_values
                and not t.user_attrs.get(CONFIGURED)
            )
            if reached < self.floor - 1:
                return True
        return self.inner.prune(study, trial)


def make_pruner(hpo: HPOConfig) -> optuna.pruners.BasePruner:
    """Rungs in GRPO steps: the first at `eval_every`, then x `reduction_factor`, up to `steps`.

    >>> type(make_pruner(HPOConfig(pruner="hyperband")).inner).__name__
    'HyperbandPruner'
    >>> make_pruner(HPOConfig(pruner="successive_halving", steps=9, eval_every=1)).inner._min_resource
    1
    """
    if hpo.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=hpo.pruner_startup_trials, n_warmup_steps=0)
    if hpo.pruner == "hyperband":
        return FirstRungFloor(
            optuna.pruners.HyperbandPruner(
                min_resource=hpo.eval_every, max_resource=hpo.steps, reduction_factor=hpo.reduction_factor
            ),
            hpo.eval_every,
            hpo.min_configurations,
        )
    if hpo.pruner == "successive_halving":
        return FirstRungFloor(
            optuna.pruners.SuccessiveHalvingPruner(min_resource=hpo.eval_every, reduction_factor=hpo.reduction_factor),
            hpo.eval_every,
            hpo.min_configurations,
        )
    if hpo.pruner == "threshold":
        return optuna.pruners.ThresholdPruner(lower=hpo.prune_below)
    return optuna.pruners.NopPruner()


def prompts_needed(hpo: HPOConfig, rewards: RewardSet) -> tuple[int, float]:
    """Validation prompts per scoring for the target standard error, and the per-prompt SD assumed: by
    default the worst case for the weighted total of rewards in [0, 1], half its span (the sum of |weight|).

    >>> two = RewardSet(names=("correct_answer", "number_only"))
    >>> prompts_needed(HPOConfig(target_standard_error=0.05), two)  # two rewards in [0, 1]: SD at most 1
    (400, 1.0)
    >>> prompts_needed(HPOConfig(target_standard_error=0.05), two.model_copy(update={"weights": (1.0, 0.2)}))
    (144, 0.6)
    >>> prompts_needed(HPOConfig(target_standard_error=0.05, reward_sd=0.5), two)
    (100, 0.5)
    """
    sd = hpo.reward_sd if hpo.reward_sd is not None else rewards.span / 2
    return math.ceil((sd / hpo.target_standard_error) ** 2 - 1e-9), sd


class NotEnoughPrompts(ConfigError):
    """The val split cannot give the target standard error (the CLI exits 2)."""


def prepare_validation(hpo: HPOConfig, rewards: RewardSet, val_file: Path | None, out_dir: Path) -> Validation:
    """Split the val split into the selection and re-scoring prompt sets (and the rung subset), after checking
    that it holds enough prompts for `hpo.target_standard_error` on `rewards`' weighted total."""
    from grpo_pipeline.tasks.evaluate import read_jsonl

    needed, sd = prompts_needed(hpo, rewards)
    rows = read_jsonl(Path(val_file)) if val_file and Path(val_file).is_file() else []
    if hpo.trial_score == "trainer":  # no greedy scoring: the trainer's rung checks use the first prompts
        needed = min(len(rows), hpo.rung_prompts)
    elif len(rows) < 2 * needed:
        raise NotEnoughPrompts(
            f"hpo.target_standard_error={hpo.target_standard_error:g} needs {needed} validation prompts per "
            f"scoring (per-prompt SD {sd:g}{'' if hpo.reward_sd else ', the worst case for the weighted total of rewards in [0, 1]'}), "
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
        (out_dir / f"val-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
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


def budget(hpo: HPOConfig, train: TrainConfig, train_usd: float | None = None) -> tuple[int, float | None]:
    """Trial steps the search may spend, and in USD when the training run's planned cost is known.

    >>> from grpo_pipeline.configs.schema import load_config
    >>> c = load_config(None, ["train.grpo.max_steps=40", "hpo.budget_fraction=0.5"])
    >>> budget(c.hpo, c.train, train_usd=10.0)
    (20, 5.0)
    >>> c = load_config(None, ["hpo.budget_steps=12"])
    >>> budget(c.hpo, c.train)
    (12, None)
    """
    usd = hpo.budget_fraction * train_usd if train_usd is not None else None
    if hpo.budget_steps:
        return hpo.budget_steps, usd
    train_steps = train.grpo.get("max_steps") or hpo.steps * hpo.trials
    return max(1, round(hpo.budget_fraction * train_steps)), usd


def steps_spent(study: optuna.Study) -> int:
    """GRPO steps the study's finished trials trained (a pruned trial: up to its rung)."""
    return sum(int(t.user_attrs.get("steps", 0)) for t in study.get_trials(deepcopy=False) if t.state.is_finished())


def paired_decision(
    best: list[float], configured: list[float], trial: int, conf_trial: int
) -> tuple[bool, str, float, tuple[float, float]]:
    """Whether the best trial beats the configured one beyond the noise: a paired t interval (95 %) of the
    per-prompt differences lying above zero.

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
        ci = stats.ttest_rel(b, c).confidence_interval(0.95)
        low, high = float(ci.low), float(ci.high)
    diff = float(d.mean())
    figures = (
        f"trial {trial} {b.mean():.3f} vs the configured values (trial {conf_trial}) {c.mean():.3f} on "
        f"{len(d)} fresh prompts: difference {diff:+.3f} (95 % CI {low:+.3f} to {high:+.3f})"
    )
    if low > 0:
        return True, f"{figures}: better beyond the noise, applied", diff, (low, high)
    return False, f"{figures}: not better beyond the noise, the configured values are kept", diff, (low, high)


def greedy_scorer(model: ModelConfig, evaluate: EvalConfig, rewards: RewardSet, model_path: str) -> Scorer:
    """Scores an adapter greedily on a prompt file by the training's weighted total (`RewardSet.total`, through
    `grpo_pipeline.tasks.evaluate.evaluate_model`): the search ranks trials by what training optimises and promotion compares."""

    def score(adapter_dir: str, prompts: Path) -> list[float]:
        from grpo_pipeline.tasks.evaluate import evaluate_model

        result = evaluate_model(
            model_path,
            model,
            prompts,
            rewards,
            evaluate.model_copy(update={"samples_k": 0}),
            adapter=adapter_dir,
        )
        return [float(r["total"]) for r in result.rows]

    return score


def open_study(
    hpo: HPOConfig, base: str, data_dir: Path, name: str | None = None, start: str = FROM_BASE
) -> optuna.Study:
    """Create or load the study of base model `base` (model.base) whose trials start at `start` (a warm start's
    adapter URI, `WarmStart.uri`); a new one is warm-started from earlier studies' best trials (parameters
    carry over between starts, values do not), an old one gets back the trials a dead search process left
    running."""
    name = name or study_name(hpo)
    storage = open_storage(hpo, data_dir)
    earlier = optuna.get_all_study_names(storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # multivariate TPE
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            direction="maximize",
            sampler=make_sampler(hpo),
            pruner=make_pruner(hpo),
            load_if_exists=True,
        )
    owner = study.user_attrs.get("base_model")
    if owner is not None and owner != base:
        raise ConfigError(
            f"study {name!r} searched for base model {owner!r}, not {base!r}: its trials do not carry "
            "over; set hpo.study_name to a new name"
        )
    started = study.user_attrs.get(START, FROM_BASE if owner is not None else None)  # older studies: the base
    if started is not None and started != start:
        raise ConfigError(
            f"study {name!r}'s trials started from {started}, this search's start from {start}: their values do "
            "not compare; set hpo.study_name to a new name (e.g. 'grpo-hpo-{date}-2')"
        )
    if name not in earlier:
        study.set_user_attr("base_model", base)
        study.set_user_attr(START, start)
        if hpo.keep_configured:  # the control: the values training would use without the search
            study.enqueue_trial({}, user_attrs={CONFIGURED: True})
        if hpo.warm_start:
            for params in earlier_best(storage, name, base, hpo.space):
                study.enqueue_trial(params, skip_if_exists=True)
    requeue_orphans(study)
    return study


WORKER = "worker"  # trial user attribute: "host:pid" of the search process running it
START = "start"  # study user attribute: where every trial's adapter started
CONFIGURED = "configured"  # trial user attribute: this trial runs the configured values (no parameters)


def _this_worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _dead(worker: str | None) -> bool:
    """Whether the search process named "host:pid" is known to be gone (only this host's can be checked)."""
    host, _, pid = (worker or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def requeue_orphans(study: optuna.Study) -> list[int]:
    """Mark FAIL the trials a dead search process left RUNNING, and queue their parameters again."""
    orphans = [
        t
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        if _dead(t.user_attrs.get(WORKER))
    ]
    for t in orphans:
        reason = f"the search process {t.user_attrs[WORKER]} died while this trial ran; queued again"
        study._storage.set_trial_user_attr(t._trial_id, "reason", reason)
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={CONFIGURED: True} if t.user_attrs.get(CONFIGURED) else None)
        log.warning("trial %d: %s", t.number, reason)
    return [t.number for t in orphans]


def earlier_best(
    storage: optuna.storages.BaseStorage, current: str, base_model: str, space: SearchSpace
) -> list[dict[str, Any]]:
    """The best parameters of every other study of the same base model that fit the current space."""
    found = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=True):
        best = summary.best_trial
        if summary.study_name == current or best is None or summary.user_attrs.get("base_model") != base_model:
            continue
        if fits(best.params, space):
            found.append(best.params)
        else:
            log.info(
                "not warm-starting from study %s: its best trial lies outside the search space", summary.study_name
            )
    return found


def summarize(study: optuna.Study) -> list[TrialSummary]:
    return [
        TrialSummary(
            number=t.number, state=t.state.name, value=t.value, params=t.params, reason=t.user_attrs.get("reason")
        )
        for t in study.trials
    ]


def failure_report(trials: list[TrialSummary], searched_only: bool = False) -> str:
    """Why no trial completed, one line per trial.

    >>> print(failure_report([TrialSummary(number=0, state="FAIL", value=None, params={}, reason="exit 1")]))
    no trial completed, so there are no best hyperparameters (the configured ones are not used silently):
      trial 0: FAIL: exit 1
    """
    lines = [
        f"  trial {t.number}: {t.state}: {t.reason or ('the configured values, completed' if t.state == 'COMPLETE' else 'no reason recorded')}"
        for t in trials
    ]
    what = (
        "no searched trial completed (only the configured values' control)" if searched_only else "no trial completed"
    )
    return f"{what}, so there are no best hyperparameters (the configured ones are not used silently):\n" + (
        "\n".join(lines) or "  (the study has no trials: hpo.trials is 0?)"
    )


def _reason(exc: BaseException) -> str:
    """The first line of an error and, for a trainer crash, the exception in its log's tail (the last line that
    names an error; else the last line: a progress bar may be printed after the traceback).

    >>> _reason(RuntimeError("trainer exited with code 1; log: x\\nTraceback ...\\nValueError: boom\\n 50%|#  | 1/2"))
    'trainer exited with code 1; log: x ... ValueError: boom'
    """
    import re

    lines = [line for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) == 1:
        return lines[0]
    named = [line for line in lines[1:] if re.match(r"\s*[\w.]*(Error|Exception)\b", line)]
    return f"{lines[0]} ... {(named or lines)[-1].strip()}"


# --------------------------------------------------------------------------------------------- the trials


class Tracking(BaseModel):
    """Where trial runs go in MLflow: nested under the stage run."""

    tracking_uri: str
    experiment_id: str
    stage_run_id: str

    def client(self) -> MlflowClient:
        from mlflow import MlflowClient

        return MlflowClient(self.tracking_uri)


class TrialJob(BaseModel):
    """What every trial of one search runs with, less its own parameters: the search's settings, the train section
    each trial overrides, the base model (its config and resolved path), the splits (`val`: the rung prompts), the
    run's folder, where trial runs go in MLflow (None: nowhere), and the warm start's local adapter directory every
    trial continues (None: a fresh adapter)."""

    model_config = ConfigDict(frozen=True)

    hpo: HPOConfig
    train: TrainConfig
    model: ModelConfig
    model_path: str
    splits: dict[str, Path]
    run_dir: Path
    tracking: Tracking | None = None
    init_adapter: str | None = None


# Runs one trial of a search (`run_trial` with a launcher, as a Prefect task in the flow; a stand-in in tests).
RunOne = Callable[[optuna.Trial, TrialJob], TrialOutcome]


def run_trial(trial: optuna.Trial, job: TrialJob, launcher_for: LauncherFactory) -> TrialOutcome:
    """One short GRPO run of `job` with the trial's parameters; reports each validation reward and cancels the job
    when the pruner says so. Raises TrialFailed when the job crashes; the launcher's bad-input failure (a
    `TrainingFailed` that is a `ConfigError`, `grpo_pipeline.infra.launch.BadTrainingInput`: the trainer exited 2, e.g. a
    reward that returns NaN) is raised as it is, since every other trial would fail the same way."""
    from mlflow.entities import Param

    configured = bool(trial.user_attrs.get(CONFIGURED))
    overrides = {} if configured else to_overrides(suggest(trial, job.hpo.space), job.train.lora)
    trial_section = trial_train(job.train, job.hpo, overrides)
    tracking = job.tracking
    client = tracking.client() if tracking else None
    run_id = None
    if client and tracking:
        run_id = client.create_run(
            tracking.experiment_id,
            run_name=f"trial-{trial.number}",
            tags={
                "mlflow.parentRunId": tracking.stage_run_id,
                "optuna.trial": str(trial.number),
                "optuna.configured": str(configured).lower(),
            },
        ).info.run_id
    trial.set_user_attr("overrides", overrides)
    trial.set_user_attr(WORKER, _this_worker())
    # Unique across runs: build_job_spec names the run's checkpoint prefix after this folder.
    trial_dir = job.run_dir / "hpo" / f"{job.run_dir.name}-trial-{trial.number:03d}"
    spec = build_job_spec(
        trial_section,
        job.model,
        job.model_path,
        job.splits,
        trial_dir,
        mlflow_tracking_uri=tracking.tracking_uri if tracking else None,  # the trainer logs into the trial's run
        mlflow_run_id=run_id,
        init_adapter=job.init_adapter,
    )
    spec = spec.model_copy(update={"val_file": str(Path(job.splits["val"]).resolve())})

    reports: queue.Queue = queue.Queue()

    def on_line(line: str) -> None:
        if report := parse_progress(line):
            reports.put(report)

    launcher = launcher_for(trial_section, on_line)
    state, reason, outcome = "FAILED", None, None
    try:
        handle = launcher.launch(spec)
        outcome = _follow(trial, launcher, handle, reports, client, run_id, job.hpo.steps, prunable=not configured)
        state = "KILLED" if outcome.pruned_at is not None else "FINISHED"
        return outcome
    except TrainingFailed as exc:
        reason = _reason(exc)
        trial.set_user_attr("reason", reason)
        if isinstance(exc, ConfigError):  # bad input: not this trial's parameters, so not Optuna's to catch
            raise
        raise TrialFailed(f"trial {trial.number}: {reason}") from exc
    except Exception as exc:  # a launch that failed (no cloud capacity, a bad YAML): this trial only
        reason = f"{type(exc).__name__}: {_reason(exc)}"
        trial.set_user_attr("reason", reason)
        raise TrialFailed(f"trial {trial.number}: {reason}") from exc
    finally:
        if client and run_id:
            # Logged last: the trainer logs its own (GRPOConfig) params only into a run that has none yet.
            logged = {"optuna.trial": trial.number, **overrides}
            client.log_batch(run_id, params=[Param(k, str(v)) for k, v in logged.items()])
            client.set_tag(run_id, "optuna.state", {"FINISHED": "COMPLETE", "KILLED": "PRUNED"}.get(state, "FAIL"))
            if reason:
                client.set_tag(run_id, "optuna.fail_reason", reason[:5000])
            if outcome and outcome.value is not None:
                client.log_metric(run_id, "trial_value", outcome.value)
            client.set_terminated(run_id, state)


def _follow(
    trial: optuna.Trial,
    launcher: Any,
    handle: Any,
    reports: queue.Queue,
    client: MlflowClient | None,
    run_id: str | None,
    max_steps: int,
    prunable: bool = True,
) -> TrialOutcome:
    """Wait for the job on a helper thread; here, report each rung's validation reward and prune (unless the
    trial is the configured values' control)."""
    seen: dict[int, float] = {}
    pruned_at = None
    with ThreadPoolExecutor(1, thread_name_prefix=f"trial-{trial.number}-wait") as pool:
        waiting = pool.submit(launcher.wait, handle)
        try:
            while not (waiting.done() and reports.empty()):
                try:
                    report = reports.get(timeout=0.5)
                except queue.Empty:
                    continue
                step, value = int(report["step"]), float(report["val_reward"])
                if pruned_at is not None or step in seen:  # a resumed job repeats steps since its checkpoint
                    continue
                seen[step] = value
                trial.report(value, step)
                if client and run_id:
                    client.log_metric(run_id, "val_reward", value, step=step)
                if prunable and step < max_steps and trial.should_prune():
                    pruned_at = step
                    log.info("trial %d pruned at step %d (validation reward %.4g)", trial.number, step, value)
                    launcher.cancel(handle)
        except BaseException:
            launcher.cancel(handle)  # a cancelled search must not leave a trainer (or a rented GPU) running
            raise
        result = None
        try:
            result = waiting.result()
        except TrainingFailed:
            if pruned_at is None:
                raise
    if pruned_at is not None:
        trial.set_user_attr("reason", f"pruned at step {pruned_at} (validation reward {seen[pruned_at]:.4g})")
        return TrialOutcome(value=None, pruned_at=pruned_at, steps=pruned_at)
    if not seen:
        raise TrainingFailed("the trainer finished without reporting a validation reward (is the val split empty?)")
    last = max(seen)
    return TrialOutcome(value=seen[last], steps=last, adapter_dir=getattr(result, "adapter_dir", None))


# ---------------------------------------------------------------------------------------------- the study


def search(
    hpo: HPOConfig,
    train: TrainConfig,
    model: ModelConfig,
    evaluate: EvalConfig,
    model_path: str,
    splits: dict[str, Path],
    run_dir: Path,
    *,
    data_dir: Path,
    rewards: RewardSet,
    run_one: RunOne,
    tracking: Tracking | None = None,
    score: Scorer | None = None,
    train_usd: float | None = None,
    warm_start: WarmStart | None = None,
) -> HPOResult:
    """Run the study's remaining budget, re-score the top trials and decide whether the best replaces the
    configured values, for base `model` trained by `train` (continuing `warm_start`'s adapter, when given). `data_dir`: where the study's journal lies unless
    `hpo.storage` names a database. `rewards`: the run's (`TrainConfig.reward_set`), whose weighted total the
    trials are scored and sized by; `evaluate`: the greedy scorer's generation settings.
    `run_one(trial, job)` runs one trial of the `TrialJob` (the flow passes `run_trial` with its launcher, as a Prefect
    task, so each trial is a task run); `score(adapter_dir,
    prompts)` scores a finished trial greedily (default: `greedy_scorer`); `train_usd` is the training run's
    planned cost, for the budget in USD. Raises `NotEnoughPrompts` before any trial when the val split is too
    small, `HPOFailed` when no trial completes, and a trial's bad-input failure (`run_trial`) as it is: the
    study stops at once (no further trial starts) and the CLI exits 2, rather than launching every trial
    into the same broken reward."""
    validation = prepare_validation(hpo, rewards, splits.get("val"), run_dir / "hpo")
    if hpo.trial_score == "greedy":
        score = score or greedy_scorer(model, evaluate, rewards, model_path)
    else:
        score = None
    budget_steps, budget_usd = budget(hpo, train, train_usd)
    study = open_study(hpo, model.base, data_dir, start=warm_start.uri if warm_start else FROM_BASE)
    finished = [t for t in study.trials if t.state.is_finished()]
    remaining = max(0, hpo.trials - len(finished))
    log.info(
        "study %s in %s: %d trial(s) finished, %d at most to run; %d of %d trial steps spent",
        study.study_name,
        redact(storage_url(hpo, data_dir)),
        len(finished),
        remaining,
        steps_spent(study),
        budget_steps,
    )
    job = TrialJob(
        hpo=hpo,
        train=train,
        model=model,
        model_path=model_path,
        # the trainer's rung checks: the same prompts for every trial
        splits={**splits, "val": validation.rungs},
        run_dir=run_dir,
        tracking=tracking,
        init_adapter=warm_start.adapter_dir if warm_start else None,
    )
    # Optuna runs parallel trials on its own threads; each gets a copy of this thread's context, so a
    # Prefect task called there belongs to the calling flow run.
    context = contextvars.copy_context()

    def objective(trial: optuna.Trial) -> float:
        outcome = context.copy().run(run_one, trial, job)
        trial.set_user_attr("steps", outcome.pruned_at or outcome.steps)
        if outcome.pruned_at is not None:
            raise optuna.TrialPruned(f"pruned at step {outcome.pruned_at}")
        if score is None:  # hpo.trial_score=trainer: the last rung's sampled reward
            if outcome.value is None:
                trial.set_user_attr("reason", "the trainer reported no validation reward")
                raise TrialFailed(f"trial {trial.number}: no validation reward")
            return outcome.value
        if not outcome.adapter_dir:
            trial.set_user_attr("reason", "the trainer left no adapter to score")
            raise TrialFailed(f"trial {trial.number}: no adapter")
        try:
            scores = score(outcome.adapter_dir, validation.select)
        except Exception as exc:  # this trial's adapter only: a broken save, an unloadable rank
            trial.set_user_attr("reason", f"scoring failed: {type(exc).__name__}: {_reason(exc)}")
            raise TrialFailed(f"trial {trial.number}: scoring failed") from exc
        trial.set_user_attr("adapter_dir", str(outcome.adapter_dir))
        trial.set_user_attr("scores", scores)
        return statistics.fmean(scores)

    def stop_when_spent(study: optuna.Study, _trial: optuna.trial.FrozenTrial) -> None:
        if steps_spent(study) + hpo.eval_every > budget_steps:  # not even one more first rung fits
            study.stop()

    if remaining and steps_spent(study) + hpo.eval_every <= budget_steps:
        # Only TrialFailed is caught: anything else (bad input, a cancel) ends optimize, which marks that
        # trial FAIL, starts no other and lets the running ones finish, and reaches the caller as raised.
        study.optimize(
            objective, n_trials=remaining, n_jobs=hpo.concurrency, catch=(TrialFailed,), callbacks=[stop_when_spent]
        )
    trials = summarize(study)
    spent = steps_spent(study)
    complete = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
    result = None
    if complete:
        result = choose(study, complete, hpo, train.lora, storage_url(hpo, data_dir), validation, score)
        per_step = (budget_usd / budget_steps) if budget_usd is not None else None
        result = result.model_copy(
            update={
                "trials": summarize(study),
                "steps_spent": spent,
                "budget_steps": budget_steps,
                "budget_usd": budget_usd,
                "spent_usd": per_step * spent if per_step is not None else None,
                "mlflow_run_id": tracking.stage_run_id if tracking else None,
            }
        )
        log.info("%s", result.decision)
    if tracking:
        log_study(study, result, tracking, run_dir / "hpo", validation)
    if result is None:
        raise HPOFailed(failure_report(trials))
    return result


def choose(
    study: optuna.Study,
    complete: list,
    hpo: HPOConfig,
    lora: dict[str, Any],
    storage: str,
    validation: Validation,
    score: Scorer | None,
) -> HPOResult:
    """Re-score the top trials and the configured one on fresh prompts; the best of the re-scores replaces the
    configured values only beyond the noise. `lora`: train.lora (`to_overrides`); `storage`: the study's URL."""
    configured = next((t for t in complete if t.user_attrs.get(CONFIGURED)), None)
    searched = sorted((t for t in complete if not t.user_attrs.get(CONFIGURED)), key=lambda t: t.value, reverse=True)
    contenders = searched[: hpo.rescore_top_k] + ([configured] if configured else [])
    rescores: dict[int, list[float]] = {}
    for t in contenders if score is not None else []:
        key = f"rescores-{t.number}"  # on the study: a finished trial cannot be written to
        cached = study.user_attrs.get(key)  # a resumed search does not score twice
        if cached is None:
            adapter = t.user_attrs.get("adapter_dir")
            if not adapter or not Path(adapter).exists():
                log.warning("trial %d: its adapter %s is gone; not re-scored", t.number, adapter)
                continue
            assert score is not None  # the loop runs only with a scorer
            cached = score(adapter, validation.rescore)
            study.set_user_attr(key, cached)
        rescores[t.number] = cached
    ranked = [t for t in searched if t.number in rescores] or searched[:1]
    pick = max(ranked, key=lambda t: statistics.fmean(rescores.get(t.number, [t.value])), default=None)
    base: dict[str, Any] = {
        "study_name": study.study_name,
        "storage": redact(storage),
        "trials": [],
        "configured_trial": configured.number if configured else None,
        "rescored": {n: statistics.fmean(v) for n, v in rescores.items()},
        "prompts": {
            "needed": validation.needed,
            "available": validation.available,
            "select": validation.needed,
            "rescore": validation.needed,
            "reward_sd": validation.reward_sd,
        },
    }
    if pick is None:  # only the configured control completed: every point of the space failed
        raise HPOFailed(failure_report(summarize(study), searched_only=True))
    best_overrides = to_overrides(pick.params, lora)
    common = dict(
        base, best_trial=pick.number, best_value=pick.value, best_params=pick.params, best_overrides=best_overrides
    )
    if score is None:  # trainer-reported values: no per-prompt scores to pair
        if configured is not None and configured.value >= pick.value:
            return HPOResult(
                **common,
                overrides={},
                applied=False,
                decision=f"trial {pick.number} ({pick.value:.3f}, trainer-reported) does not beat the "
                f"configured values (trial {configured.number}, {configured.value:.3f}); kept",
            )
        return HPOResult(
            **common,
            overrides=best_overrides,
            applied=True,
            decision=f"trial {pick.number} applied: {pick.value:.3f} (trainer-reported, sampled; not "
            "re-scored) against "
            + (f"the configured values' {configured.value:.3f}" if configured else "no configured trial"),
        )
    if configured is None or configured.number not in rescores or pick.number not in rescores:
        why = (
            "the configured values were not run (hpo.keep_configured is off)"
            if not hpo.keep_configured
            else "the configured values have no score to compare with (their trial did not complete or its "
            "adapter is gone)"
        )
        return HPOResult(
            **common,
            overrides=best_overrides,
            applied=True,
            decision=f"trial {pick.number} applied ({statistics.fmean(rescores.get(pick.number, [pick.value])):.3f}"
            f" on fresh prompts): {why}",
        )
    applied, decision, diff, ci = paired_decision(
        rescores[pick.number], rescores[configured.number], pick.number, configured.number
    )
    return HPOResult(
        **common,
        overrides=best_overrides if applied else {},
        applied=applied,
        decision=decision,
        difference=diff,
        difference_ci=ci,
    )


PLOTS = {  # artifact -> optuna.visualization.matplotlib function
    "optimization_history.png": "plot_optimization_history",
    "intermediate_values.png": "plot_intermediate_values",
    "param_importances.png": "plot_param_importances",
}


def log_study(
    study: optuna.Study,
    result: HPOResult | None,
    tracking: Tracking,
    out_dir: Path,
    validation: Validation | None = None,
) -> list[str]:
    """The trials table, the best parameters and the study's plots, into the stage run; returns what was logged."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    client, run_id = tracking.client(), tracking.stage_run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    states = [t.state.name for t in study.trials]
    for state in ("COMPLETE", "PRUNED", "FAIL"):
        client.log_metric(run_id, f"trials_{state.lower()}", states.count(state))
    table = study.trials_dataframe(attrs=("number", "value", "state", "params", "duration", "user_attrs"))
    table["duration"] = table["duration"].dt.total_seconds()
    # per-prompt score lists stay in the study; the table keeps their means
    for column in ("user_attrs_scores",):
        if column in table:
            table[column] = [statistics.fmean(v) if isinstance(v, list) and v else None for v in table[column]]
    client.log_table(run_id, data=table.astype({"state": str}), artifact_file="trials.json")
    logged = ["trials.json"]
    client.log_metric(run_id, "steps_spent", steps_spent(study))
    if validation is not None:
        client.log_metric(run_id, "validation_prompts_needed", validation.needed)
        client.log_metric(run_id, "validation_prompts_available", validation.available)
    if result is not None:
        client.set_tag(run_id, "hpo.applied", str(result.applied).lower())
        client.set_tag(run_id, "hpo.decision", result.decision[:5000])
        if result.difference is not None and result.difference_ci is not None:  # set together
            client.log_metric(run_id, "difference_vs_configured", result.difference)
            client.log_metric(run_id, "difference_ci_low", result.difference_ci[0])
            client.log_metric(run_id, "difference_ci_high", result.difference_ci[1])
        client.log_metric(run_id, "best_value", result.best_value)
        client.log_dict(run_id, result.model_dump(exclude={"trials"}), "best_params.json")
        logged.append("best_params.json")
    for name, function in PLOTS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            try:
                axes = getattr(plots, function)(study)
            except (ValueError, RuntimeError) as exc:  # e.g. importances need two completed trials
                log.info("no %s: %s", name, exc)
                continue
        figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
        figure.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(figure)
        client.log_artifact(run_id, str(out_dir / name))
        logged.append(name)
    return logged
