"""Training: the job spec for the configuration that trains, the job through the launcher `train.launcher` names
(its progress in the flow's log), and what it cost: the run's actual cost against the plan's estimate, and the
month's so far against the plan's projection."""

from __future__ import annotations

from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import mlflow
from prefect import task

from grpo_pipeline.configs.launchers import LAUNCHERS
from grpo_pipeline.configs.schema import PipelineConfig, TrainConfig
from grpo_pipeline.flows.runs import log_dataset_inputs, stage_run_for_another_process, system_metrics_of
from grpo_pipeline.flows.stages import resumable
from grpo_pipeline.infra.launch import make_launcher, run_job
from grpo_pipeline.tasks.data.stage import DatasetVersion
from grpo_pipeline.tasks.job import TrainProgress, WarmStart, build_job_spec
from grpo_pipeline.tasks.plan import Plan, actual_cost
from grpo_pipeline.tasks.summary import Cost, MonthCost
from grpo_pipeline.trainer.spec import JobSpec, TrainResult


def train_stage(
    cfg: PipelineConfig,
    model_path: str,
    splits: dict[str, Path],
    run_dir: Path,
    dataset: DatasetVersion,
    plan: Plan,
    warm_start: WarmStart | None,
    experiment_id: str,
    parent_run_id: str,
) -> tuple[TrainResult, Cost]:
    """Train `cfg` (the configuration that trains: planned and tuned) on `splits`, continuing `warm_start`'s adapter
    when there is one. The trainer logs into a `train` run of its own under the parent (it runs in another process,
    perhaps another machine); the job's actual cost beside the plan's estimate goes into the active (parent) run."""
    train_run = stage_run_for_another_process(experiment_id, parent_run_id, "train")
    spec = build_job_spec(
        cfg.train,
        cfg.model,
        model_path,
        splits,
        run_dir,
        mlflow_tracking_uri=cfg.mlflow_uri,
        mlflow_experiment=cfg.tracking.experiment,
        mlflow_run_id=train_run,
        init_adapter=warm_start.adapter_dir if warm_start else None,
    )
    log_dataset_inputs(train_run, dataset)
    result = resumable(train_task)(spec, cfg.train)
    cost = Cost(cost_usd_estimated=plan.estimate.usd, cost_usd_actual=actual_cost(result.gpu_hours, plan))
    mlflow.log_metrics(cost.model_dump())
    return result, cost


@task(name="train")
def train_task(spec: JobSpec, train: TrainConfig) -> TrainResult:
    """The job through the launcher `train.launcher` names; each step goes to the flow's log as step x/N,
    steps/s and the time left; a local job's machine metrics go into its MLflow run."""
    from prefect.logging import get_run_logger

    logger = get_run_logger()
    progress = TrainProgress()

    def show(line: str) -> None:
        if summary := progress.update(line):
            logger.info(summary)

    local_run = spec.mlflow_run_id if LAUNCHERS[train.launcher].local and spec.mlflow_tracking_uri else None
    with system_metrics_of(local_run) if local_run else nullcontext():
        return run_job(make_launcher(train, on_line=show, on_status=logger.info), spec)


def month_of(now: datetime) -> tuple[str, int]:
    """The calendar month (UTC) of `now`, and its first instant in epoch milliseconds (MLflow's start_time).

    >>> month_of(datetime(2026, 12, 1, 20, 31, tzinfo=UTC))
    ('2026-12', 1796083200000)
    """
    start = now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return f"{start:%Y-%m}", int(start.timestamp() * 1000)


def month_stage(cfg: PipelineConfig, experiment_id: str, plan: Plan) -> MonthCost:
    """Into the parent run: the month's actual cost so far (`cost/month_actual_usd`: each parent run's
    `cost_usd_actual` since the month began, this run's logged just before) beside the plan's projection of a
    run a day (`cost/month_projected_usd`)."""
    month, since = month_of(datetime.now(UTC))
    runs = mlflow.MlflowClient(cfg.mlflow_uri).search_runs(
        [experiment_id], f"metrics.cost_usd_actual >= 0 and attributes.start_time >= {since}", max_results=50000
    )
    figure = MonthCost(
        month=month,
        actual_usd=sum(r.data.metrics["cost_usd_actual"] for r in runs),
        runs=len(runs),
        projected_usd=plan.estimate.monthly_usd,
    )
    mlflow.log_metrics(
        {
            "cost/month_actual_usd": figure.actual_usd,
            **({"cost/month_projected_usd": figure.projected_usd} if figure.projected_usd is not None else {}),
        }
    )
    return figure
