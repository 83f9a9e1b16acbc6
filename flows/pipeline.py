"""The pipeline flow: data -> base model (selection, quantization cost) -> plan and budget guard ->
hyperparameter search (when enabled) -> evaluate base -> GRPO train -> evaluate candidate and champion ->
merge (when enabled) -> decide -> register and move aliases -> report.

Every stage is a nested MLflow run under one parent run; the summary this flow returns is what
`grpo-pipeline run --json` prints.

A retried flow run (the Prefect UI's Retry, or a flow-level retry) resumes after its last completed
stage: the expensive stages are cached on their inputs and the flow run id, with results persisted, and
the retry reuses the same run directory, MLflow parent run and stage runs, and model version.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Literal

import mlflow
from prefect import flow, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.cache_policies import INPUTS, NO_CACHE, RUN_ID, TASK_SOURCE
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from configs.schema import PipelineConfig, load_config
from grpo_pipeline.tracking import create_child_run, setup_tracking
from tasks.decide import decide_promotion
from tasks.data import DatasetVersion, data_task, log_lineage
from tasks.evaluate import EvalResult, evaluate_task, read_jsonl
from tasks.hpo import apply_best, hpo_task
from tasks.merge import merge_task
from tasks.model import resolve_model_task
from tasks.plan import actual_cost, apply_plan, check_budget, plan_task
from tasks.quantize import quantization_cost_task, require_accepted
from tasks.registry import CHAMPION, ChampionMoved, Registry, RegistryError
from tasks.report import artifact_url, plot_comparison, render_markdown
from tasks.select import select_task
from tasks.train import build_job_spec, preflight, train_task


# Within one flow run, a stage whose inputs and code are unchanged returns its persisted result, so a
# retry does no second data pass, training or evaluation. A new flow run computes everything afresh.
RESUMABLE = INPUTS + TASK_SOURCE + RUN_ID


def _resumable(stage):
    return stage.with_options(cache_policy=RESUMABLE, persist_result=True)


def _not_a_decision(task, task_run, state) -> bool:
    """Retry registry calls on service errors, never on a lost race or a held lock."""
    try:
        state.result()
    except (ChampionMoved, RegistryError):
        return False
    except Exception:
        return True
    return False


@task(name="register", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=5),
      retry_condition_fn=_not_a_decision)
def register_task(registry: Registry, source: str, run_id: str, tags: dict, decided_against: str | None,
                  promote: bool, decision_tags: dict) -> tuple[str, list]:
    version = registry.register(source, run_id, tags)
    return version, registry.settle(version, decided_against, promote, decision_tags)


@task(name="fetch-champion", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=5))
def fetch_champion_task(registry: Registry, version: str, dst: Path) -> tuple[str, dict]:
    mv = registry.client.get_model_version(registry.name, version)
    return mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dst)), mv.tags


@contextmanager
def _stage(parent_run_id: str, name: str):
    """The stage's nested MLflow run, reopened when a retry of this flow run reaches the stage again."""
    existing = _child_run(parent_run_id, name)
    with mlflow.start_run(run_id=existing, run_name=None if existing else name, nested=True) as run:
        yield run


def _child_run(parent_run_id: str, name: str) -> str | None:
    return _find_run(f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.run_name = '{name}'")


def _parent_run(flow_run_id: str) -> str | None:
    return _find_run(f"tags.prefect_flow_run_id = '{flow_run_id}'")


def _find_run(filter_string: str) -> str | None:
    """The id of a run an earlier attempt of this flow run created, if any."""
    found = mlflow.search_runs(filter_string=filter_string, output_format="list", max_results=1)
    return found[0].info.run_id if found else None


def _run_dir(cfg: PipelineConfig) -> Path:
    """One directory per flow run, the same for every retry of it."""
    started = flow_run.scheduled_start_time or datetime.now()
    return cfg.data_dir / "runs" / f"{started:%Y%m%d-%H%M%S}-{(flow_run.id or 'local')[:8]}"


def _choose_base(cfg: PipelineConfig, base_path: str, val: Path) -> tuple[PipelineConfig, str]:
    """The base model: the best of `model.candidates` on the val split within memory and budget, or
    `model.base` (already resolved at `base_path`)."""
    model_path = base_path
    if cfg.model.candidates:
        selection = _resumable(select_task)(cfg, val, cfg.data_dir / "models")
        mlflow.log_table(selection.table(), "base_selection.json")
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"base": selection.chosen})})
        model_path = selection.chosen_path
    mlflow.log_params({"base": cfg.model.base, "path": model_path, "quantization": cfg.model.quantization})
    return cfg, model_path


def _log_eval(result: EvalResult, name: str) -> None:
    mlflow.log_metrics({"reward": result.reward, **{f"reward/{k}": v for k, v in result.per_reward.items()},
                        **result.metrics})
    columns = {k: [row[k] for row in result.rows] for k in result.rows[0]} if result.rows else {}
    mlflow.log_table(columns, artifact_file=f"{name}_samples.json")


def _champion_eval(cfg: PipelineConfig, registry: Registry, version: str, holdout: Path, run_dir: Path):
    """Evaluate the current champion on the same holdout, on the base it was trained on."""
    adapter, tags = fetch_champion_task(registry, version, run_dir / "champion")
    champion_model = cfg.model.model_copy(
        update={"base": tags.get("base_model", cfg.model.base), "quantization": tags.get("quantization", "none")}
    )
    path = resolve_model_task(champion_model, cfg.data_dir / "models")
    return _resumable(evaluate_task)(path, champion_model, holdout, cfg.train.rewards, cfg.evaluate, adapter=adapter)


def _version_tags(cfg: PipelineConfig, dataset: DatasetVersion, result, parent_run_id: str) -> dict[str, str]:
    return {
        "base_model": cfg.model.base,
        "quantization": cfg.model.quantization,
        "dataset_fingerprint": dataset.fingerprint,
        "hyperparameters": json.dumps({"grpo": cfg.train.grpo, "lora": cfg.train.lora}, sort_keys=True)[:5000],
        "gpu_hours": f"{result.gpu_hours or 0:.4f}",
        "pipeline_run_id": parent_run_id,
    }


def run_pipeline(cfg: PipelineConfig) -> dict:
    """The stages in order; called inside the Prefect flow so each task is tracked."""
    preflight(cfg)
    run_dir = _run_dir(cfg)
    exp_id = setup_tracking(cfg.mlflow_uri, cfg.tracking.experiment, cfg.data_dir / "mlartifacts")
    registry = Registry(mlflow.MlflowClient(cfg.mlflow_uri), cfg.tracking.registered_model)
    rewards = cfg.train.rewards
    flow_run_id = flow_run.id or "local"
    with mlflow.start_run(run_id=_parent_run(flow_run_id), run_name="grpo-pipeline",
                          tags={"prefect_flow_run_id": flow_run_id}) as parent:
        parent_id = parent.info.run_id
        mlflow.log_dict(cfg.model_dump(mode="json"), "config.json")
        with _stage(parent_id, "data"):
            # The configured base is resolved first: its tokenizer counts the data stage's token budget.
            base_path = resolve_model_task(cfg.model, cfg.data_dir / "models")
            # Versions are content-keyed under one directory, so a run on unchanged data reuses the last one.
            dataset = data_task(cfg.data, cfg.data_dir / "datasets", base_path, rewards)
            log_lineage(dataset)
            splits = dataset.splits
        with _stage(parent_id, "model"):
            cfg, model_path = _choose_base(cfg, base_path, splits["val"])
            quantization = _resumable(quantization_cost_task)(
                model_path, cfg.model, splits["val"], rewards, cfg.evaluate
            )
            if quantization:
                mlflow.log_metrics(quantization.metrics())
                mlflow.log_dict(quantization.model_dump(mode="json"), "quantization_cost.json")
            require_accepted(quantization)  # logged first, then refused
        with _stage(parent_id, "plan"):
            plan = plan_task(cfg, model_path)
            mlflow.log_params(plan.summary())
            mlflow.log_dict(plan.report(), "plan.json")
            check_budget(plan, cfg.plan.budget_usd)  # before any training compute is spent
            cfg = apply_plan(cfg, plan)
        search = None
        if cfg.hpo.enabled:  # its own `hpo` stage run, a nested run per trial
            search = hpo_task(cfg, model_path, splits, run_dir, parent_id)
            cfg = apply_best(cfg, search.overrides)
        with _stage(parent_id, "evaluate-base"):
            base = _resumable(evaluate_task)(model_path, cfg.model, splits["holdout"], rewards, cfg.evaluate)
            _log_eval(base, "base")

        train_run_id = _child_run(parent_id, "train") or create_child_run(exp_id, parent_id, "train")
        result = _resumable(train_task)(build_job_spec(cfg, model_path, splits, run_dir, train_run_id))
        cost = {"cost_usd_estimated": plan.estimate.usd, "cost_usd_actual": actual_cost(result.gpu_hours, plan)}
        mlflow.log_metrics(cost)

        with _stage(parent_id, "evaluate-candidate"):
            trained = _resumable(evaluate_task)(
                model_path, cfg.model, splits["holdout"], rewards, cfg.evaluate, adapter=result.adapter_dir
            )
            _log_eval(trained, "candidate")
        decided_against = registry.version_of(CHAMPION)  # the baseline: the champion, or the base model
        champion = None
        if decided_against:
            with _stage(parent_id, "evaluate-champion"):
                champion = _champion_eval(cfg, registry, decided_against, splits["holdout"], run_dir)
                _log_eval(champion, "champion")

        merged = None
        if cfg.merge.enabled:
            with _stage(parent_id, "merge") as merge_run:
                prompts = [str(r["prompt"]) for r in read_jsonl(splits["holdout"])]
                merged = _resumable(merge_task)(model_path, result.adapter_dir, run_dir / "merged", prompts, cfg.merge)
                mlflow.log_metric("max_logit_difference", merged["max_logit_difference"])
                mlflow.log_artifacts(merged["merged_dir"], "merged")
                merged["source"] = f"runs:/{merge_run.info.run_id}/merged"

        with _stage(parent_id, "decide"):
            decision = decide_promotion(trained.rows, (champion or base).rows, cfg.promote, rewards)
            mlflow.log_dict(decision.model_dump(), "decision.json")  # logged before any alias moves
            verdict = "promote" if decision.promote else "reject"
            mlflow.set_tags({"decision": verdict})
        tags = _version_tags(cfg, dataset, result, parent_id)
        if merged:
            tags["merged_source"] = merged["source"]
        version, moves = register_task(
            registry, f"runs:/{train_run_id}/adapter", train_run_id, tags, decided_against, decision.promote,
            {"decision": verdict, "decision_reasons": " | ".join(decision.reasons)[:5000]},
        )

        summary = {
            "status": "completed",
            "mlflow": {"tracking_uri": cfg.mlflow_uri, "run_id": parent_id, "experiment_id": exp_id},
            "run_dir": str(run_dir.resolve()),
            "data": {"fingerprint": dataset.fingerprint, **dataset.report.model_dump(mode="json")},
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
            "plan": plan.summary(),
            "hpo": {"best_trial": search.best_trial, "best_value": search.best_value, "overrides": search.overrides,
                    "study": search.study_name} if search else None,
            "cost": cost,
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


def flow_overrides(overrides: list[str] | None, launcher: str | None, budget_usd: float | None) -> list[str]:
    """The flow's form fields as config overrides, applied after the user's own.

    >>> flow_overrides(["train.grpo.max_steps=5"], "sky", 40.0)
    ['train.grpo.max_steps=5', 'train.launcher=sky', 'plan.budget_usd=40.0']
    """
    extra = [f"train.launcher={launcher}"] if launcher else []
    extra += [f"plan.budget_usd={budget_usd}"] if budget_usd is not None else []
    return [*(overrides or []), *extra]


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    launcher: Literal["local", "sky"] | None = None,
    budget_usd: float | None = None,
) -> dict:
    """Run the GRPO pipeline: data, base model, training, evaluation, A/B decision, registry.

    Args:
        config_path: pipeline YAML, relative to the project (e.g. configs/demo-cpu.yaml); empty runs the
            built-in defaults.
        overrides: `stage.key=value` assignments applied on top, e.g. `train.grpo.max_steps=20`.
        launcher: where training runs: `local` (a subprocess on the worker) or `sky` (a SkyPilot managed
            spot job); empty keeps the config's `train.launcher`.
        budget_usd: refuse to train when the planner's cost estimate passes this many dollars; empty keeps
            the config's `plan.budget_usd`.
    """
    return run_pipeline(load_config(config_path, flow_overrides(overrides, launcher, budget_usd)))
