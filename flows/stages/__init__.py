"""The pipeline's stage glue: what each stage of `grpo_pipeline.flows.pipeline.run_pipeline` does inside its MLflow
stage run (which the flow opens: `grpo_pipeline.flows.runs.stage_run`): call the stage's task (tasks/), log what
it found, return its typed result. The flow module keeps the flows, reading as the outline; one module here per
part of that outline:

    prepare   the data, the base model (selection, quantization cost), the plan, the configuration that trains
    daily     daily retraining: the rows the lineage has seen, skip-unchanged, the incremental split, drift
    train     the job through the launcher, and what it cost (the run's, the month's)
    evaluate  a model on a holdout: the base, the candidate, the champion
    promote   merge, decide, register, the serving check, the aliases
    report    the run's summary, decision and chart as MLflow and Prefect artifacts
"""

from __future__ import annotations

from typing import Any

import mlflow
from prefect.cache_policies import INPUTS, RUN_ID, TASK_SOURCE

# Within one flow run, a stage whose inputs and code are unchanged returns its persisted result, so a
# retry does no second data pass, training or evaluation. A new flow run computes everything afresh.
RESUMABLE = INPUTS + TASK_SOURCE + RUN_ID


def resumable(stage: Any) -> Any:
    """`stage` (a Prefect task) cached on its inputs, its code and the flow run, its result persisted (`RESUMABLE`)."""
    return stage.with_options(cache_policy=RESUMABLE, persist_result=True)


def active_run_id() -> str:
    """The MLflow run a stage logs into (`stage_run` opens it)."""
    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("no active MLflow run: the stage runs inside stage_run")
    return run.info.run_id
