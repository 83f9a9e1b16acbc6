"""The hyperparameter search alone, as a Prefect flow: data -> base model -> study (`grpo-pipeline hpo`).

The pipeline flow runs the same `hpo_task` before training when `hpo.enabled` is set; this flow is for
searching without training, e.g. to compare search spaces or to resume a study.
"""

from __future__ import annotations

from datetime import datetime

from prefect import flow
from prefect.runtime import flow_run

from configs.schema import load_config
from tasks.data import data_task
from tasks.hpo import hpo_task
from tasks.model import resolve_model_task
from tasks.train import preflight


@flow(name="grpo-hpo", log_prints=True)
def hpo_flow(config_path: str | None = None, overrides: list[str] | None = None) -> dict:
    """Search hyperparameters and return the best as overrides for the training stage.

    Args:
        config_path: pipeline YAML (e.g. configs/demo-cpu.yaml); None runs the built-in defaults.
        overrides: `stage.key=value` assignments applied on top, e.g. `hpo.trials=12`.
    """
    cfg = load_config(config_path, overrides or [])
    preflight(cfg)
    run_dir = cfg.data_dir / "runs" / f"{datetime.now():%Y%m%d-%H%M%S}-{(flow_run.id or 'local')[:8]}-hpo"
    model_path = resolve_model_task(cfg.model, cfg.data_dir / "models")
    dataset = data_task(cfg.data, cfg.data_dir / "datasets", model_path, cfg.train.rewards)  # as the pipeline does
    result = hpo_task(cfg, model_path, dataset.splits, run_dir)
    return result.model_dump(mode="json") | {"set": result.set_args(), "mlflow_tracking_uri": cfg.mlflow_uri}
