"""The pipeline flow: data -> base model (selection, quantization cost) -> plan and budget guard ->
hyperparameter search (when enabled) -> evaluate base -> GRPO train -> evaluate candidate and champion ->
merge (when enabled) -> decide -> register (MLflow models: the adapter on a base anyone can load, the merged
model) -> serving check (a clean process loads the version by its registry URI) -> move aliases -> report.

The task check (`check.*`) runs after the model stage: a task with no group GRPO could learn from ends the run
there, before the search and training.

`run_pipeline` reads as that outline: each stage a call that takes typed values and returns a typed result,
each in its own nested MLflow run under one parent run (`grpo_pipeline.flows.runs`); what a stage does inside its
run (call its task, log what it found) is in `grpo_pipeline.flows.stages`, one module per part of the outline.
The `RunSummary` it returns is what `grpo-pipeline run --json` prints and what the report renders.

Daily retraining (docs/operations.md): `model.init_adapter` continues an existing adapter (`warm_start_stage`,
resolved and checked before any work); `data.skip_unchanged` ends a run after the data stage when the champion
was trained on these rows with this configuration (`status: "skipped"`); `data.incremental` trains on the rows
the parent's lineage has not seen plus a replayed share (`train_rows_stage`); `drift_stage` logs how today's new
rows differ from the champion's (`data.drift_alert` marks a drop of its reward on them).

A retried flow run (the Prefect UI's Retry, or a flow-level retry) resumes after its last completed
stage: the expensive stages are cached on their inputs and the flow run id, with results persisted, and
the retry reuses the same run directory, MLflow parent run and stage runs, and model version.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import mlflow
from prefect import flow
from prefect.runtime import flow_run

from grpo_pipeline.configs.launchers import LauncherChoice
from grpo_pipeline.configs.schema import PipelineConfig
from grpo_pipeline.flows import trigger
from grpo_pipeline.flows.hpo import search_stage
from grpo_pipeline.flows.preflight import preflight
from grpo_pipeline.flows.runs import parent_run, setup_tracking, stage_run, timed
from grpo_pipeline.flows.stages.check import check_stage
from grpo_pipeline.flows.stages.daily import (
    HOLDOUT_TAG,
    drift_stage,
    record_seen,
    seen_keys,
    train_rows_stage,
    unchanged_stage,
)
from grpo_pipeline.flows.stages.evaluate import champion_stage, evaluate_stage
from grpo_pipeline.flows.stages.prepare import data_stage, log_resolved_config, model_stage, plan_stage
from grpo_pipeline.flows.stages.promote import (
    blocked_unless_served,
    decide_stage,
    merge_stage,
    promote_stage,
    register_stage,
    serving_stage,
)
from grpo_pipeline.flows.stages.report import report, skipped
from grpo_pipeline.flows.stages.train import month_stage, train_stage
from grpo_pipeline.flows.warm_start import cold_start_note, lineage_tags, warm_start_stage
from grpo_pipeline.tasks.data.shape import task_rewards
from grpo_pipeline.tasks.data.stage import config_hash
from grpo_pipeline.tasks.hpo import apply_best
from grpo_pipeline.tasks.plan import Plan, apply_plan
from grpo_pipeline.tasks.promote.registry import CHAMPION, Registry
from grpo_pipeline.tasks.summary import BaseChoice, Holdout, MlflowRef, RunSummary, Search
from grpo_pipeline.trainer.offline import import_bitsandbytes_offline


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    launcher: LauncherChoice = "config",
    budget_usd: float | None = None,
) -> RunSummary:
    """Run the GRPO pipeline: data, base model, training, evaluation, A/B decision, registry.

    Args:
        config_path: pipeline YAML, relative to the project (e.g. configs/demo-cpu.yaml); empty runs the
            built-in defaults. A run of a deployment may pick only the deployment's own config or one of
            its `deploy.trigger.recipes`.
        overrides: `section.key=value` assignments applied on top, one per item, e.g. `train.grpo.max_steps=20`,
            `train.grpo.learning_rate=3e-4`, `train.lora.r=16`. A run of a deployment may set only the fields the
            deployment allows (`deploy.trigger.allow`; by default train.grpo.max_steps, train.grpo.learning_rate,
            train.grpo.seed, train.lora.r, train.lora.lora_alpha, train.launcher, plan.budget_usd); any other
            field fails the run before any work (docs/security.md). The rest (model, data, paths, code) comes from
            the deployment's config, or from `grpo-pipeline run --set` on the worker's shell, which takes any key
            of the sections data, model, plan, hpo, train, evaluate, merge, promote, tracking, deploy
            (`grpo-pipeline config` prints every key).
        launcher: where training runs: `local` (a subprocess on the worker) or `sky` (a SkyPilot managed
            spot job); `config` keeps the config's `train.launcher`.
        budget_usd: refuse to train when the planner's cost estimate passes this many dollars; empty keeps
            the config's `plan.budget_usd`.
    """
    # A run triggered through a deployment may set only what the deployment allows: checked on the raw fields,
    # before the config file is read or anything runs (docs/security.md). A refusal is logged as its message.
    with trigger.refusals_logged_plainly():
        cfg = trigger.checked_config(config_path, flow_overrides(overrides, launcher, budget_usd), deployment_overrides)
        cfg = task_rewards(cfg)  # `auto`: the skill reward the source's answers need
        priced = preflight(cfg)
    return run_pipeline(cfg, priced)


def checked_pipeline(
    cfg: PipelineConfig, priced: Plan | None, config_path: str | None, overrides: list[str]
) -> RunSummary:
    """The pipeline flow on a configuration loaded and preflighted already (`grpo-pipeline run` does both before
    a flow run exists, so a refused input leaves none behind): the checks do not run twice, nor the budget's
    plan (`priced`: what preflight returned).

    The flow run records what was asked (`config_path`, `overrides`), as a deployment's run does; the checked
    values reach it by closure, never as parameters: Prefect sends parameters as strict JSON, which a plan's
    NaN (a GPU refused before any memory estimate) or a config's infinity would fail."""

    @flow(name="grpo-pipeline", log_prints=True)
    def grpo_pipeline_checked(config_path: str | None = None, overrides: list[str] | None = None) -> RunSummary:
        return run_pipeline(cfg, priced)

    return grpo_pipeline_checked(config_path=config_path, overrides=overrides)


def run_pipeline(cfg: PipelineConfig, priced: Plan | None = None) -> RunSummary:
    """The stages in order on a preflighted config (`priced`: the plan its preflight priced the budget with);
    called inside the Prefect flow so each task is tracked. `cfg` is the config as given; each stage that
    changes it returns a new value under its own name: `selected` (the base model chosen), `planned` (the
    plan's batch split and GPUs), `tuned` (the search's best values), which is what trains."""
    import_bitsandbytes_offline()  # before any stage imports peft: no hub lookup for code (trainer/offline.py)
    clock: dict[str, float] = {}  # wall seconds by stage, in the order they ran (the summary's `timings`)
    run_dir = _run_dir(cfg)
    with timed(clock, "setup"):
        experiment_id = setup_tracking(cfg.mlflow_uri, cfg.tracking.experiment, cfg.data_dir / "mlartifacts")
        registry = Registry(mlflow.MlflowClient(cfg.mlflow_uri), cfg.tracking.registered_model)
        # before any work: a missing champion, an unknown URI, another base or LoRA shape end the run here (exit 2)
        warm_start = warm_start_stage(cfg, registry, run_dir)
    cold_start = cold_start_note(cfg, warm_start)  # champion_or_base with no champion yet: said, not refused
    if warm_start is not None:
        print(f"warm start: continuing {warm_start.parent} ({warm_start.uri})")
    elif cold_start:
        print(f"warm start: {cold_start}")
    cfg_hash = config_hash(cfg)  # as configured, before the plan and the search fill fields in
    with parent_run(flow_run.id or "local", "grpo-pipeline", flow_run.scheduled_start_time) as parent:
        pid = parent.info.run_id
        mlflow.set_tags(
            {"config_hash": cfg_hash, **lineage_tags(warm_start), **({"cold_start": cold_start} if cold_start else {})}
        )
        with stage_run(pid, "data", clock):
            dataset, base_path = data_stage(cfg)
        base_choice = BaseChoice(base=cfg.model.base, path=base_path, quantization=cfg.model.quantization)
        if cfg.data.skip_unchanged and (reason := unchanged_stage(registry, dataset, cfg_hash)):
            return skipped(reason, cfg, pid, experiment_id, run_dir, dataset, base_choice, cfg_hash, warm_start)
        # the warm start's registered version: the keys its lineage trained on and was judged on
        lineage_model, lineage_version = (warm_start.model, warm_start.version) if warm_start else (None, None)
        seen = seen_keys(registry, lineage_model, lineage_version)
        with timed(clock, "rows"):
            splits, rows = train_rows_stage(
                cfg, dataset, seen, run_dir, seen_keys(registry, lineage_model, lineage_version, tag=HOLDOUT_TAG)
            )
        with timed(clock, "drift"):
            drift = drift_stage(cfg, registry, dataset, run_dir, pid)
        with stage_run(pid, "model", clock):
            selected, model_path = model_stage(cfg, base_path, splits["val"])
        task_check = None
        # can GRPO learn it on this base? too_hard ends the run here (check.on_too_hard). A run that continues an
        # adapter (warm start) starts from what it learned, not from the base the check samples: no check
        if selected.check.enabled and warm_start is None:
            with stage_run(pid, "task-check", clock):
                task_check = check_stage(selected, dataset, model_path)
        with stage_run(pid, "plan", clock):  # preflight's plan holds while the base is the configured one
            plan = plan_stage(selected, model_path, priced if selected.model == cfg.model else None)
        planned = apply_plan(selected, plan)
        search = None
        if planned.hpo.enabled:
            with stage_run(pid, "hpo", clock) as run:
                search = search_stage(
                    planned,
                    model_path,
                    splits,
                    run_dir,
                    experiment_id,
                    run.info.run_id,
                    warm_start,
                    train_usd=plan.estimate.usd,
                )
        tuned = apply_best(planned, search.overrides) if search else planned
        log_resolved_config(tuned, dataset, model_path)  # what trains is what the run shows
        with stage_run(pid, "evaluate-base", clock):
            base = evaluate_stage(tuned, model_path, splits["holdout"], "base", baseline=True)
        with timed(clock, "train"):
            result, cost = train_stage(
                tuned, model_path, splits, run_dir, dataset, plan, warm_start, experiment_id, pid
            )
        month = month_stage(tuned, experiment_id, plan)
        with stage_run(pid, "evaluate-candidate", clock):
            trained = evaluate_stage(tuned, model_path, splits["holdout"], "candidate", adapter=result.adapter_dir)
        champion_version = registry.version_of(CHAMPION)  # the baseline: the champion, or the base model
        champion = None
        if champion_version:
            with stage_run(pid, "evaluate-champion", clock):
                champion = champion_stage(tuned, registry, champion_version, splits["holdout"], run_dir)
        merged = None
        if tuned.merge.enabled:
            with stage_run(pid, "merge", clock) as run:
                merged = merge_stage(tuned, model_path, result, splits["holdout"], run_dir, run.info.run_id)
        with stage_run(pid, "decide", clock):
            decision = decide_stage(tuned, trained, champion or base)
        with stage_run(pid, "register", clock):
            lineage = {"config_hash": cfg_hash, **lineage_tags(warm_start), **record_seen(seen, splits)}
            registered = register_stage(
                tuned, registry, dataset, model_path, result, merged, pid, splits["holdout"], lineage
            )
        with stage_run(pid, "serving-check", clock):
            check = serving_stage(tuned, registry, registered, splits["holdout"], trained)
        decision = blocked_unless_served(decision, check)
        with timed(clock, "promote"):
            outcome = promote_stage(registry, registered, champion_version, decision, check, cfg.promote.mode)
        summary = RunSummary(
            mlflow=MlflowRef(tracking_uri=tuned.mlflow_uri, run_id=pid, experiment_id=experiment_id),
            run_dir=str(run_dir.resolve()),
            data={"fingerprint": dataset.fingerprint, **dataset.report.model_dump(mode="json")},
            model=BaseChoice(base=tuned.model.base, path=model_path, quantization=tuned.model.quantization),
            warm_start=warm_start,
            cold_start=cold_start,
            task_check=task_check,
            rows=rows,
            drift=drift,
            config_hash=cfg_hash,
            skill_choice=next(
                ({"reward": e.name, "why": e.chosen_by} for e in tuned.train.rewards if e.chosen_by), None
            ),
            holdout=Holdout.of(base, trained, champion, tuned.train.reward_set().skill),
            train=result,
            plan=plan.summary(),
            cost=cost,
            month=month,
            hpo=Search.of(search) if search else None,
            merge=merged,
            decision=decision,
            registry=outcome,
            timings=clock,
        )
        print("time by stage: " + ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in clock.items()))
        report(summary, run_dir)
    return summary


# ------------------------------------------------------------------------------------------------ inputs


def _run_dir(cfg: PipelineConfig) -> Path:
    """One directory per flow run, the same for every retry of it."""
    started = flow_run.scheduled_start_time or datetime.now()
    return cfg.data_dir / "runs" / f"{started:%Y%m%d-%H%M%S}-{(flow_run.id or 'local')[:8]}"


def flow_overrides(overrides: list[str] | None, launcher: str | None, budget_usd: float | None) -> list[str]:
    """The flow's form fields as config overrides, applied after the user's own.

    >>> flow_overrides(["train.grpo.max_steps=5"], "sky", 40.0)
    ['train.grpo.max_steps=5', 'train.launcher=sky', 'plan.budget_usd=40.0']
    >>> flow_overrides(None, "config", None)
    []
    """
    extra = [f"train.launcher={launcher}"] if launcher and launcher != "config" else []
    extra += [f"plan.budget_usd={budget_usd}"] if budget_usd is not None else []
    return [*(overrides or []), *extra]


def deployment_overrides(parameters: dict[str, Any]) -> list[str]:
    """A deployment's own parameters as the overrides they make, to compare with a run's.

    >>> deployment_overrides({"config_path": "c.yaml", "overrides": ["train.lora.r=8"], "budget_usd": 25.0})
    ['train.lora.r=8', 'plan.budget_usd=25.0']
    """
    return flow_overrides(parameters.get("overrides"), parameters.get("launcher"), parameters.get("budget_usd"))
