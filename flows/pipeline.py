"""The pipeline flow: demo data -> base model -> evaluate base -> GRPO train -> evaluate candidate -> log.

Every stage is a nested MLflow run under one parent run; the summary this flow returns is what
`grpo-pipeline run --json` prints.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import mlflow
from prefect import flow
from prefect.runtime import flow_run

from grpo_pipeline.config import PipelineConfig, load_config
from grpo_pipeline.tracking import create_child_run, setup_tracking
from tasks.demo_task import demo_data_task
from tasks.evaluate import EvalResult, evaluate_task
from tasks.model import resolve_model_task
from tasks.train import build_job_spec, preflight, train_task


def _log_eval(result: EvalResult, name: str) -> None:
    mlflow.log_metrics({"reward": result.reward, **{f"reward/{k}": v for k, v in result.per_reward.items()}})
    columns = {k: [row[k] for row in result.rows] for k in result.rows[0]} if result.rows else {}
    mlflow.log_table(columns, artifact_file=f"{name}_samples.json")


def run_pipeline(cfg: PipelineConfig) -> dict:
    """The stages in order; called inside the Prefect flow so each task is tracked."""
    preflight(cfg)
    run_dir = cfg.data_dir / "runs" / f"{datetime.now():%Y%m%d-%H%M%S}-{(flow_run.id or 'local')[:8]}"
    exp_id = setup_tracking(cfg.mlflow_uri, cfg.tracking.experiment, cfg.data_dir / "mlartifacts")
    rewards = cfg.train.rewards
    eval_kwargs = {"max_new_tokens": cfg.evaluate.max_new_tokens, "batch_size": cfg.evaluate.batch_size}
    with mlflow.start_run(run_name="grpo-pipeline") as parent:
        mlflow.log_dict(cfg.model_dump(mode="json"), "config.json")
        with mlflow.start_run(run_name="data", nested=True):
            splits = demo_data_task(cfg.data.demo, run_dir / "data")
            mlflow.log_params({f"rows_{k}": len(Path(v).read_text().splitlines()) for k, v in splits.items()})
        with mlflow.start_run(run_name="model", nested=True):
            model_path = resolve_model_task(cfg.model, cfg.data_dir / "models")
            mlflow.log_params({"base": cfg.model.base, "path": model_path, "quantization": cfg.model.quantization})
        with mlflow.start_run(run_name="evaluate-base", nested=True):
            base = evaluate_task(model_path, cfg.model, splits["holdout"], rewards, **eval_kwargs)
            _log_eval(base, "base")

        train_run_id = create_child_run(exp_id, parent.info.run_id, "train")
        result = train_task(build_job_spec(cfg, model_path, splits, run_dir, train_run_id))

        with mlflow.start_run(run_name="evaluate-candidate", nested=True):
            trained = evaluate_task(
                model_path, cfg.model, splits["holdout"], rewards, adapter=result.adapter_dir, **eval_kwargs
            )
            _log_eval(trained, "candidate")

        summary = {
            "status": "completed",
            "mlflow": {"tracking_uri": cfg.mlflow_uri, "run_id": parent.info.run_id, "experiment_id": exp_id},
            "run_dir": str(run_dir.resolve()),
            "model": {"base": cfg.model.base, "path": model_path, "quantization": cfg.model.quantization},
            "holdout": {
                "n": base.n,
                "base_reward": base.reward,
                "trained_reward": trained.reward,
                "gain": trained.reward - base.reward,
                "base": base.per_reward,
                "trained": trained.per_reward,
            },
            "train": result.model_dump(exclude={"metrics"}) | {"metrics": result.metrics},
        }
        mlflow.log_metrics({f"holdout/{k}": summary["holdout"][k] for k in ("base_reward", "trained_reward", "gain")})
        mlflow.log_dict(summary, "summary.json")
    return summary


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(config_path: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run the GRPO pipeline.

    Args:
        config_path: pipeline YAML (e.g. configs/demo-cpu.yaml); None runs the built-in defaults.
        overrides: `stage.key=value` assignments applied on top, e.g. `train.grpo.max_steps=20`.
    """
    return run_pipeline(load_config(config_path, overrides or []))
