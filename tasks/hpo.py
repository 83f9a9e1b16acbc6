"""Hyperparameter search stage: an Optuna study over LoRA rank, alpha, learning rate (and optionally KL
beta, num_generations, temperature), each trial a short GRPO run through the training launcher, pruned
on the validation reward it reports, trials in parallel up to `hpo.concurrency`.

- The study lives in Optuna's journal file under `data_dir` by default (a file lock serialises every
  write, so parallel trials, threads or processes, never take the same queued trial: SQLite cannot lock
  the row Optuna's `SELECT ... FOR UPDATE` asks for), or in PostgreSQL when `hpo.storage` says so. It
  is opened with `load_if_exists`: a crashed search resumes where it stopped, and only the rest of its
  budget (`hpo.trials`) runs. A new study is warm-started with the best trial of each earlier study of
  the same base model.
- No heartbeats: a trial runs on a thread of the search process, so a heartbeat only proves the process
  is alive, and under load a late one marked live trials stale. A trial whose trainer dies is FAIL with
  its reason; a trial left RUNNING by a search process that died (same host, its pid gone) is marked
  FAIL and queued again when the study is next opened.
- A trial is the trainer itself (`python -m trainer`, or a SkyPilot job from `sky/hpo-trial.yaml`),
  with `hpo.steps` steps and a validation reward every `hpo.eval_every` steps, which the trainer prints
  as a tagged line (`trainer.callbacks.ReportValidation`); the trial reports each one to Optuna and, when
  the pruner says so, cancels the job (SIGTERM locally, a cancel for SkyPilot). Its value is the
  validation reward at its last step.
- Parallel trials: Optuna's own `optimize(n_jobs=concurrency)` keeps that many trials in flight and
  asks the sampler for the next one as soon as any finishes, so TPE learns from every result; each
  trial body is a Prefect task run. Prefect's `.map` was the alternative, but it fixes a whole wave of
  parameters before any result is in and waits for the wave's slowest trial.
- A crashed trial is FAIL (that trial only), a pruned one PRUNED; when no trial completes, the stage
  raises `HPOFailed` with each trial's reason rather than fall back to the configured values.

The result's `overrides` (`{"train.lora.r": 16, "train.grpo.learning_rate": 2e-4, ...}`) go into
training with `apply_best(cfg, result.overrides)`.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import socket
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import optuna
from pydantic import BaseModel

from configs.schema import ConfigError, HPOConfig, PipelineConfig, SearchDim, SearchSpace, TrainConfig
from tasks.job import build_job_spec
from trainer.spec import TrainingFailed, parse_progress

# Builds the launcher a trial runs on (`infra.launch.make_launcher`): passed in by the flow, which owns the
# launch; called with the trial's `train` section and a callback for each line of the trainer's output.
LauncherFactory = Callable[[TrainConfig, Callable[[str], None]], Any]

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
    value: float | None  # validation reward at the last step; None when pruned
    pruned_at: int | None = None
    steps: int  # the last step that reported a validation reward


class TrialSummary(BaseModel):
    number: int
    state: str
    value: float | None
    params: dict[str, Any]
    reason: str | None = None


class HPOResult(BaseModel):
    study_name: str
    storage: str  # without a password
    best_trial: int
    best_value: float
    best_params: dict[str, Any]  # as Optuna names them
    overrides: dict[str, Any]  # config path -> value: what `apply_best` applies to the training stage
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
            params[name] = trial.suggest_int(name, int(dim.low), int(dim.high), log=dim.log)
        else:
            params[name] = trial.suggest_float(name, dim.low, dim.high, log=dim.log)
    return params


def to_overrides(params: dict[str, Any], cfg: PipelineConfig) -> dict[str, Any]:
    """Config paths and values for a trial's parameters.

    >>> from configs.schema import load_config
    >>> to_overrides({"lora_r": 16, "lora_alpha_ratio": 2.0, "learning_rate": 3e-4}, load_config(None))
    {'train.lora.r': 16, 'train.grpo.learning_rate': 0.0003, 'train.lora.lora_alpha': 32}
    """
    overrides = {TARGETS[name]: value for name, value in params.items() if name in TARGETS}
    if "lora_alpha_ratio" in params:
        rank = params.get("lora_r", cfg.train.lora.get("r", DEFAULT_LORA_R))
        overrides[ALPHA] = max(1, round(params["lora_alpha_ratio"] * rank))
    return overrides


def apply_best(cfg: PipelineConfig, best: dict[str, Any]) -> PipelineConfig:
    """A new config with `best` (config path -> value, e.g. `HPOResult.overrides`) applied and validated.

    >>> from configs.schema import load_config
    >>> cfg = apply_best(load_config(None), {"train.lora.r": 32, "train.grpo.learning_rate": 1e-4})
    >>> cfg.train.lora["r"], cfg.train.grpo["learning_rate"]
    (32, 0.0001)
    """
    tree = cfg.model_dump()
    for path, value in best.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return PipelineConfig.model_validate(tree)


def trial_config(cfg: PipelineConfig, overrides: dict[str, Any]) -> PipelineConfig:
    """The training config of one trial: the overrides, `hpo.steps` steps, a validation reward every
    `hpo.eval_every` steps, no relaunch after a crash (a crashed trial is a result), no early stopping
    (the pruner decides)."""
    hpo = cfg.hpo
    trial = apply_best(cfg, overrides)
    grpo = dict(trial.train.grpo)
    per_device = grpo.get("per_device_train_batch_size", 8)
    grpo |= {
        "max_steps": hpo.steps,
        "eval_strategy": "steps",
        "eval_steps": hpo.eval_every,
        "num_generations_eval": hpo.eval_generations,
        # as many completions per evaluation batch as per training batch, in whole prompt groups
        "per_device_eval_batch_size": max(hpo.eval_generations, per_device // hpo.eval_generations * hpo.eval_generations),
    }
    train = trial.train.model_copy(update={"grpo": grpo, "early_stopping_patience": None, "max_restarts": 0})
    if train.launcher == "sky":  # the trial YAML's cheaper GPU list, not the one planned for training
        train = train.model_copy(
            update={"sky": train.sky.model_copy(update={"task_yaml": hpo.sky_task_yaml, "accelerators": None})}
        )
    return trial.model_copy(update={"train": train})


def storage_url(cfg: PipelineConfig) -> str:
    """Where the study lives: a database URL, or the journal file under `data_dir`."""
    return cfg.hpo.storage or str((cfg.data_dir / "optuna-journal.log").resolve())


def open_storage(cfg: PipelineConfig) -> optuna.storages.BaseStorage:
    url = storage_url(cfg)
    if cfg.hpo.storage:
        return optuna.storages.RDBStorage(url)
    Path(url).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))


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


def make_pruner(hpo: HPOConfig) -> optuna.pruners.BasePruner:
    """
    >>> type(make_pruner(HPOConfig(pruner="hyperband"))).__name__
    'HyperbandPruner'
    """
    if hpo.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=hpo.pruner_startup_trials, n_warmup_steps=0)
    if hpo.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=hpo.eval_every, max_resource=hpo.steps, reduction_factor=3)
    if hpo.pruner == "threshold":
        return optuna.pruners.ThresholdPruner(lower=hpo.prune_below)
    return optuna.pruners.NopPruner()


def open_study(cfg: PipelineConfig, name: str | None = None) -> optuna.Study:
    """Create or load the study; a new one is warm-started from earlier studies' best trials, an old one
    gets back the trials a dead search process left running."""
    name = name or study_name(cfg.hpo)
    storage = open_storage(cfg)
    earlier = optuna.get_all_study_names(storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # multivariate TPE
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            direction="maximize",
            sampler=make_sampler(cfg.hpo),
            pruner=make_pruner(cfg.hpo),
            load_if_exists=True,
        )
    owner = study.user_attrs.get("base_model")
    if owner is not None and owner != cfg.model.base:
        raise ConfigError(
            f"study {name!r} searched for base model {owner!r}, not {cfg.model.base!r}: its trials do not carry "
            "over; set hpo.study_name to a new name"
        )
    if name not in earlier:
        study.set_user_attr("base_model", cfg.model.base)
        if cfg.hpo.warm_start:
            for params in earlier_best(storage, name, cfg.model.base, cfg.hpo.space):
                study.enqueue_trial(params, skip_if_exists=True)
    requeue_orphans(study)
    return study


WORKER = "worker"  # trial user attribute: "host:pid" of the search process running it


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
    orphans = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
               if _dead(t.user_attrs.get(WORKER))]
    for t in orphans:
        reason = f"the search process {t.user_attrs[WORKER]} died while this trial ran; queued again"
        study._storage.set_trial_user_attr(t._trial_id, "reason", reason)
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params)
        log.warning("trial %d: %s", t.number, reason)
    return [t.number for t in orphans]


def earlier_best(storage, current: str, base_model: str, space: SearchSpace) -> list[dict[str, Any]]:
    """The best parameters of every other study of the same base model that fit the current space."""
    found = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=True):
        best = summary.best_trial
        if summary.study_name == current or best is None or summary.user_attrs.get("base_model") != base_model:
            continue
        if fits(best.params, space):
            found.append(best.params)
        else:
            log.info("not warm-starting from study %s: its best trial lies outside the search space", summary.study_name)
    return found


def summarize(study: optuna.Study) -> list[TrialSummary]:
    return [
        TrialSummary(
            number=t.number, state=t.state.name, value=t.value, params=t.params, reason=t.user_attrs.get("reason")
        )
        for t in study.trials
    ]


def failure_report(trials: list[TrialSummary]) -> str:
    """Why no trial completed, one line per trial.

    >>> print(failure_report([TrialSummary(number=0, state="FAIL", value=None, params={}, reason="exit 1")]))
    no trial completed, so there are no best hyperparameters (the configured ones are not used silently):
      trial 0: FAIL: exit 1
    """
    lines = [f"  trial {t.number}: {t.state}: {t.reason or 'no reason recorded'}" for t in trials]
    return "no trial completed, so there are no best hyperparameters (the configured ones are not used silently):\n" + (
        "\n".join(lines) or "  (the study has no trials: hpo.trials is 0?)"
    )


def _reason(exc: BaseException) -> str:
    """The first line of an error and, for a trainer crash, the last line of its log (the exception)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1].strip()}"


# --------------------------------------------------------------------------------------------- the trials


class Tracking(BaseModel):
    """Where trial runs go in MLflow: nested under the stage run."""

    tracking_uri: str
    experiment_id: str
    stage_run_id: str

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(self.tracking_uri)


def run_trial(
    trial: optuna.Trial,
    cfg: PipelineConfig,
    model_path: str,
    splits: dict[str, Path],
    run_dir: Path,
    tracking: Tracking | None,
    launcher_for: LauncherFactory,
) -> TrialOutcome:
    """One short GRPO run with the trial's parameters; reports each validation reward and cancels the job
    when the pruner says so. Raises TrialFailed when the job crashes."""
    from mlflow.entities import Param

    overrides = to_overrides(suggest(trial, cfg.hpo.space), cfg)
    tcfg = trial_config(cfg, overrides)
    client = tracking.client() if tracking else None
    run_id = None
    if client:
        run_id = client.create_run(
            tracking.experiment_id,
            run_name=f"trial-{trial.number}",
            tags={"mlflow.parentRunId": tracking.stage_run_id, "optuna.trial": str(trial.number)},
        ).info.run_id
    trial.set_user_attr("overrides", overrides)
    trial.set_user_attr(WORKER, _this_worker())
    # Unique across runs: build_job_spec names the run's checkpoint prefix after this folder.
    trial_dir = run_dir / "hpo" / f"{run_dir.name}-trial-{trial.number:03d}"
    spec = build_job_spec(tcfg.train, tcfg.model, model_path, splits, trial_dir, mlflow_tracking_uri=cfg.mlflow_uri,
                          mlflow_experiment=cfg.tracking.experiment, mlflow_run_id=run_id)
    spec = spec.model_copy(update={"val_file": str(Path(splits["val"]).resolve())})

    reports: queue.Queue = queue.Queue()
    launcher = launcher_for(tcfg.train, lambda line: (report := parse_progress(line)) and reports.put(report))
    state, reason, outcome = "FAILED", None, None
    try:
        handle = launcher.launch(spec)
        outcome = _follow(trial, launcher, handle, reports, client, run_id, tcfg.hpo.steps)
        state = "KILLED" if outcome.pruned_at is not None else "FINISHED"
        return outcome
    except TrainingFailed as exc:
        reason = _reason(exc)
        trial.set_user_attr("reason", reason)
        raise TrialFailed(f"trial {trial.number}: {reason}") from exc
    except Exception as exc:  # a launch that failed (no cloud capacity, a bad YAML): this trial only
        reason = f"{type(exc).__name__}: {_reason(exc)}"
        trial.set_user_attr("reason", reason)
        raise TrialFailed(f"trial {trial.number}: {reason}") from exc
    finally:
        if client:
            # Logged last: the trainer logs its own (GRPOConfig) params only into a run that has none yet.
            logged = {"optuna.trial": trial.number, **overrides}
            client.log_batch(run_id, params=[Param(k, str(v)) for k, v in logged.items()])
            client.set_tag(run_id, "optuna.state", {"FINISHED": "COMPLETE", "KILLED": "PRUNED"}.get(state, "FAIL"))
            if reason:
                client.set_tag(run_id, "optuna.fail_reason", reason[:5000])
            if outcome and outcome.value is not None:
                client.log_metric(run_id, "trial_value", outcome.value)
            client.set_terminated(run_id, state)


def _follow(trial, launcher, handle, reports: queue.Queue, client, run_id, max_steps: int) -> TrialOutcome:
    """Wait for the job on a helper thread; here, report each validation reward and prune."""
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
                if client:
                    client.log_metric(run_id, "val_reward", value, step=step)
                if step < max_steps and trial.should_prune():
                    pruned_at = step
                    log.info("trial %d pruned at step %d (validation reward %.4g)", trial.number, step, value)
                    launcher.cancel(handle)
        except BaseException:
            launcher.cancel(handle)  # a cancelled search must not leave a trainer (or a rented GPU) running
            raise
        try:
            waiting.result()
        except TrainingFailed:
            if pruned_at is None:
                raise
    if pruned_at is not None:
        trial.set_user_attr("reason", f"pruned at step {pruned_at} (validation reward {seen[pruned_at]:.4g})")
        return TrialOutcome(value=None, pruned_at=pruned_at, steps=pruned_at)
    if not seen:
        raise TrainingFailed("the trainer finished without reporting a validation reward (is the val split empty?)")
    last = max(seen)
    return TrialOutcome(value=seen[last], steps=last)


# ---------------------------------------------------------------------------------------------- the study


def search(
    cfg: PipelineConfig,
    model_path: str,
    splits: dict[str, Path],
    run_dir: Path,
    *,
    run_one: Callable[..., TrialOutcome],
    tracking: Tracking | None = None,
) -> HPOResult:
    """Run the study's remaining budget and return the best trial. `run_one(trial, cfg, model_path, splits,
    run_dir, tracking)` runs one trial (the flow passes `run_trial` with its launcher, as a Prefect task, so
    each trial is a task run)."""
    study = open_study(cfg)
    finished = [t for t in study.trials if t.state.is_finished()]
    remaining = max(0, cfg.hpo.trials - len(finished))
    log.info("study %s in %s: %d trial(s) finished, %d to run", study.study_name, redact(storage_url(cfg)),
             len(finished), remaining)
    # Optuna runs parallel trials on its own threads; each gets a copy of this thread's context, so a
    # Prefect task called there belongs to the calling flow run.
    context = contextvars.copy_context()

    def objective(trial: optuna.Trial) -> float:
        outcome = context.copy().run(run_one, trial, cfg, model_path, splits, run_dir, tracking)
        if outcome.pruned_at is not None:
            raise optuna.TrialPruned(f"pruned at step {outcome.pruned_at}")
        return outcome.value

    study.optimize(objective, n_trials=remaining, n_jobs=cfg.hpo.concurrency, catch=(TrialFailed,))
    trials = summarize(study)
    complete = any(t.state == "COMPLETE" for t in trials)
    result = None
    if complete:
        best = study.best_trial
        result = HPOResult(
            study_name=study.study_name,
            storage=redact(storage_url(cfg)),
            best_trial=best.number,
            best_value=best.value,
            best_params=best.params,
            overrides=to_overrides(best.params, cfg),
            trials=trials,
            mlflow_run_id=tracking.stage_run_id if tracking else None,
        )
    if tracking:
        log_study(study, result, tracking, run_dir / "hpo")
    if result is None:
        raise HPOFailed(failure_report(trials))
    return result


PLOTS = {  # artifact -> optuna.visualization.matplotlib function
    "optimization_history.png": "plot_optimization_history",
    "intermediate_values.png": "plot_intermediate_values",
    "param_importances.png": "plot_param_importances",
}


def log_study(study: optuna.Study, result: HPOResult | None, tracking: Tracking, out_dir: Path) -> list[str]:
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
    client.log_table(run_id, data=table.astype({"state": str}), artifact_file="trials.json")
    logged = ["trials.json"]
    if result is not None:
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
