"""The pipeline flow: demo data -> base model -> evaluate base -> GRPO train -> evaluate candidate and
champion -> merge (when enabled) -> decide -> register and move aliases -> report.

Every stage is a nested MLflow run under one parent run; the summary this flow returns is what
`grpo-pipeline run --json` prints.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import mlflow
from prefect import flow
from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.runtime import flow_run

from grpo_pipeline.config import PipelineConfig, load_config
from grpo_pipeline.tracking import create_child_run, setup_tracking
from tasks.decide import decide_promotion
from tasks.demo_task import demo_data_task, fingerprint
from tasks.evaluate import EvalResult, evaluate_task, read_jsonl
from tasks.merge import merge_task
from tasks.model import resolve_model_task
from tasks.registry import CHAMPION, Registry
from tasks.report import artifact_url, plot_comparison, render_markdown
from tasks.train import build_job_spec, preflight, train_task


def _log_eval(result: EvalResult, name: str) -> None:
    mlflow.log_metrics({"reward": result.reward, **{f"reward/{k}": v for k, v in result.per_reward.items()},
                        **result.metrics})
    columns = {k: [row[k] for row in result.rows] for k in result.rows[0]} if result.rows else {}
    mlflow.log_table(columns, artifact_file=f"{name}_samples.json")


def _champion_eval(cfg: PipelineConfig, registry: Registry, version: str, holdout: Path, run_dir: Path):
    """Evaluate the current champion on the same holdout, on the base it was trained on."""
    mv = registry.client.get_model_version(registry.name, version)
    adapter = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(run_dir / "champion"))
    champion_model = cfg.model.model_copy(
        update={"base": mv.tags.get("base_model", cfg.model.base), "quantization": mv.tags.get("quantization", "none")}
    )
    path = resolve_model_task(champion_model, cfg.data_dir / "models")
    return evaluate_task(path, champion_model, holdout, cfg.train.rewards, cfg.evaluate, adapter=adapter)


def _version_tags(cfg: PipelineConfig, splits: dict, result, parent_run_id: str) -> dict[str, str]:
    return {
        "base_model": cfg.model.base,
        "quantization": cfg.model.quantization,
        "dataset_fingerprint": fingerprint(splits),
        "hyperparameters": json.dumps({"grpo": cfg.train.grpo, "lora": cfg.train.lora}, sort_keys=True)[:5000],
        "gpu_hours": f"{result.gpu_hours or 0:.4f}",
        "pipeline_run_id": parent_run_id,
    }


def run_pipeline(cfg: PipelineConfig) -> dict:
    """The stages in order; called inside the Prefect flow so each task is tracked."""
    preflight(cfg)
    run_dir = cfg.data_dir / "runs" / f"{datetime.now():%Y%m%d-%H%M%S}-{(flow_run.id or 'local')[:8]}"
    exp_id = setup_tracking(cfg.mlflow_uri, cfg.tracking.experiment, cfg.data_dir / "mlartifacts")
    registry = Registry(mlflow.MlflowClient(cfg.mlflow_uri), cfg.tracking.registered_model)
    rewards = cfg.train.rewards
    with mlflow.start_run(run_name="grpo-pipeline") as parent:
        mlflow.log_dict(cfg.model_dump(mode="json"), "config.json")
        with mlflow.start_run(run_name="data", nested=True):
            splits = demo_data_task(cfg.data.demo, run_dir / "data")
            mlflow.log_params({f"rows_{k}": len(Path(v).read_text().splitlines()) for k, v in splits.items()})
        with mlflow.start_run(run_name="model", nested=True):
            model_path = resolve_model_task(cfg.model, cfg.data_dir / "models")
            mlflow.log_params({"base": cfg.model.base, "path": model_path, "quantization": cfg.model.quantization})
        with mlflow.start_run(run_name="evaluate-base", nested=True):
            base = evaluate_task(model_path, cfg.model, splits["holdout"], rewards, cfg.evaluate)
            _log_eval(base, "base")

        train_run_id = create_child_run(exp_id, parent.info.run_id, "train")
        result = train_task(build_job_spec(cfg, model_path, splits, run_dir, train_run_id))

        with mlflow.start_run(run_name="evaluate-candidate", nested=True):
            trained = evaluate_task(
                model_path, cfg.model, splits["holdout"], rewards, cfg.evaluate, adapter=result.adapter_dir
            )
            _log_eval(trained, "candidate")
        decided_against = registry.version_of(CHAMPION)  # the baseline: the champion, or the base model
        champion = None
        if decided_against:
            with mlflow.start_run(run_name="evaluate-champion", nested=True):
                champion = _champion_eval(cfg, registry, decided_against, splits["holdout"], run_dir)
                _log_eval(champion, "champion")

        merged = None
        if cfg.merge.enabled:
            with mlflow.start_run(run_name="merge", nested=True) as merge_run:
                prompts = [str(r["prompt"]) for r in read_jsonl(splits["holdout"])]
                merged = merge_task(model_path, result.adapter_dir, run_dir / "merged", prompts, cfg.merge)
                mlflow.log_metric("max_logit_difference", merged["max_logit_difference"])
                mlflow.log_artifacts(merged["merged_dir"], "merged")
                merged["source"] = f"runs:/{merge_run.info.run_id}/merged"

        with mlflow.start_run(run_name="decide", nested=True):
            decision = decide_promotion(trained.rows, (champion or base).rows, cfg.promote, rewards)
            mlflow.log_dict(decision.model_dump(), "decision.json")  # logged before any alias moves
            verdict = "promote" if decision.promote else "reject"
            mlflow.set_tags({"decision": verdict})
        tags = _version_tags(cfg, splits, result, parent.info.run_id)
        if merged:
            tags["merged_source"] = merged["source"]
        version = registry.register(f"runs:/{train_run_id}/adapter", train_run_id, tags)
        moves = registry.settle(
            version, decided_against, decision.promote,
            {"decision": verdict, "decision_reasons": " | ".join(decision.reasons)[:5000]},
        )

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
                "base": base.per_reward | base.metrics,
                "trained": trained.per_reward | trained.metrics,
            }
            | ({"champion_reward": champion.reward, "champion": champion.per_reward | champion.metrics} if champion else {}),
            "train": result.model_dump(exclude={"metrics"}) | {"metrics": result.metrics},
            "merge": merged,
            "decision": decision.model_dump(),
            "registry": {
                "model": registry.name,
                "candidate_version": version,
                "decided_against": decided_against,
                "moves": [vars(m) for m in moves],
                "aliases": registry.aliases(),
            },
        }
        mlflow.log_metrics({f"holdout/{k}": summary["holdout"][k] for k in ("base_reward", "trained_reward", "gain")})
        mlflow.set_tags({"decision": verdict, "candidate_version": version})
        mlflow.log_dict(summary, "summary.json")
        _report(summary, run_dir)
    return summary


def _report(summary: dict, run_dir: Path) -> None:
    """The decision as Markdown and a chart, in MLflow and in the Prefect UI."""
    markdown = render_markdown(summary)
    mlflow.log_text(markdown, "report.md")
    mlflow.log_artifact(str(plot_comparison(summary, run_dir / "comparison.png")))
    create_markdown_artifact(markdown, key="grpo-decision", description="A/B decision of this GRPO run")
    url = artifact_url(summary["mlflow"]["tracking_uri"], summary["mlflow"]["run_id"], "comparison.png")
    if url:  # the Prefect UI loads images by URL; an MLflow server serves its artifacts by URL
        create_image_artifact(url, key="grpo-comparison", description="candidate against baseline, with the 95% CI")


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(config_path: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run the GRPO pipeline.

    Args:
        config_path: pipeline YAML (e.g. configs/demo-cpu.yaml); None runs the built-in defaults.
        overrides: `stage.key=value` assignments applied on top, e.g. `train.grpo.max_steps=20`.
    """
    return run_pipeline(load_config(config_path, overrides or []))
