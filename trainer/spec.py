"""The job spec: everything one training job needs, as JSON, so a launcher can ship it to any node."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from configs.schema import ModelConfig, TrainConfig


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str  # resolved: a local directory or a hub id
    model: ModelConfig
    train: TrainConfig
    train_file: str
    val_file: str | None = None
    work_dir: str  # local scratch: the HF output dir, the result file
    checkpoint_uri: str  # local directory or s3://bucket/prefix
    adapter_dir: str  # where the final adapter is written
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "grpo-pipeline"
    mlflow_run_id: str | None = None  # set by the launcher, so a relaunched job continues the same run

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def read(cls, path: Path) -> "JobSpec":
        return cls.model_validate_json(Path(path).read_text())


RESULT_FILE = "result.json"


class TrainResult(BaseModel):
    """What the trainer leaves in `<work_dir>/result.json` (and in the store's `final` entry)."""

    adapter_dir: str | None
    global_step: int
    max_steps: int
    resumed_from_step: int | None
    interrupted: bool  # stopped by SIGTERM after saving a checkpoint; relaunch to resume
    stopped_early: bool
    mlflow_run_id: str | None
    train_runtime_s: float
    first_step_s: float | None = None  # job start to first completed step (model load, fetch, resume)
    metrics: dict[str, float]
    restarts: int = 0  # filled by the launcher: relaunches after a preemption or an error
    gpu_hours: float | None = None  # filled by launchers that rent GPUs
