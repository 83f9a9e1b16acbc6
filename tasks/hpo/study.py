"""The Optuna study: where it lives, its sampler and pruner (rungs in GRPO steps), its budget, opening and
warm-starting it, and the trials a dead search process left running."""

from __future__ import annotations

import logging
import os
import socket
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import optuna

from grpo_pipeline.configs.schema import (
    ConfigError,
    HPOConfig,
    SearchSpace,
    TrainConfig,
)
from grpo_pipeline.tasks.hpo.space import fits, space_filling

log = logging.getLogger(__name__)


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


SPACE_FILLING = "space_filling"  # trial user attribute: queued by the study's space-filling start (hpo.start_trials)


def make_sampler(hpo: HPOConfig) -> optuna.samplers.BaseSampler:
    """Seeded TPE, after the study's space-filling start (`open_study`, `hpo.start_trials`); its own random start,
    a third of the budget, is what a study without that start (`hpo.start_trials: 0`, or created before it existed)
    begins with. Multivariate, because LoRA's best learning rate moves with its rank and alpha."""
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


def steps_committed(study: optuna.Study, hpo: HPOConfig) -> int:
    """`steps_spent`, and the trials still running counted at the top rung (`hpo.steps`): what the budget has
    already paid for once parallel trials finish."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return steps_spent(study) + len(running) * hpo.steps


def open_study(
    hpo: HPOConfig, base: str, data_dir: Path, name: str | None = None, start: str = FROM_BASE
) -> optuna.Study:
    """Create or load the study of base model `base` (model.base) whose trials start at `start` (a warm start's
    adapter URI, `WarmStart.uri`); a new one queues the control (the configured values), earlier studies' best
    trials (parameters carry over between starts, values do not) and then configurations spread over the space
    (`space_filling`), up to `hpo.start_trials` trials; an old one gets back the trials a dead search process
    left running."""
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
        # the rest of the start spread over the space (TPE's own start draws at random)
        for params in space_filling(hpo.space, min(hpo.trials, hpo.start_trials) - len(study.trials), hpo.seed):
            study.enqueue_trial(params, user_attrs={SPACE_FILLING: True}, skip_if_exists=True)
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
