"""The pipeline flow: data -> base model (selection, quantization cost) -> plan and budget guard ->
hyperparameter search (when enabled) -> evaluate base -> GRPO train -> evaluate candidate and champion ->
merge (when enabled) -> decide -> register (MLflow models: the adapter on a base anyone can load, the merged
model) -> serving check (a clean process loads the version by its registry URI) -> move aliases -> report.

`run_pipeline` reads as that outline: each stage a call that takes typed values and returns a typed result,
each in its own nested MLflow run under one parent run (`grpo_pipeline.flows.runs`). The `RunSummary` it returns is what
`grpo-pipeline run --json` prints and what the report renders.

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

import json
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlflow
from prefect import flow, task
from prefect.cache_policies import INPUTS, NO_CACHE, RUN_ID, TASK_SOURCE
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from grpo_pipeline.configs.launchers import LAUNCHERS, LauncherChoice
from grpo_pipeline.configs.library_fields import default as library_default
from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ModelConfig, PipelineConfig, TrainConfig
from grpo_pipeline.flows import trigger
from grpo_pipeline.flows.artifacts import show_image, show_markdown
from grpo_pipeline.flows.hpo import search_stage
from grpo_pipeline.flows.preflight import preflight
from grpo_pipeline.flows.retries import registry_task
from grpo_pipeline.flows.runs import (
    experiment,
    log_dataset_inputs,
    parent_run,
    setup_tracking,
    stage_run,
    stage_run_for_another_process,
    system_metrics_of,
)
from grpo_pipeline.flows.warm_start import lineage_tags, warm_start_stage
from grpo_pipeline.infra.launch import make_launcher, run_job
from grpo_pipeline.tasks.data.drift import (
    Drift,
    NewAndSeen,
    assess,
    drift_metrics,
    judged_totals,
    not_measured,
    plot_drift,
    reward_drop,
    split_rows,
)
from grpo_pipeline.tasks.data.stage import (
    HOLDOUT_KEYS_FILE,
    SEEN_KEYS_FILE,
    DatasetVersion,
    config_hash,
    data_task,
    incremental_split,
    jsonl_line,
    log_lineage,
    split_keys,
    unchanged_reason,
)
from grpo_pipeline.tasks.evaluate import EvalResult, evaluate_task, read_jsonl
from grpo_pipeline.tasks.hpo import apply_best
from grpo_pipeline.tasks.job import (
    TrainProgress,
    WarmStart,
    build_job_spec,
)
from grpo_pipeline.tasks.model import resolve_model_task
from grpo_pipeline.tasks.plan import Plan, actual_cost, apply_plan, check_budget
from grpo_pipeline.tasks.plan.task import plan_task
from grpo_pipeline.tasks.promote.decide import PromotionDecision, decide_promotion
from grpo_pipeline.tasks.promote.download import download
from grpo_pipeline.tasks.promote.merge import merge_task
from grpo_pipeline.tasks.promote.registry import (
    CHAMPION,
    MERGED_VERSION_TAG,
    Registry,
    RegistryError,
)
from grpo_pipeline.tasks.promote.serving import (
    BASE_EXPERIMENT,
    ServingCheck,
    base_reference,
    find_logged_model,
    log_adapter_model,
    log_merged_model,
    prompt_text,
    serving_check,
)
from grpo_pipeline.tasks.quantize import quantization_cost_task, require_accepted
from grpo_pipeline.tasks.report import artifact_url, drift_lines, plot_comparison, render_markdown, render_skipped
from grpo_pipeline.tasks.select import select_task
from grpo_pipeline.tasks.summary import (
    AliasChange,
    BaseChoice,
    Cost,
    Holdout,
    Merged,
    MlflowRef,
    MonthCost,
    Registered,
    RegistryOutcome,
    RunSummary,
    Search,
    TrainRows,
)
from grpo_pipeline.trainer.spec import JobSpec, TrainResult


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
    # Resolved once: training, every evaluation, the search, base selection and the quantization cost all
    # score by this value's weighted total, so no stage ranks models by a sum the training did not optimise.
    rewards = cfg.train.reward_set()
    run_dir = _run_dir(cfg)
    experiment_id = setup_tracking(cfg.mlflow_uri, cfg.tracking.experiment, cfg.data_dir / "mlartifacts")
    registry = Registry(mlflow.MlflowClient(cfg.mlflow_uri), cfg.tracking.registered_model)
    # before any work: a missing champion, an unknown URI, another base or LoRA shape end the run here (exit 2)
    warm_start = warm_start_stage(cfg, registry, run_dir)
    cfg_hash = config_hash(cfg)  # as configured, before the plan and the search fill fields in
    with parent_run(flow_run.id or "local", "grpo-pipeline", flow_run.scheduled_start_time) as parent:
        pid = parent.info.run_id
        mlflow.set_tags({"config_hash": cfg_hash, **lineage_tags(warm_start)})
        with stage_run(pid, "data"):
            dataset, base_path = data_stage(cfg, rewards)
        base_choice = BaseChoice(base=cfg.model.base, path=base_path, quantization=cfg.model.quantization)
        if cfg.data.skip_unchanged and (reason := unchanged_stage(registry, dataset, cfg_hash)):
            return skipped(reason, cfg, pid, experiment_id, run_dir, dataset, base_choice, cfg_hash, warm_start)
        # the warm start's registered version: the keys its lineage trained on and was judged on
        lineage_model, lineage_version = (warm_start.model, warm_start.version) if warm_start else (None, None)
        seen = seen_keys(registry, lineage_model, lineage_version)
        splits, rows = train_rows_stage(
            cfg, dataset, seen, run_dir, seen_keys(registry, lineage_model, lineage_version, tag=HOLDOUT_TAG)
        )
        drift = drift_stage(cfg, rewards, registry, dataset, run_dir, pid)
        with stage_run(pid, "model"):
            selected, model_path = model_stage(cfg, rewards, base_path, splits["val"])
        with stage_run(pid, "plan"):  # preflight's plan holds while the base is the configured one
            plan = plan_stage(selected, model_path, priced if selected.model == cfg.model else None)
        planned = apply_plan(selected, plan)
        search = None
        if planned.hpo.enabled:
            with stage_run(pid, "hpo") as run:
                search = search_stage(
                    planned,
                    rewards,
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
        with stage_run(pid, "evaluate-base"):
            base = evaluate_stage(tuned, rewards, model_path, splits["holdout"], "base")
        train_run = stage_run_for_another_process(experiment_id, pid, "train")
        spec = build_job_spec(
            tuned.train,
            tuned.model,
            model_path,
            splits,
            run_dir,
            mlflow_tracking_uri=tuned.mlflow_uri,
            mlflow_experiment=tuned.tracking.experiment,
            mlflow_run_id=train_run,
            init_adapter=warm_start.adapter_dir if warm_start else None,
        )
        log_dataset_inputs(train_run, dataset)
        result = _resumable(train_task)(spec, tuned.train)
        cost = Cost(cost_usd_estimated=plan.estimate.usd, cost_usd_actual=actual_cost(result.gpu_hours, plan))
        mlflow.log_metrics(cost.model_dump())
        month = month_stage(tuned, experiment_id, plan)
        with stage_run(pid, "evaluate-candidate"):
            trained = evaluate_stage(
                tuned, rewards, model_path, splits["holdout"], "candidate", adapter=result.adapter_dir
            )
        champion_version = registry.version_of(CHAMPION)  # the baseline: the champion, or the base model
        champion = None
        if champion_version:
            with stage_run(pid, "evaluate-champion"):
                champion = champion_stage(tuned, rewards, registry, champion_version, splits["holdout"], run_dir)
        merged = None
        if tuned.merge.enabled:
            with stage_run(pid, "merge") as run:
                merged = merge_stage(tuned, model_path, result, splits["holdout"], run_dir, run.info.run_id)
        with stage_run(pid, "decide"):
            decision = decide_stage(tuned, rewards, trained, champion or base)
        with stage_run(pid, "register"):
            lineage = {"config_hash": cfg_hash, **lineage_tags(warm_start), **record_seen(seen, splits)}
            registered = register_stage(
                tuned, registry, dataset, model_path, result, merged, pid, splits["holdout"], lineage
            )
        with stage_run(pid, "serving-check"):
            check = serving_stage(tuned, registry, registered, splits["holdout"], trained)
        decision = blocked_unless_served(decision, check)
        outcome = promote_stage(registry, registered, champion_version, decision, check, cfg.promote.mode)
        summary = RunSummary(
            mlflow=MlflowRef(tracking_uri=tuned.mlflow_uri, run_id=pid, experiment_id=experiment_id),
            run_dir=str(run_dir.resolve()),
            data={"fingerprint": dataset.fingerprint, **dataset.report.model_dump(mode="json")},
            model=BaseChoice(base=tuned.model.base, path=model_path, quantization=tuned.model.quantization),
            warm_start=warm_start,
            rows=rows,
            drift=drift,
            config_hash=cfg_hash,
            holdout=Holdout.of(base, trained, champion),
            train=result,
            plan=plan.summary(),
            cost=cost,
            month=month,
            hpo=Search.of(search) if search else None,
            merge=merged,
            decision=decision,
            registry=outcome,
        )
        report(summary, run_dir)
    return summary


# ------------------------------------------------------------------------------------------------ stages
# Each runs inside its stage's MLflow run, opened by `run_pipeline`.


def _active_run_id() -> str:
    """The MLflow run a stage logs into (`stage_run` opens it)."""
    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("no active MLflow run: the stage runs inside stage_run")
    return run.info.run_id


# Within one flow run, a stage whose inputs and code are unchanged returns its persisted result, so a
# retry does no second data pass, training or evaluation. A new flow run computes everything afresh.
RESUMABLE = INPUTS + TASK_SOURCE + RUN_ID


def _resumable(stage):
    return stage.with_options(cache_policy=RESUMABLE, persist_result=True)


def data_stage(cfg: PipelineConfig, rewards: RewardSet) -> tuple[DatasetVersion, str]:
    """The dataset version (its verifiability check runs `rewards`' answer checkers with their arguments), and
    the configured base resolved (its tokenizer counts the token budget)."""
    base_path = resolve_model_task(cfg.model, cfg.data_dir / "models")
    # Versions are content-keyed under one directory, so a run on unchanged data reuses the last one.
    dataset = data_task(cfg.data, cfg.data_dir / "datasets", base_path, list(rewards.names), dict(rewards.args))
    log_lineage(dataset)
    return dataset, base_path


# ------------------------------------------------------------------------------------------------ daily retraining


HOLDOUT_TAG = "holdout_keys"


def seen_keys(registry: Registry, model: str | None, version: str | None, tag: str = "seen_keys") -> set[str] | None:
    """The train keys version `version`'s lineage trained on (its `seen_keys` tag's artifact), or with
    `tag=HOLDOUT_TAG` the holdout keys it was judged on; None when it recorded none."""
    if not version:
        return None
    uri = registry.client.get_model_version(model or registry.name, version).tags.get(tag)
    if not uri:
        return None
    return set(json.loads(Path(mlflow.artifacts.download_artifacts(artifact_uri=uri)).read_text()))


def record_seen(seen: set[str] | None, splits: dict[str, Path]) -> dict[str, str]:
    """Into the active (register) run: the keys this candidate's lineage has trained on (the parent's and its own
    train rows) and the holdout keys it was judged on; returns the version's tags pointing at them, which the
    next run reads (what is new, what is new in the holdout)."""
    run_id = _active_run_id()
    # mlflow's log_dict writes any JSON value (json.dump); its annotation says dict
    mlflow.log_dict(sorted((seen or set()) | set(split_keys(splits["train"]))), SEEN_KEYS_FILE)  # type: ignore[arg-type]
    mlflow.log_dict(split_keys(splits["holdout"]), HOLDOUT_KEYS_FILE)  # type: ignore[arg-type]
    return {"seen_keys": f"runs:/{run_id}/{SEEN_KEYS_FILE}", HOLDOUT_TAG: f"runs:/{run_id}/{HOLDOUT_KEYS_FILE}"}


def unchanged_stage(registry: Registry, dataset: DatasetVersion, cfg_hash: str) -> str | None:
    """Why nothing needs training (`grpo_pipeline.tasks.data.stage.unchanged_reason` against the champion), or None."""
    champion = registry.version_of(CHAMPION)
    if champion is None:
        return None
    tags = registry.client.get_model_version(registry.name, champion).tags
    seen = seen_keys(registry, registry.name, champion)
    new = None if seen is None else sum(k not in seen for k in split_keys(dataset.splits["train"]))
    return unchanged_reason(champion, tags, dataset.fingerprint, cfg_hash, new)


def train_rows_stage(
    cfg: PipelineConfig,
    dataset: DatasetVersion,
    seen: set[str] | None,
    run_dir: Path,
    holdout_before: set[str] | None = None,
) -> tuple[dict[str, Path], TrainRows]:
    """The splits training uses: with `data.incremental`, a train split of the new rows plus the replayed share
    (written under the run directory; val and holdout are the version's own, the same rows every day); and how
    many of each it holds, with the holdout rows the parent was not judged on (`holdout_before`: its holdout)."""
    splits = dict(dataset.splits)
    new_holdout = (
        None if holdout_before is None else sum(k not in holdout_before for k in split_keys(splits["holdout"]))
    )
    keys = split_keys(splits["train"])
    before = sum(k in seen for k in keys) if seen else 0
    if not cfg.data.incremental:
        rows = TrainRows(
            incremental=False,
            new=len(keys) - before,
            replayed=before,
            seen_before=before,
            lineage_known=seen is not None,
            new_holdout=new_holdout,
        )
    else:
        splits["train"], new, replayed = incremental_split(
            splits["train"],
            seen or set(),
            cfg.data.replay_fraction,
            dataset.fingerprint,
            run_dir / "data" / "train.jsonl",
        )
        rows = TrainRows(
            incremental=True,
            new=new,
            replayed=replayed,
            seen_before=before,
            lineage_known=seen is not None,
            new_holdout=new_holdout,
        )
    mlflow.log_metrics(
        {
            "rows/new": rows.new,
            "rows/replayed": rows.replayed,
            "rows/seen_before": rows.seen_before,
            **({"rows/new_holdout": new_holdout} if new_holdout is not None else {}),
        }
    )
    return splits, rows


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


def month_of(now: datetime) -> tuple[str, int]:
    """The calendar month (UTC) of `now`, and its first instant in epoch milliseconds (MLflow's start_time).

    >>> month_of(datetime(2026, 12, 1, 20, 31, tzinfo=UTC))
    ('2026-12', 1796083200000)
    """
    start = now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return f"{start:%Y-%m}", int(start.timestamp() * 1000)


def month_stage(cfg: PipelineConfig, experiment_id: str, plan: Plan) -> MonthCost:
    """Into the parent run: the month's actual cost so far (`cost/month_actual_usd`: each parent run's
    `cost_usd_actual` since the month began, this run's logged just before) beside the plan's projection of a
    run a day (`cost/month_projected_usd`)."""
    month, since = month_of(datetime.now(UTC))
    runs = mlflow.MlflowClient(cfg.mlflow_uri).search_runs(
        [experiment_id], f"metrics.cost_usd_actual >= 0 and attributes.start_time >= {since}", max_results=50000
    )
    figure = MonthCost(
        month=month,
        actual_usd=sum(r.data.metrics["cost_usd_actual"] for r in runs),
        runs=len(runs),
        projected_usd=plan.estimate.monthly_usd,
    )
    mlflow.log_metrics(
        {
            "cost/month_actual_usd": figure.actual_usd,
            **({"cost/month_projected_usd": figure.projected_usd} if figure.projected_usd is not None else {}),
        }
    )
    return figure


def drift_stage(
    cfg: PipelineConfig,
    rewards: RewardSet,
    registry: Registry,
    dataset: DatasetVersion,
    run_dir: Path,
    parent_run_id: str,
) -> Drift:
    """How today's new train rows differ from the champion's (`grpo_pipeline.tasks.data.drift`: the rows whose keys its
    version's `seen_keys` holds): prompt length, answer type, and its reward on a sample of the new rows against its
    holdout reward (the holdout in the `evaluate-champion` stage run, whose later call is then this one's cached
    result; the new rows in the `drift` stage run). Logged into the parent run (`log_drift`); not measured, with the
    reason, when there is no champion, it recorded no lineage, or no row is new."""
    champion = registry.version_of(CHAMPION)
    seen = seen_keys(registry, registry.name, champion) if champion else None
    rows = None
    if champion is None:
        drift = not_measured("no champion yet: nothing to compare today's rows with (the first promoted run makes one)")
    elif seen is None:
        drift = not_measured(
            f"champion v{champion} recorded no trained rows (no seen_keys tag: registered before lineage was kept)",
            champion,
        )
    else:
        with Path(dataset.splits["train"]).open(encoding="utf-8") as f:  # only a newline ends a row (read_jsonl)
            rows = split_rows((json.loads(line) for line in f if line.strip()), seen, dataset.fingerprint)
        if not len(rows.new):
            drift = not_measured(f"no train row is new since champion v{champion}", champion)
        else:
            fetched = champion_model(cfg, registry, champion, run_dir)
            with stage_run(parent_run_id, "evaluate-champion"):
                on_holdout = champion_stage(
                    cfg, rewards, registry, champion, dataset.splits["holdout"], run_dir, fetched=fetched
                )
            sample = run_dir / "drift" / "new_rows.jsonl"
            sample.parent.mkdir(parents=True, exist_ok=True)
            sample.write_bytes(b"".join(jsonl_line(r) for r in rows.sample))
            with stage_run(parent_run_id, "drift"):
                on_new = champion_stage(
                    cfg, rewards, registry, champion, sample, run_dir, name="champion_new_rows", fetched=fetched
                )
            judged = seen_keys(registry, registry.name, champion, tag=HOLDOUT_TAG)
            reward = reward_drop(judged_totals(on_holdout.rows, judged), [r["total"] for r in on_new.rows])
            drift = assess(champion, rows, reward, cfg.data.drift_alert)
    log_drift(drift, rows, cfg.mlflow_uri, run_dir)
    return drift


def log_drift(drift: Drift, rows: NewAndSeen | None, tracking_uri: str, run_dir: Path) -> None:
    """Into the active (parent) run: the `drift/` metrics, the tag `drift_alert` (true/false; with
    `drift_alert_reason`) or `drift_skipped_reason`, drift.json, drift.md and drift.png; in the Prefect UI, the
    markdown artifact `grpo-drift` (the chart inside when MLflow serves it by URL) and the image `grpo-drift-chart`."""
    print(f"drift: {drift.skipped_reason or drift.alert_reason or 'measured, no alert'}")
    if drift.skipped_reason:
        mlflow.set_tag("drift_skipped_reason", drift.skipped_reason[:5000])
    else:
        mlflow.log_metrics(drift_metrics(drift))
        mlflow.set_tags(
            {
                "drift_alert": str(drift.alert).lower(),
                **({"drift_alert_reason": drift.alert_reason[:5000]} if drift.alert_reason else {}),
            }
        )
    mlflow.log_dict(drift.model_dump(mode="json"), "drift.json")
    markdown, url = "\n".join(drift_lines(drift)), None
    if rows is not None and not drift.skipped_reason:
        mlflow.log_artifact(str(plot_drift(drift, rows, run_dir / "drift.png")))
        url = artifact_url(tracking_uri, _active_run_id(), "drift.png")
    if url:  # the Prefect UI loads images by URL; an MLflow server serves its artifacts by URL
        markdown += f"\n![drift since champion v{drift.champion}]({url})\n"
        show_image(url, key="grpo-drift-chart", description="today's new rows against the champion's")
    mlflow.log_text(markdown, "drift.md")
    show_markdown(markdown, key="grpo-drift", description="today's new rows against the champion's")


def model_stage(cfg: PipelineConfig, rewards: RewardSet, base_path: str, val: Path) -> tuple[PipelineConfig, str]:
    """The base model: the best of `model.candidates` on the val split within memory and budget, or
    `model.base` (already resolved at `base_path`); then what its quantization costs, refused past its bound.
    Both rank by `rewards`' weighted total, as training and promotion do."""
    selected, model_path = cfg, base_path
    if cfg.model.candidates:
        selection = _resumable(select_task)(
            cfg.model, cfg.train, cfg.plan, cfg.evaluate, rewards, val, cfg.data_dir / "models"
        )
        mlflow.log_table(selection.table(), "base_selection.json")
        selected = cfg.model_copy(update={"model": cfg.model.model_copy(update={"base": selection.chosen})})
        model_path = selection.chosen_path
    model = selected.model
    mlflow.log_params({"base": model.base, "path": model_path, "quantization": model.quantization})
    quantization = _resumable(quantization_cost_task)(model_path, model, val, rewards, cfg.evaluate)
    if quantization:
        mlflow.log_metrics(quantization.metrics())
        mlflow.log_dict(quantization.model_dump(mode="json"), "quantization_cost.json")
    require_accepted(quantization)  # logged first, then refused
    return selected, model_path


def plan_stage(cfg: PipelineConfig, model_path: str, priced: Plan | None = None) -> Plan:
    """The plan for the chosen base, resolved at `model_path` (`priced`: preflight's, reused when it holds),
    logged; the budget guard before any training compute is spent."""
    plan = plan_task(cfg.model, cfg.train, cfg.plan, model_path, priced=priced)
    mlflow.log_params(plan.summary())
    mlflow.log_dict(plan.report(), "plan.json")
    check_budget(plan, cfg.plan.budget_usd)  # before any training compute is spent
    return plan


def log_resolved_config(cfg: PipelineConfig, dataset: DatasetVersion, model_path: str) -> None:
    """Into the parent run, after selection, plan and search: the configuration that trains, and its key
    parameters as params, so runs compare in the MLflow UI."""
    mlflow.log_dict(cfg.model_dump(mode="json"), "config.json")
    grpo, lora = cfg.train.grpo, cfg.train.lora
    mlflow.log_params(
        {
            "base_model": cfg.model.base,
            "model_path": model_path,
            "quantization": cfg.model.quantization,
            "dataset_fingerprint": dataset.fingerprint,
            "rewards": ",".join(cfg.train.rewards),
            "launcher": cfg.train.launcher,
            "hpo": cfg.hpo.enabled,
            # the value that trains: the configured one, else TRL's or PEFT's default
            **{f"grpo.{k}": grpo.get(k, library_default("GRPOConfig", k)) for k in KEY_GRPO},
            **{f"lora.{k}": lora.get(k, library_default("LoraConfig", k)) for k in KEY_LORA},
        }
    )


KEY_GRPO = (
    "learning_rate",
    "max_steps",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_completion_length",
    "temperature",
    "beta",
    "loss_type",
)
KEY_LORA = ("r", "lora_alpha", "lora_dropout", "target_modules")


@task(name="train")
def train_task(spec: JobSpec, train: TrainConfig) -> TrainResult:
    """The job through the launcher `train.launcher` names; each step goes to the flow's log as step x/N,
    steps/s and the time left; a local job's machine metrics go into its MLflow run."""
    from prefect.logging import get_run_logger

    logger = get_run_logger()
    progress = TrainProgress()

    def show(line: str) -> None:
        if summary := progress.update(line):
            logger.info(summary)

    local_run = spec.mlflow_run_id if LAUNCHERS[train.launcher].local and spec.mlflow_tracking_uri else None
    with system_metrics_of(local_run) if local_run else nullcontext():
        return run_job(make_launcher(train, on_line=show, on_status=logger.info), spec)


def evaluate_stage(
    cfg: PipelineConfig,
    rewards: RewardSet,
    model_path: str,
    holdout: Path,
    name: str,
    adapter: str | None = None,
    model: ModelConfig | None = None,
    label: str | None = None,
) -> EvalResult:
    """`name` (base, candidate, champion) names its artifacts; `label` (else `name`) the model in progress lines."""
    # scored by the same weighted total GRPO optimised (`RewardSet.total`)
    result = _resumable(evaluate_task)(
        model_path, model or cfg.model, holdout, rewards, cfg.evaluate, adapter=adapter, label=label or name
    )
    mlflow.log_metrics(
        {"reward": result.reward, **{f"reward/{k}": v for k, v in result.per_reward.items()}, **result.metrics}
    )
    columns = {k: [row[k] for row in result.rows] for k in result.rows[0]} if result.rows else {}
    mlflow.log_table(columns, artifact_file=f"{name}_samples.json")
    return result


@task(
    name="fetch-champion", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=5)
)
def fetch_champion_task(registry: Registry, version: str, dst: Path, tracking_uri: str) -> tuple[str, dict]:
    mv = registry.client.get_model_version(registry.name, version)
    if not mv.source:
        raise RegistryError(f"version {version} of registered model {registry.name!r} names no artifacts (source)")
    return download(mv.source, dst, tracking_uri), mv.tags  # its models:/m-<id> looked up at tracking_uri


def champion_model(
    cfg: PipelineConfig, registry: Registry, version: str, run_dir: Path
) -> tuple[str, str, ModelConfig]:
    """The champion's base (resolved path), its adapter (downloaded into the run directory) and its model config."""
    local, tags = fetch_champion_task(registry, version, run_dir / "champion", cfg.mlflow_uri)
    logged = Path(local) / "artifacts" / "adapter"  # an MLflow model; a version registered before was the adapter
    adapter = str(logged) if logged.is_dir() else local
    # base_config: the base as this project's config names it (the portable base_model names a copy of it)
    base_name = tags.get("base_config", tags.get("base_model", cfg.model.base))
    model = cfg.model.model_copy(update={"base": base_name, "quantization": tags.get("quantization", "none")})
    return resolve_model_task(model, cfg.data_dir / "models"), adapter, model


def champion_stage(
    cfg: PipelineConfig,
    rewards: RewardSet,
    registry: Registry,
    version: str,
    holdout: Path,
    run_dir: Path,
    name: str = "champion",
    fetched: tuple[str, str, ModelConfig] | None = None,
) -> EvalResult:
    """The current champion on the same holdout (or, named otherwise, on another file of rows), on the base it was
    trained on; `fetched`: `champion_model`'s answer, when already at hand."""
    path, adapter, model = fetched or champion_model(cfg, registry, version, run_dir)
    label = f"champion v{version}" + ("" if name == "champion" else f" ({name})")
    return evaluate_stage(cfg, rewards, path, holdout, name, adapter=adapter, model=model, label=label)


def merge_stage(
    cfg: PipelineConfig, model_path: str, result: TrainResult, holdout: Path, run_dir: Path, run_id: str
) -> Merged:
    prompts = [str(r["prompt"]) for r in read_jsonl(holdout)]
    merged = _resumable(merge_task)(
        model_path,
        result.adapter_dir,
        run_dir / "merged",
        prompts,
        cfg.merge,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    mlflow.log_metric("max_logit_difference", merged["max_logit_difference"])
    found = find_logged_model(run_id, "merged")  # a retry registers what its first attempt logged
    serving_model = cfg.model.model_copy(update={"compute_dtype": cfg.merge.dtype})
    uri, model_id = (
        (found.model_uri, found.model_id)
        if found
        else log_merged_model(merged["merged_dir"], serving_model, cfg.evaluate, _example(holdout))
    )
    return Merged(**merged, source=uri, model_id=model_id, run_id=run_id)


def _example(holdout: Path) -> str:
    """The MLflow model's input example: the first holdout prompt."""
    return prompt_text(read_jsonl(holdout)[0]["prompt"])


def decide_stage(
    cfg: PipelineConfig, rewards: RewardSet, trained: EvalResult, baseline: EvalResult
) -> PromotionDecision:
    decision = decide_promotion(trained.rows, baseline.rows, cfg.promote, list(rewards.names))
    mlflow.log_dict(decision.model_dump(), "decision.json")  # logged before any alias moves
    mlflow.set_tags({"decision": _verdict(decision)})
    return decision


def _verdict(decision: PromotionDecision) -> str:
    return "promote" if decision.promote else "reject"


@task(name="register", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=5))
def register_task(
    registry: Registry, source: str, run_id: str, tags: dict, model_id: str, name: str | None = None
) -> str:
    return registry.register(source, run_id, tags, name=name, model_id=model_id)


def register_stage(
    cfg: PipelineConfig,
    registry: Registry,
    dataset: DatasetVersion,
    model_path: str,
    result: TrainResult,
    merged: Merged | None,
    parent_run_id: str,
    holdout: Path,
    lineage: dict[str, str] | None = None,
) -> Registered:
    """The candidate as an MLflow model on a base anyone can load, registered as a new version (and the
    merged model as a version of `<name>-merged`); no alias moves yet. `lineage`: the version's parent, the
    configuration hash and the keys its lineage trained on, as tags (daily retraining)."""
    client = mlflow.MlflowClient(cfg.mlflow_uri)
    base_experiment = experiment(cfg.mlflow_uri, BASE_EXPERIMENT, cfg.data_dir / "mlartifacts")
    base = base_reference(client, model_path, base_experiment, cfg.model.base)
    run_id = _active_run_id()
    found = find_logged_model(run_id, "adapter")  # a retry registers what its first attempt logged
    if found:
        uri, model_id = found.model_uri, found.model_id
    elif result.adapter_dir is None:  # an interrupted job's result; the training stage returns finished ones only
        raise ValueError(f"training run {result.mlflow_run_id} was interrupted: it has no adapter to register")
    else:
        uri, model_id = log_adapter_model(
            result.adapter_dir,
            base,
            cfg.model,
            cfg.evaluate,
            _example(holdout),
            Path(result.adapter_dir).parent / "serving",
        )
    mlflow.log_params({"base_reference": base.reference, "base_uploaded": base.uploaded})
    tags = {
        "base_model": base.reference,
        "base_config": cfg.model.base,
        **({"base_sha256": base.sha256} if base.sha256 else {}),
        "quantization": cfg.model.quantization,
        "dataset_fingerprint": dataset.fingerprint,
        "hyperparameters": json.dumps({"grpo": cfg.train.grpo, "lora": cfg.train.lora}, sort_keys=True)[:5000],
        "gpu_hours": f"{result.gpu_hours or 0:.4f}",
        "pipeline_run_id": parent_run_id,
        "train_run_id": result.mlflow_run_id or "",
        **(lineage or {}),
    }
    version = register_task(registry, uri, run_id, tags, model_id)
    registered = Registered(model=registry.name, version=version, model_uri=uri, base=base)
    if merged:
        merged_version = register_task(
            registry,
            merged.source,
            merged.run_id,
            {**tags, "adapter_version": version},
            merged.model_id,
            name=registry.merged,
        )
        registry.tag(version, {MERGED_VERSION_TAG: merged_version})
        registered = registered.model_copy(update={"merged_model": registry.merged, "merged_version": merged_version})
    mlflow.set_tags({"candidate_version": version, "model_uri": registered.uri})
    return registered


def serving_stage(
    cfg: PipelineConfig, registry: Registry, registered: Registered, holdout: Path, trained: EvalResult
) -> ServingCheck:
    """A clean process outside the project loads the version by its registry URI and generates for the
    holdout's first evaluation batch; its outputs must be the evaluation's greedy outputs."""
    rows = read_jsonl(holdout)[: cfg.evaluate.batch_size]  # the same batch, so the same padding
    check = serving_check(
        registered.uri,
        cfg.mlflow_uri,
        rows,
        [r["completion"] for r in trained.rows[: len(rows)]],
        cfg.evaluate.max_new_tokens,
        cfg.evaluate.batch_size,
        cache_dir=cfg.data_dir / "serving-cache",
    )
    mlflow.log_metrics(
        {
            "serving_check_passed": float(check.passed),
            "serving_check_matched": check.matched,
            "serving_check_prompts": check.prompts,
            "serving_check_s": check.seconds,
        }
    )
    mlflow.log_dict(check.model_dump(mode="json"), "serving_check.json")
    registry.tag(registered.version, {"serving_check": "passed" if check.passed else "failed"})
    return check


def blocked_unless_served(decision: PromotionDecision, check: ServingCheck) -> PromotionDecision:
    """A candidate that does not serve as it was evaluated is not promoted, whatever its scores."""
    if check.passed:
        return decision
    return decision.model_copy(update={"promote": False, "reasons": [*decision.reasons, check.reason()]})


@registry_task("settle-promotion")
def settle_promotion_task(
    registry: Registry,
    version: str,
    decided_against: str | None,
    promote: bool,
    decision_tags: dict,
    mode: str = "offline",
) -> list:
    """The aliases the promotion decision calls for, moved under the registry lock (`Registry.settle`)."""
    return registry.settle(version, decided_against, promote, decision_tags, mode)


def promote_stage(
    registry: Registry,
    registered: Registered,
    decided_against: str | None,
    decision: PromotionDecision,
    check: ServingCheck,
    mode: str = "offline",
) -> RegistryOutcome:
    """The aliases the decision calls for, under the lock; a version that failed its serving check gets none.

    `promote.mode=canary`: a candidate that passed becomes `challenger` and the online A/B (flows/ab.py)
    decides on `champion`; it replaces a running challenger, whose test restarts on the new version."""
    verdict = _verdict(decision)
    tags = {"decision": verdict, "decision_reasons": " | ".join(decision.reasons)[:5000], "promote_mode": mode}
    if check.passed:
        moves = settle_promotion_task(registry, registered.version, decided_against, decision.promote, tags, mode)
    else:
        registry.tag(registered.version, tags)
        moves = []
    mlflow.set_tags({"decision": verdict, "candidate_version": registered.version, "promote_mode": mode})
    return RegistryOutcome(
        model=registry.name,
        candidate_version=registered.version,
        decided_against=decided_against,
        moves=[AliasChange(model=m.model, alias=m.alias, version=m.version, before=m.before) for m in moves],
        aliases=registry.aliases(),
        base_model=registered.base.reference,
        serving_check=check,
        merged_model=registered.merged_model,
        merged_version=registered.merged_version,
        merged_aliases=registry.aliases(registry.merged) if registered.merged_model else None,
    )


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
    }
    # the names earlier runs used, so they stay comparable
    out |= {"holdout/base_reward": holdout.base_reward, "holdout/trained_reward": holdout.trained_reward}
    return out


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
