"""Training stage: turn the pipeline config into a job spec (pure), then run it through a launcher."""

from __future__ import annotations

import ast
from pathlib import Path

from prefect import task

from configs.schema import PipelineConfig
from infra.launch import LocalLauncher, TrainingFailed
from trainer.checkpoints import open_store
from trainer.spec import JobSpec, TrainResult

SHOWN_METRICS = ("reward", "reward_std", "loss", "completions/mean_length", "step_time")


def preflight(cfg: PipelineConfig) -> None:
    """Fail before any work is done when the run would pass its budget, or when the checkpoint store or
    SkyPilot cannot do what the run needs. (The plan stage checks the budget again for the chosen base.)"""
    if cfg.plan.budget_usd is not None:
        from tasks.plan import check_budget, plan_stage

        check_budget(plan_stage(cfg), cfg.plan.budget_usd)
    if cfg.train.launcher == "sky":
        from infra.launch.skypilot import preflight as sky_preflight

        sky_preflight(cfg)
    elif cfg.train.checkpoint_uri:
        open_store(cfg.train.checkpoint_uri, cfg.train.s3_endpoint_url).check()


def progress_line(line: str) -> str | None:
    """A short summary of one of HF's per-step log dicts; None for any other trainer output.

    >>> progress_line("{'loss': 0.5, 'reward': 0.25, 'step_time': 9.87, 'epoch': 0.01}")
    'reward=0.25 loss=0.5 step_time=9.87'
    """
    if not line.startswith("{'loss'"):
        return None
    try:
        logs = ast.literal_eval(line)
    except (ValueError, SyntaxError):
        return None
    return " ".join(f"{k}={logs[k]:.4g}" for k in SHOWN_METRICS if k in logs)


def build_job_spec(
    cfg: PipelineConfig, model_path: str, splits: dict[str, Path], run_dir: Path, mlflow_run_id: str | None
) -> JobSpec:
    """Everything the trainer needs, with paths made absolute so the job can run from anywhere.

    Checkpoints go under the run's own name: a configured `train.checkpoint_uri` is a root shared by
    runs, and a new run must never resume from (or report) another run's checkpoints.
    """
    run_dir = run_dir.resolve()
    root = cfg.train.checkpoint_uri
    checkpoints = f"{root.rstrip('/')}/{run_dir.name}" if root else str(run_dir / "checkpoints")
    return JobSpec(
        model_path=model_path,
        model=cfg.model,
        train=cfg.train,
        train_file=str(Path(splits["train"]).resolve()),
        val_file=str(Path(splits["val"]).resolve()) if cfg.train.early_stopping_patience else None,
        work_dir=str(run_dir / "train"),
        checkpoint_uri=checkpoints,
        adapter_dir=str(run_dir / "adapter"),
        mlflow_tracking_uri=cfg.mlflow_uri,
        mlflow_experiment=cfg.tracking.experiment,
        mlflow_run_id=mlflow_run_id,
    )


@task(name="train")
def train_task(spec: JobSpec) -> TrainResult:
    from prefect.logging import get_run_logger

    logger = get_run_logger()

    def show(line: str) -> None:
        if summary := progress_line(line):
            logger.info(summary)

    if spec.train.launcher == "sky":
        from infra.launch.skypilot import SkyLauncher

        launcher = SkyLauncher(spec.train.sky, spec.train.max_restarts, on_status=logger.info, on_line=show)
    else:
        launcher = LocalLauncher(spec.train.max_restarts, on_line=show)
    handle = launcher.launch(spec)
    try:
        return launcher.wait(handle)
    except TrainingFailed:
        raise
    except BaseException:
        # A cancelled flow run (or Ctrl-C) must not leave the trainer running, or a GPU rented, on its own.
        launcher.cancel(handle)
        raise
