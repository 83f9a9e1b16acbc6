"""The run's record: the summary, the decision's report (Markdown) and the comparison chart in MLflow and in the
Prefect UI, the headline metrics that compare runs in MLflow's table; and the record of a run that ended after
the data stage (`skipped`: nothing new since the champion)."""

from __future__ import annotations

from pathlib import Path

import mlflow

from grpo_pipeline.configs.schema import PipelineConfig
from grpo_pipeline.flows.artifacts import show_image, show_markdown
from grpo_pipeline.tasks.data.stage import DatasetVersion
from grpo_pipeline.tasks.job import WarmStart
from grpo_pipeline.tasks.promote.decide import PromotionDecision
from grpo_pipeline.tasks.report import artifact_url, plot_comparison, render_markdown, render_skipped
from grpo_pipeline.tasks.summary import BaseChoice, Holdout, MlflowRef, RegistryOutcome, RunSummary
from grpo_pipeline.trainer.spec import TrainResult


def skipped(
    reason: str,
    cfg: PipelineConfig,
    pid: str,
    experiment_id: str,
    run_dir: Path,
    dataset: DatasetVersion,
    base: BaseChoice,
    cfg_hash: str,
    warm_start: WarmStart | None,
) -> RunSummary:
    """The summary of a run that ends after the data stage; its reason in the MLflow run and the Prefect UI."""
    print(f"skipped: {reason}")
    summary = RunSummary(
        status="skipped",
        skipped_reason=reason,
        mlflow=MlflowRef(tracking_uri=cfg.mlflow_uri, run_id=pid, experiment_id=experiment_id),
        run_dir=str(run_dir.resolve()),
        data={"fingerprint": dataset.fingerprint, **dataset.report.model_dump(mode="json")},
        model=base,
        warm_start=warm_start,
        config_hash=cfg_hash,
    )
    mlflow.set_tags({"status": "skipped", "skipped_reason": reason[:5000]})
    mlflow.log_dict(summary.model_dump(mode="json"), "summary.json")
    markdown = render_skipped(reason)
    mlflow.log_text(markdown, "report.md")
    show_markdown(markdown, key="grpo-decision", description="this GRPO run was skipped: nothing new")
    return summary


def _completed(summary: RunSummary) -> tuple[Holdout, PromotionDecision, RegistryOutcome, TrainResult]:
    """A completed run's holdout, decision, registry outcome and training result; a skipped run has none."""
    holdout, decision, outcome, train = summary.holdout, summary.decision, summary.registry, summary.train
    if holdout is None or decision is None or outcome is None or train is None:
        raise ValueError(
            f"run {summary.mlflow.run_id} ({summary.status}) has no holdout, decision or training to report"
        )
    return holdout, decision, outcome, train


def report(summary: RunSummary, run_dir: Path) -> None:
    """The summary and the decision, as JSON, Markdown and a chart, in MLflow and in the Prefect UI."""
    holdout, decision, outcome, _ = _completed(summary)
    mlflow.log_metrics(headline_metrics(summary))
    mlflow.log_dict(summary.model_dump(mode="json"), "summary.json")
    markdown = render_markdown(
        holdout,
        decision,
        outcome,
        summary.warm_start,
        summary.rows,
        train=summary.train,
        drift=summary.drift,
        cold_start=summary.cold_start,
    )
    mlflow.log_text(markdown, "report.md")
    chart = plot_comparison(holdout.baseline, holdout.trained, decision.stats, run_dir / "comparison.png")
    mlflow.log_artifact(str(chart))
    show_markdown(markdown, key="grpo-decision", description="A/B decision of this GRPO run")
    url = artifact_url(summary.mlflow.tracking_uri, summary.mlflow.run_id, "comparison.png")
    if url:  # the Prefect UI loads images by URL; an MLflow server serves its artifacts by URL
        show_image(url, key="grpo-comparison", description="candidate against baseline, with the 95% CI")


def headline_metrics(summary: RunSummary) -> dict[str, float]:
    """The parent run's metrics, for comparing runs in the MLflow UI's table."""
    holdout, decision, outcome, train = _completed(summary)
    out: dict[str, float] = {}
    for model, reward, values in (
        ("base", holdout.base_reward, holdout.base),
        ("candidate", holdout.trained_reward, holdout.trained),
        ("champion", holdout.champion_reward, holdout.champion),
    ):
        if reward is not None and values is not None:  # the champion's: both or neither
            out |= {f"holdout/{model}_reward": reward, **{f"holdout/{model}/{k}": v for k, v in values.items()}}
    out |= {
        "holdout/gain": holdout.gain,
        "promoted": float(decision.promote),
        "serving_check_passed": float(outcome.serving_check.passed),
        "train/global_step": train.global_step,
        "train/runtime_s": train.train_runtime_s,
        **{f"seconds/{stage}": seconds for stage, seconds in summary.timings.items()},  # where the run's time went
    }
    # the names earlier runs used, so they stay comparable
    out |= {"holdout/base_reward": holdout.base_reward, "holdout/trained_reward": holdout.trained_reward}
    return out
