"""The hyperparameter search as a stage of a flow, and alone as the `grpo-hpo` flow: data -> base model ->
study (`grpo-pipeline hpo`).

The pipeline flow runs `search_stage` before training when `hpo.enabled` is set; the `grpo-hpo` flow is for
searching without training, e.g. to compare search spaces or to resume a study.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from mlflow import MlflowClient
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from grpo_pipeline.configs.schema import PipelineConfig, load_config
from grpo_pipeline.flows import trigger
from grpo_pipeline.flows.preflight import preflight
from grpo_pipeline.flows.runs import parent_run, setup_tracking
from grpo_pipeline.flows.warm_start import warm_start_stage
from grpo_pipeline.infra.launch import make_launcher
from grpo_pipeline.tasks.data.shape import task_rewards
from grpo_pipeline.tasks.data.stage import data_task
from grpo_pipeline.tasks.hpo import HPOResult, Tracking, TrialJob, TrialOutcome, run_trial, search
from grpo_pipeline.tasks.job import WarmStart
from grpo_pipeline.tasks.model import resolve_model_task
from grpo_pipeline.tasks.promote.registry import Registry
from grpo_pipeline.trainer.offline import import_bitsandbytes_offline


@task(name="hpo-trial", task_run_name="trial-{trial.number}", cache_policy=NO_CACHE)
def trial_task(trial: optuna.Trial, job: TrialJob) -> TrialOutcome:
    return run_trial(trial, job, make_launcher)


def search_stage(
    cfg: PipelineConfig,
    model_path: str,
    splits: dict[str, Path],
    run_dir: Path,
    experiment_id: str,
    stage_run_id: str,
    warm_start: WarmStart | None,
    train_usd: float | None = None,
) -> HPOResult:
    """The study, its trials scored by the run's skill reward; each trial a task run and an MLflow run nested
    under the stage's run (`grpo_pipeline.flows.runs.stage_run`, which a retried flow run reopens, as the study resumes).
    `warm_start`: the adapter the training run continues, which every trial continues too (`warm_start_stage`);
    `train_usd`: the planned cost of the training run the search feeds, for its budget in USD
    (`hpo.budget_fraction`)."""
    tracking = Tracking(tracking_uri=cfg.mlflow_uri, experiment_id=experiment_id, stage_run_id=stage_run_id)
    return search(
        cfg.hpo,
        cfg.train,
        cfg.model,
        cfg.evaluate,
        model_path,
        splits,
        run_dir,
        data_dir=cfg.data_dir,
        rewards=cfg.train.reward_set(),
        run_one=trial_task,
        tracking=tracking,
        train_usd=train_usd,
        warm_start=warm_start,
    )


def _own_overrides(parameters: dict[str, Any]) -> list[str]:
    """A deployment's own overrides (this flow's only form field that makes any)."""
    return list(parameters.get("overrides") or [])


@flow(name="grpo-hpo", log_prints=True)
def hpo_flow(config_path: str | None = None, overrides: list[str] | None = None) -> dict:
    """Search hyperparameters and return the best as overrides for the training stage.

    Args:
        config_path: pipeline YAML (e.g. configs/demo-cpu.yaml); None runs the built-in defaults.
        overrides: `stage.key=value` assignments applied on top, e.g. `hpo.trials=12`.
    """
    # a run of a deployment of this flow may set only what the deployment allows (docs/security.md)
    cfg = task_rewards(load_config(config_path, trigger.enforce(config_path, overrides or [], _own_overrides)))
    preflight(cfg)
    return run_search(cfg)


def checked_hpo(cfg: PipelineConfig, config_path: str | None, overrides: list[str]) -> dict:
    """The `grpo-hpo` flow on a configuration loaded and preflighted already (`grpo-pipeline hpo` does both before
    a flow run exists): the checks do not run twice. The flow run records what was asked; the checked config
    reaches it by closure (as `grpo_pipeline.flows.pipeline.checked_pipeline` explains)."""

    @flow(name="grpo-hpo", log_prints=True)
    def grpo_hpo_checked(config_path: str | None = None, overrides: list[str] | None = None) -> dict:
        return run_search(cfg)

    return grpo_hpo_checked(config_path=config_path, overrides=overrides)


def run_search(cfg: PipelineConfig) -> dict:
    """Data, base model, study on a preflighted config, inside the flow run; the result as JSON."""
    import_bitsandbytes_offline()  # before any stage imports peft: no hub lookup for code (trainer/offline.py)
    rewards = cfg.train.reward_set()  # resolved once, as the pipeline does
    run_dir = cfg.data_dir / "runs" / f"{datetime.now():%Y%m%d-%H%M%S}-{(flow_run.id or 'local')[:8]}-hpo"
    model_path = resolve_model_task(cfg.model, cfg.data_dir / "models")
    dataset = data_task(cfg.data, cfg.data_dir / "datasets", model_path, rewards)  # as the pipeline does
    experiment_id = setup_tracking(cfg.mlflow_uri, cfg.tracking.experiment, cfg.data_dir / "mlartifacts")
    # the adapter a daily run would continue: searched from, as the pipeline's own search does
    warm_start = warm_start_stage(cfg, Registry(MlflowClient(cfg.mlflow_uri), cfg.tracking.registered_model), run_dir)
    with parent_run(flow_run.id or "local", "hpo") as run:  # a retry of this flow run continues it
        result = search_stage(cfg, model_path, dataset.splits, run_dir, experiment_id, run.info.run_id, warm_start)
    return result.model_dump(mode="json") | {"set": result.set_args(), "mlflow_tracking_uri": cfg.mlflow_uri}
