"""The training job: its spec, built from the pipeline's `train` and `model` sections (pure), and the checks
the job's own settings must pass before any work is done. Launching it is infra's (`infra.launch`)."""

from __future__ import annotations

import ast
from pathlib import Path

from configs.schema import ConfigError, ModelConfig, TrainConfig
from trainer.checkpoints import open_store
from trainer.spec import JobSpec, ModelLoad, TrainSettings

SHOWN_METRICS = ("reward", "reward_std", "loss", "completions/mean_length", "step_time")


def model_load(model: ModelConfig) -> ModelLoad:
    """How the trainer (and every stage that loads the base) loads it."""
    return ModelLoad.model_validate(model.model_dump(include=set(ModelLoad.model_fields)))


def train_settings(train: TrainConfig) -> TrainSettings:
    """What of the `train` section the trainer itself runs (not where or how often it is launched)."""
    return TrainSettings.model_validate(train.model_dump(include=set(TrainSettings.model_fields)))


def build_job_spec(
    train: TrainConfig,
    model: ModelConfig,
    model_path: str,
    splits: dict[str, Path],
    run_dir: Path,
    *,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str | None = None,
    mlflow_run_id: str | None = None,
) -> JobSpec:
    """Everything the trainer needs, with paths made absolute so the job can run from anywhere.

    Checkpoints go under the run's own name: a configured `train.checkpoint_uri` is a root shared by
    runs, and a new run must never resume from (or report) another run's checkpoints.
    """
    run_dir = run_dir.resolve()
    root = train.checkpoint_uri
    checkpoints = f"{root.rstrip('/')}/{run_dir.name}" if root else str(run_dir / "checkpoints")
    return JobSpec(
        model_path=model_path,
        model=model_load(model),
        train=train_settings(train),
        train_file=str(Path(splits["train"]).resolve()),
        val_file=str(Path(splits["val"]).resolve()) if train.early_stopping_patience else None,
        work_dir=str(run_dir / "train"),
        checkpoint_uri=checkpoints,
        adapter_dir=str(run_dir / "adapter"),
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_run_id=mlflow_run_id,
        **({"mlflow_experiment": mlflow_experiment} if mlflow_experiment else {}),
    )


def check_rewards(rewards: list[str]) -> None:
    """Every reward resolves (a registered name or an importable 'package.module:function')."""
    from trainer.rewards import resolve_reward

    for name in rewards:
        try:
            resolve_reward(name)
        except ValueError as exc:
            raise ConfigError(f"train.rewards: {exc}") from None


def check_store(train: TrainConfig) -> None:
    """A configured checkpoint store is reachable and writable (the local default always is)."""
    if train.checkpoint_uri:
        open_store(train.checkpoint_uri, train.s3_endpoint_url).check()


def summarize_log_line(line: str) -> str | None:
    """A short summary of one of HF's per-step log dicts; None for any other trainer output.

    >>> summarize_log_line("{'loss': 0.5, 'reward': 0.25, 'step_time': 9.87, 'epoch': 0.01}")
    'reward=0.25 loss=0.5 step_time=9.87'
    """
    if not line.startswith("{'loss'"):
        return None
    try:
        logs = ast.literal_eval(line)
    except (ValueError, SyntaxError):
        return None
    return " ".join(f"{k}={logs[k]:.4g}" for k in SHOWN_METRICS if k in logs)
