"""MLflow runs of a pipeline run, opened in one place: the experiment (the embedded default is a SQLite file
and an artifact folder under the data directory), the parent run (one per Prefect flow run, found again by a
retry of it), and a nested run per stage (reopened when a retry reaches the stage again)."""

from __future__ import annotations

from contextlib import contextmanager
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


def find_run(filter_string: str) -> str | None:
    """The id of a run an earlier attempt of this flow run created, if any."""
    found = mlflow.search_runs(filter_string=filter_string, output_format="list", max_results=1)
    return found[0].info.run_id if found else None


@contextmanager
def parent_run(flow_run_id: str, name: str):
    """The flow run's top-level MLflow run, continued by a retry of the same flow run."""
    existing = find_run(f"tags.prefect_flow_run_id = '{flow_run_id}'")
    with mlflow.start_run(run_id=existing, run_name=None if existing else name,
                          tags={"prefect_flow_run_id": flow_run_id}) as run:
        yield run


def _child(parent_run_id: str, name: str) -> str | None:
    return find_run(f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.run_name = '{name}'")


@contextmanager
def stage_run(parent_run_id: str, name: str):
    """The stage's nested MLflow run, reopened when a retry of this flow run reaches the stage again."""
    existing = _child(parent_run_id, name)
    with mlflow.start_run(run_id=existing, run_name=None if existing else name, nested=True) as run:
        yield run


def stage_run_for_another_process(experiment_id: str, parent_run_id: str, name: str) -> str:
    """A nested run that another process (the trainer) fills in and ends; the same one on a retry."""
    return _child(parent_run_id, name) or mlflow.MlflowClient().create_run(
        experiment_id, run_name=name, tags={"mlflow.parentRunId": parent_run_id}
    ).info.run_id
