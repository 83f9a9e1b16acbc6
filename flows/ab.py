"""The `ab-decide` flow: the live A/B's decision on a schedule (flows/prefect.yaml: `ab-decide/hourly`).

Each run does what `grpo-pipeline ab decide` does, through the same functions (grpo_pipeline.tasks.serve.ab_apply):
read the aliases and the request log, decide with the pure `grpo_pipeline.tasks.serve.ab.decide`, and for
`promote` or `rollback` move the aliases under the registry lock. Each decision is recorded before anything
moves, as an MLflow run in the experiment `<tracking.experiment>-ab` (the statistics as metrics, the versions
and `ab.*` settings as params, the action as the tag `ab_action`, the report and the score-over-time chart as
artifacts) and as a Prefect Markdown artifact (`ab-decision`). With no challenger alias it records nothing
and ends: an hourly schedule runs quietly between tests.

The aliases moving between the decision and the lock (a new canary candidate replaced the challenger) is not
a failure: nothing moves, the run's tag `ab_applied` says `aliases-moved`, and the next run decides on the
new versions.
"""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from grpo_pipeline.configs.schema import PipelineConfig
from grpo_pipeline.flows import trigger
from grpo_pipeline.flows.artifacts import show_image, show_markdown
from grpo_pipeline.flows.retries import registry_task
from grpo_pipeline.flows.runs import setup_tracking
from grpo_pipeline.tasks.promote.registry import Registry
from grpo_pipeline.tasks.promote.registry_client import open_client
from grpo_pipeline.tasks.report import artifact_url
from grpo_pipeline.tasks.serve.ab import AliasesMoved
from grpo_pipeline.tasks.serve.ab_apply import Round, decide_round, settle_round
from grpo_pipeline.tasks.serve.ab_log import RequestLog, log_url
from grpo_pipeline.tasks.serve.ab_report import (
    Outcomes,
    decision_metrics,
    decision_params,
    plot_series,
    read_outcomes,
    render_decision,
    series,
)

FLOW_NAME = "ab-decide"


def experiment_name(cfg: PipelineConfig) -> str:
    """Decisions go beside the training runs' experiment, not into it: an hourly run would crowd its table."""
    return f"{cfg.tracking.experiment}-ab"


def _registry(cfg: PipelineConfig) -> Registry:
    return Registry(open_client(cfg.mlflow_uri), cfg.tracking.registered_model)


@registry_task("ab-read-and-decide")
def decide_task(cfg: PipelineConfig) -> tuple[Round, Outcomes | None]:
    log = RequestLog.open(log_url(cfg.data_dir))
    try:
        found = decide_round(cfg.ab, log, _registry(cfg), cfg.promote.mode == "canary")
        outcomes = read_outcomes(log, found.champion, found.decided()[1]) if found.decision else None
    finally:
        log.close()
    return found, outcomes


@registry_task("ab-settle")
def settle_round_task(cfg: PipelineConfig, found: Round) -> Round:
    """The aliases the round's decision calls for, moved under the registry lock."""
    return settle_round(_registry(cfg), found)


def record(cfg: PipelineConfig, found: Round, outcomes: Outcomes, workdir: Path) -> str:
    """Open the decision's MLflow run and log what was decided (before anything moves); returns its id."""
    setup_tracking(cfg.mlflow_uri, experiment_name(cfg), cfg.data_dir / "mlartifacts")
    decision, _ = found.decided()
    now = datetime.now(UTC)
    run = mlflow.start_run(
        run_name=f"ab-decide {now:%Y-%m-%d %H:%M} {decision.action}",
        tags={
            "ab_action": decision.action,
            "ab_champion": str(found.champion),
            "ab_challenger": str(found.challenger),
            "ab_breaches": ",".join(decision.breaches),
            "ab_reasons": "; ".join(decision.reasons)[:5000],
            "prefect_flow_run_id": flow_run.id or "local",
            "pipeline": FLOW_NAME,
        },
    )
    mlflow.log_params(decision_params(found, cfg.ab))
    mlflow.log_metrics(decision_metrics(found))
    mlflow.log_dict(found.as_json(), "decision.json")
    points = series(outcomes, cfg.ab)
    if points:
        mlflow.log_artifact(str(plot_series(points, workdir / "ab_scores.png")))
    return run.info.run_id


@flow(name=FLOW_NAME, log_prints=True)
def ab_decide(config_path: str | None = None, overrides: list[str] | None = None) -> dict:
    """Decide the live A/B between the registry's `champion` and `challenger` from the request log; promote
    or roll back under the registry lock.

    Args:
        config_path: pipeline YAML (its `ab.*`, `tracking.*` and `data_dir` are read); empty: the built-in
            defaults. A run of a deployment may pick only the deployment's own config or its recipes.
        overrides: `section.key=value` assignments on top. A run of a deployment may set only the fields the
            deployment allows (`deploy.trigger.allow`, which by default lists no `ab.*` field: add e.g. ab.alpha
            there and deploy again, then a run may set `ab.alpha=0.01`; docs/security.md).
    """
    logger = get_run_logger()
    with trigger.refusals_logged_plainly():
        cfg = trigger.checked_config(
            config_path, list(overrides or []), lambda params: list(params.get("overrides") or [])
        )
    found, outcomes = decide_task(cfg)
    if found.decision is None:
        logger.info("; ".join(found.reasons))
        return found.as_json()
    if outcomes is None:  # decide_task reads the outcomes whenever the round decided something
        raise RuntimeError("ab-read-and-decide returned a decision without its outcomes; nothing was recorded")
    applied = "failed"
    with tempfile.TemporaryDirectory() as workdir:
        run_id = record(cfg, found, outcomes, Path(workdir))
        try:
            found = settle_round_task(cfg, found)
            applied = "yes"
        except AliasesMoved as exc:
            logger.warning(f"{exc}: nothing moved; the next run decides on the new versions")
            applied = "aliases-moved"
        finally:
            mlflow.set_tags({"ab_applied": applied, "ab_moves": "; ".join(found.moves)})
            markdown = render_decision(found, series(outcomes, cfg.ab), outcomes.start)
            if applied == "aliases-moved":
                markdown += "\nNot applied: the aliases moved since the log was read; the next run decides again.\n"
            mlflow.log_text(markdown, "decision.md")
            mlflow.end_run(status="FINISHED" if applied != "failed" else "FAILED")
    show_markdown(markdown, key="ab-decision", description="the live A/B's decision")
    if url := artifact_url(cfg.mlflow_uri, run_id, "ab_scores.png"):
        show_image(url, key="ab-scores", description="the arms' mean score over time, with intervals")
    logger.info(f"A/B decision: {found.action}; moves: {found.moves or 'none'}; MLflow run {run_id}")
    return {**found.as_json(), "mlflow_run_id": run_id, "applied": applied}
