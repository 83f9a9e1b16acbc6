"""Hyperparameter search stage: an Optuna study over LoRA rank, alpha, learning rate (and optionally KL
beta, num_generations, temperature), many short GRPO trials promoted on rungs, each finished trial scored
greedily on fixed validation prompts, and the best applied only when it beats the configured values beyond
the noise.

- **Scores with a known noise.** A finished trial's value is its adapter's mean greedy skill reward
  (`RewardSet.skill`, what promotion compares; a total can rise on the format alone) on the same validation prompts for every
  trial (`grpo_pipeline.tasks.evaluate.evaluate_model`), so trials compare as pairs. How many prompts:
  `hpo.target_standard_error` and the per-prompt standard deviation (`hpo.reward_sd`, or the worst case for
  a score in [0, 1], 0.5) give n = (sd / se)^2; the stage logs n and fails (a `ConfigError`, exit 2)
  naming it when the val split holds fewer than 2n (n to select, n fresh ones to re-score).
- **No winner's curse.** The top `hpo.rescore_top_k` trials and the configured values' trial are scored again
  on up to n prompts no selection saw, all on the same prompts, looking after `hpo.min_prompts` and each
  time they double; the best of those re-scores is compared with the configured trial, paired per prompt (a t
  interval, `scipy.stats.ttest_rel`, at a Bonferroni share of the 5 % per look), and the re-scoring stops as
  soon as the interval excludes zero. Only when it lies above zero are the best trial's values applied; otherwise the
  configured values stay and the result says so (`applied`, `decision`).
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

The package, one job a module: `space` (parameters <-> config paths, a trial's `train` section), `study` (Optuna's
storage, sampler, pruner, budget, warm start, orphans), `scoring` (validation prompts, the greedy scorer, the paired
decision), `trials` (one trial as a training job), `stage` (the search itself, its choice and its MLflow record),
`result` (what it returns). Every public name is importable from here.
"""

from __future__ import annotations

from grpo_pipeline.tasks.hpo.result import HPOFailed, HPOResult, TrialSummary, failure_report, summarize
from grpo_pipeline.tasks.hpo.scoring import (
    NotEnoughPrompts,
    Scorer,
    Validation,
    greedy_scorer,
    paired_decision,
    prepare_validation,
    prompts_needed,
    sampled_scorer,
)
from grpo_pipeline.tasks.hpo.space import (
    ALPHA,
    DEFAULT_LORA_R,
    TARGETS,
    apply_best,
    fits,
    suggest,
    threads_per_trial,
    to_overrides,
    trial_train,
)
from grpo_pipeline.tasks.hpo.stage import PLOTS, choose, log_study, search, seconds_spent
from grpo_pipeline.tasks.hpo.study import (
    CONFIGURED,
    FROM_BASE,
    START,
    WORKER,
    FirstRungFloor,
    budget,
    earlier_best,
    make_pruner,
    make_sampler,
    open_storage,
    open_study,
    redact,
    requeue_orphans,
    steps_committed,
    steps_spent,
    storage_url,
    study_name,
)
from grpo_pipeline.tasks.hpo.trials import (
    LauncherFactory,
    RunOne,
    Tracking,
    TrialFailed,
    TrialJob,
    TrialOutcome,
    run_trial,
)

__all__ = [
    "ALPHA",
    "CONFIGURED",
    "DEFAULT_LORA_R",
    "FROM_BASE",
    "FirstRungFloor",
    "HPOFailed",
    "HPOResult",
    "LauncherFactory",
    "NotEnoughPrompts",
    "PLOTS",
    "RunOne",
    "START",
    "Scorer",
    "TARGETS",
    "Tracking",
    "TrialFailed",
    "TrialJob",
    "TrialOutcome",
    "TrialSummary",
    "Validation",
    "WORKER",
    "apply_best",
    "budget",
    "choose",
    "earlier_best",
    "failure_report",
    "fits",
    "greedy_scorer",
    "log_study",
    "make_pruner",
    "make_sampler",
    "open_storage",
    "open_study",
    "paired_decision",
    "prepare_validation",
    "prompts_needed",
    "sampled_scorer",
    "redact",
    "requeue_orphans",
    "run_trial",
    "search",
    "seconds_spent",
    "steps_committed",
    "steps_spent",
    "storage_url",
    "study_name",
    "suggest",
    "summarize",
    "threads_per_trial",
    "to_overrides",
    "trial_train",
]
