"""MLflow: the embedded default is a SQLite file and an artifact folder under the data directory."""

from __future__ import annotations

from pathlib import Path

import mlflow


def setup_tracking(uri: str, experiment: str, artifact_dir: Path) -> str:
    """Point MLflow at `uri` and return the experiment id (created with artifacts under `artifact_dir`)."""
    mlflow.set_tracking_uri(uri)
    found = mlflow.get_experiment_by_name(experiment)
    if found is not None:
        exp_id = found.experiment_id
    else:
        location = artifact_dir.resolve().as_uri() if uri.startswith("sqlite:") else None
        exp_id = mlflow.create_experiment(experiment, artifact_location=location)
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def create_child_run(experiment_id: str, parent_run_id: str, name: str) -> str:
    """A nested run that another process (the trainer) fills in and ends."""
    run = mlflow.MlflowClient().create_run(
        experiment_id, run_name=name, tags={"mlflow.parentRunId": parent_run_id}
    )
    return run.info.run_id
