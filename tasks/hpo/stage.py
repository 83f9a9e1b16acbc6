"""The search: run the study's remaining budget, re-score the top trials, decide, and log it all to MLflow."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import (
    EvalConfig,
    HPOConfig,
    ModelConfig,
    TrainConfig,
)
from grpo_pipeline.tasks.evaluate import read_jsonl, write_jsonl
from grpo_pipeline.tasks.hpo.result import HPOFailed, HPOResult, failure_report, summarize
from grpo_pipeline.tasks.hpo.scoring import (
    Scorer,
    Validation,
    greedy_scorer,
    paired_decision,
    prepare_validation,
    sampled_scorer,
)
from grpo_pipeline.tasks.hpo.space import threads_per_trial, to_overrides
from grpo_pipeline.tasks.hpo.study import (
    CONFIGURED,
    FROM_BASE,
    budget,
    open_study,
    redact,
    steps_committed,
    steps_spent,
    storage_url,
)
from grpo_pipeline.tasks.hpo.trials import RunOne, Tracking, TrialFailed, TrialJob, _reason
from grpo_pipeline.tasks.job import WarmStart

log = logging.getLogger(__name__)

# Where a search's wall time went, kept on the study so that a resumed search still accounts for the part it did
# not run again: the wall time of each `optimize` (the trials and their scoring, in parallel with
# hpo.concurrency > 1) and of each re-scoring (study attributes); each trial's training job and its scoring
# (trial attributes: summed over trials, more than the study's wall time when trials run in parallel).
TRAIN_S, SCORE_S, RESCORE_S, STUDY_S = "train_s", "score_s", "rescore_s", "study_s"


def seconds_spent(study: optuna.Study) -> dict[str, float]:
    """Wall seconds of the study's trials (`study`) and re-scorings; and the seconds its trials spent training
    and being scored, each summed over the trials."""
    trials = study.get_trials(deepcopy=False)

    def attrs(prefix: str) -> float:
        return sum(v for k, v in study.user_attrs.items() if k.startswith(f"{prefix}-"))

    return {
        "study": attrs(STUDY_S),
        "rescoring": attrs(RESCORE_S),
        "trial_runs_summed": sum(t.user_attrs.get(TRAIN_S, 0.0) for t in trials),
        "scoring_summed": sum(t.user_attrs.get(SCORE_S, 0.0) for t in trials),
    }


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside, put back after; None leaves them alone. Threads that
    start inside (Optuna's workers) size their pool from this setting on their first parallel op."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    `hpo.storage` names a database. `rewards`: the run's (`TrainConfig.reward_set`), whose skill reward the
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
    elif hpo.trial_score == "sampled":
        score = score or sampled_scorer(model, evaluate, rewards, model_path, hpo)
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
        started = time.monotonic()
        outcome = context.copy().run(run_one, trial, job)
        trial.set_user_attr(TRAIN_S, time.monotonic() - started)
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
        started = time.monotonic()
        try:
            scores = score(outcome.adapter_dir, validation.select)
        except Exception as exc:  # this trial's adapter only: a broken save, an unloadable rank
            trial.set_user_attr("reason", f"scoring failed: {type(exc).__name__}: {_reason(exc)}")
            raise TrialFailed(f"trial {trial.number}: scoring failed") from exc
        trial.set_user_attr(SCORE_S, time.monotonic() - started)
        trial.set_user_attr("adapter_dir", str(outcome.adapter_dir))
        trial.set_user_attr("scores", scores)
        return statistics.fmean(scores)

    def stop_when_spent(study: optuna.Study, _trial: optuna.trial.FrozenTrial) -> None:
        # parallel trials: the one still running will spend its steps too
        if steps_committed(study, hpo) + hpo.eval_every > budget_steps:  # not even one more first rung fits
            study.stop()

    if remaining and steps_spent(study) + hpo.eval_every <= budget_steps:
        # Only TrialFailed is caught: anything else (bad input, a cancel) ends optimize, which marks that
        # trial FAIL, starts no other and lets the running ones finish, and reaches the caller as raised.
        started = time.monotonic()
        with intra_op_threads(threads_per_trial(hpo, train)):  # the in-process scoring of parallel trials too
            study.optimize(
                objective,
                n_trials=remaining,
                n_jobs=hpo.concurrency,
                catch=(TrialFailed,),
                callbacks=[stop_when_spent],
            )
        runs = sum(k.startswith(f"{STUDY_S}-") for k in study.user_attrs)  # a resumed search adds its own
        study.set_user_attr(f"{STUDY_S}-{runs}", time.monotonic() - started)
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
                "seconds": seconds_spent(study),
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


def look_ends(prompts: int, first: int) -> list[int]:
    """After how many fresh prompts the re-scoring looks at its decision: `first`, then each time the count has
    doubled, and at the end. Doubling keeps the looks (and each contender's model loads) to a logarithm of the
    prompts: 400 prompts are 6 looks, where 16 at a time would be 25, each at a 25th of the 5 %.

    >>> look_ends(45, 16), look_ends(400, 16), look_ends(10, 16)
    ([16, 32, 45], [16, 32, 64, 128, 256, 400], [10])
    """
    ends = []
    while first < prompts:
        ends.append(first)
        first *= 2
    return [*ends, prompts]


def rescore(
    study: optuna.Study, contenders: list, configured: Any, hpo: HPOConfig, validation: Validation, score: Scorer
) -> tuple[dict[int, list[float]], float]:
    """Score the contenders again on the fresh prompts, all of them on the same prompts, looking at the decision
    after `hpo.min_prompts`, then each time the count doubles (`look_ends`), until the best of them and the
    configured trial differ beyond the noise or the prompts run out;
    returns each trial's per-prompt re-scores and the confidence the decision is taken at.

    Each trial's own SE stops a selection scoring, but this decision rests on a difference, which can be much
    smaller than either SE: on GSM8K, 16 prompts left a 95 % interval of +-0.25 around a 0.1 gap. Several
    looks at one decision: each is taken at a Bonferroni share of the 5 %, so deciding early is as sure as
    deciding at the end. Each look's re-scores are kept on the study: a resumed search scores no look twice."""
    rows = read_jsonl(validation.rescore)
    ends = look_ends(len(rows), hpo.min_prompts)
    confidence = 1 - 0.05 / len(ends)
    adapters = {t.number: t.user_attrs.get("adapter_dir") for t in contenders}
    rescores: dict[int, list[float]] = {}
    for number, adapter in adapters.items():
        cached = list(study.user_attrs.get(f"rescores-{number}", []))
        if len(cached) < len(rows) and not (adapter and Path(adapter).exists()):  # it cannot be scored further
            log.warning("trial %d: its adapter %s is gone; not re-scored", number, adapter)
            continue
        rescores[number] = cached
    while rescores and (done := min(map(len, rescores.values()))) < len(rows):
        if done and configured is not None and decided(rescores, configured.number, confidence):
            break
        part = rows[done : next(end for end in ends if end > done)]
        path = write_jsonl(validation.rescore.with_name(f"{validation.rescore.stem}-from-{done}.jsonl"), part)
        for number, scores in rescores.items():
            if len(scores) > done:  # scored further by an earlier, resumed search
                continue
            started = time.monotonic()
            new = score(adapters[number], path, whole=True)
            if len(new) != len(part):  # the chunks line up only if each is scored whole
                raise RuntimeError(f"trial {number}: re-scoring returned {len(new)} scores for {len(part)} prompts")
            scores += new
            key = f"{RESCORE_S}-{number}"
            study.set_user_attr(key, study.user_attrs.get(key, 0.0) + time.monotonic() - started)
            study.set_user_attr(f"rescores-{number}", scores)  # on the study: a finished trial cannot be written to
    return rescores, confidence


def best_rescored(rescores: dict[int, list[float]], configured: int | None) -> int | None:
    """The searched trial with the best mean re-score (None: only the configured one was re-scored)."""
    return max((n for n in rescores if n != configured), key=lambda n: statistics.fmean(rescores[n]), default=None)


def compare(
    rescores: dict[int, list[float]], pick: int, configured: int, confidence: float
) -> tuple[bool, str, float, tuple[float, float]]:
    """`paired_decision` on the prompts both trials were re-scored on."""
    shared = min(len(rescores[pick]), len(rescores[configured]))
    return paired_decision(rescores[pick][:shared], rescores[configured][:shared], pick, configured, confidence)


def decided(rescores: dict[int, list[float]], configured: int, confidence: float) -> bool:
    """Whether the best re-scored trial's difference from the configured one excludes zero, either way."""
    pick = best_rescored(rescores, configured)
    if pick is None or configured not in rescores:
        return False
    _, _, _, (low, high) = compare(rescores, pick, configured, confidence)
    return low > 0 or high < 0


def choose(
    study: optuna.Study,
    complete: list,
    hpo: HPOConfig,
    lora: dict[str, Any],
    storage: str,
    validation: Validation,
    score: Scorer | None,
) -> HPOResult:
    """Re-score the top trials and the configured one on fresh prompts (`rescore`); the best of the re-scores
    replaces the configured values only beyond the noise. `lora`: train.lora (`to_overrides`); `storage`: the
    study's URL."""
    configured = next((t for t in complete if t.user_attrs.get(CONFIGURED)), None)
    searched = sorted((t for t in complete if not t.user_attrs.get(CONFIGURED)), key=lambda t: t.value, reverse=True)
    contenders = searched[: hpo.rescore_top_k] + ([configured] if configured else [])
    rescores, confidence = rescore(study, contenders, configured, hpo, validation, score) if score else ({}, 0.95)
    rescored = best_rescored(rescores, configured.number if configured else None)
    pick = next((t for t in searched if t.number == rescored), searched[0] if searched else None)
    base: dict[str, Any] = {
        "study_name": study.study_name,
        "storage": redact(storage),
        "trials": [],
        "configured_trial": configured.number if configured else None,
        "rescored": {n: statistics.fmean(v) for n, v in rescores.items()},
        "prompts": {
            "needed": validation.needed,
            "available": validation.available,
            "select": validation.needed,  # at most: a sampled scoring stops at its target SE
            "rescore": validation.needed,  # at most: the re-scoring stops once its decision is clear
            "rescored": {n: len(v) for n, v in rescores.items()},  # the prompts each re-scoring used
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
    applied, decision, diff, ci = compare(rescores, pick.number, configured.number, confidence)
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
