"""MLflow runs of a pipeline run, opened in one place: the experiment (the embedded default is a SQLite file
and an artifact folder under the data directory), the parent run (one per Prefect flow run, found again by a
retry of it, named with its date and the flow run's short id), and a nested run per stage (reopened when a
retry reaches the stage again)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow

if TYPE_CHECKING:
    from grpo_pipeline.tasks.data.stage import DatasetVersion

# MLflow 3 opens an experiment in the view this tag names; without it, the GenAI view (traces, assistant).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def quiet_mlflow() -> None:
    """No "View run ... at" line per run and no upload progress bars (they garble worker logs); a user's
    own setting of either wins."""
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def experiment(uri: str, name: str, artifact_dir: Path) -> str:
    """The id of experiment `name` (created with artifacts under `artifact_dir` for a SQLite store), in
    MLflow's model-training view."""
    client = mlflow.MlflowClient(uri)
    found = client.get_experiment_by_name(name)
    if found is None:
        location = artifact_dir.resolve().as_uri() if uri.startswith("sqlite:") else None
        exp_id = client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    else:
        exp_id = found.experiment_id
        if found.tags.get("mlflow.experimentKind") != EXPERIMENT_KIND["mlflow.experimentKind"]:
            client.set_experiment_tag(exp_id, *next(iter(EXPERIMENT_KIND.items())))
    return exp_id


def setup_tracking(uri: str, name: str, artifact_dir: Path) -> str:
    """Point MLflow at `uri` and return the experiment id (created with artifacts under `artifact_dir`)."""
    quiet_mlflow()
    mlflow.set_tracking_uri(uri)
    exp_id = experiment(uri, name, artifact_dir)
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def find_run(filter_string: str) -> str | None:
    """The id of a run an earlier attempt of this flow run created, if any."""
    found = mlflow.search_runs(filter_string=filter_string, output_format="list", max_results=1)
    return found[0].info.run_id if found else None


def run_name(prefix: str, flow_run_id: str, started: datetime | None = None) -> str:
    """A parent run's name: what ran, when (UTC), and the flow run's short id.

    >>> run_name("grpo-pipeline", "0f6c9e1a-5d2b", datetime(2026, 12, 1, 7, 46, tzinfo=UTC))
    'grpo-pipeline 2026-12-01 07:46 0f6c9e1a'
    """
    started = (started or datetime.now(UTC)).astimezone(UTC)
    return f"{prefix} {started:%Y-%m-%d %H:%M} {flow_run_id[:8]}"


@contextmanager
def parent_run(flow_run_id: str, name: str, started: datetime | None = None) -> Iterator[mlflow.ActiveRun]:
    """The flow run's top-level MLflow run, continued by a retry of the same flow run."""
    existing = find_run(f"tags.prefect_flow_run_id = '{flow_run_id}'")
    with mlflow.start_run(
        run_id=existing,
        run_name=None if existing else run_name(name, flow_run_id, started),
        tags={"prefect_flow_run_id": flow_run_id, "pipeline": name},
    ) as run:
        yield run


def _child(parent_run_id: str, name: str) -> str | None:
    return find_run(f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.run_name = '{name}'")


@contextmanager
def stage_run(parent_run_id: str, name: str, clock: dict[str, float] | None = None) -> Iterator[mlflow.ActiveRun]:
    """The stage's nested MLflow run, reopened when a retry of this flow run reaches the stage again; its wall
    seconds added to `clock[name]` when given (`timed`)."""
    existing = _child(parent_run_id, name)
    with timed(clock, name), mlflow.start_run(run_id=existing, run_name=None if existing else name, nested=True) as run:
        yield run


@contextmanager
def timed(clock: dict[str, float] | None, name: str) -> Iterator[None]:
    """The block's wall seconds added to `clock[name]` (the run summary's `timings`), also when it raises.

    >>> clock = {}
    >>> with timed(clock, "data"):
    ...     pass
    >>> list(clock), clock["data"] < 1
    (['data'], True)
    """
    started = time.monotonic()
    try:
        yield
    finally:
        if clock is not None:
            clock[name] = round(clock.get(name, 0.0) + time.monotonic() - started, 2)


def stage_run_for_another_process(experiment_id: str, parent_run_id: str, name: str) -> str:
    """A nested run that another process (the trainer) fills in and ends; the same one on a retry."""
    return (
        _child(parent_run_id, name)
        or mlflow.MlflowClient()
        .create_run(experiment_id, run_name=name, tags={"mlflow.parentRunId": parent_run_id})
        .info.run_id
    )


@contextmanager
def system_metrics_of(run_id: str) -> Iterator[None]:
    """CPU, memory (and GPU, with pynvml) of this machine, sampled into run `run_id` while the block runs:
    for a stage another process fills in on this machine (local training). Nothing where MLflow's monitor
    cannot run (no psutil)."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, resume_logging=True)  # a retry continues the steps
        monitor.start()
    except Exception:  # psutil missing, or a monitor MLflow cannot start here: training goes on without it
        monitor = None
    try:
        yield
    finally:
        if monitor is not None:
            monitor.finish()


def log_dataset_inputs(run_id: str, dataset: DatasetVersion) -> None:
    """The dataset splits a run trains on (train, val), as its MLflow dataset inputs: the same digests the
    data stage's run lists, so the UI links them."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for split in ("train", "val"):
        if split not in dataset.splits:
            continue
        with warnings.catch_warnings():  # MLflow registers two local-file source classes and says so
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(str(Path(dataset.splits[split]).resolve()))
        # MLflow's Dataset marks `profile` abstract without being an ABC: MetaDataset is made as MLflow's docs do
        entity = MetaDataset(source, name=split, digest=dataset.fingerprints[split])._to_mlflow_entity()  # type: ignore[abstract]
        inputs.append(
            DatasetInput(
                entity,
                tags=[InputTag("mlflow.data.context", split), InputTag("dataset_fingerprint", dataset.fingerprint)],
            )
        )
    mlflow.MlflowClient().log_inputs(run_id, datasets=inputs)
