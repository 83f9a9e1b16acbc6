"""What a search returns (`HPOResult`), its trials in brief, and why it failed when no trial completed."""

from __future__ import annotations

from typing import Any

import optuna
from pydantic import BaseModel


class HPOFailed(RuntimeError):
    """No trial completed; the message says why each one did not."""


class TrialSummary(BaseModel):
    number: int
    state: str
    value: float | None
    params: dict[str, Any]
    reason: str | None = None
    prompts: int | None = None  # the validation prompts its score is the mean of


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
    difference_ci: tuple[float, float] | None = None  # paired t interval, 95 % shared among the re-scoring's looks
    prompts: dict[str, Any] = {}  # needed, available, select, rescore (at most), rescored (used), reward_sd
    steps_spent: int = 0  # trial GRPO steps, every trial of the study
    seconds: dict[str, float] = {}  # study, rescoring (wall); trial_runs_summed, scoring_summed (`seconds_spent`)
    budget_steps: int | None = None
    budget_usd: float | None = None
    spent_usd: float | None = None
    trials: list[TrialSummary]
    mlflow_run_id: str | None = None

    def set_args(self) -> list[str]:
        """The overrides as `--set` arguments, to train with them by hand."""
        return [f"{path}={value}" for path, value in self.overrides.items()]


def summarize(study: optuna.Study) -> list[TrialSummary]:
    return [
        TrialSummary(
            number=t.number,
            state=t.state.name,
            value=t.value,
            params=t.params,
            reason=t.user_attrs.get("reason"),
            prompts=len(t.user_attrs["scores"]) if "scores" in t.user_attrs else None,
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
