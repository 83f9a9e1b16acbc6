"""After evaluation: the merged model (when enabled), the promotion decision (logged before any alias moves), the
candidate registered as an MLflow model on a base anyone can load, the serving check of that version, and the
aliases the decision calls for, moved under the registry lock."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow

from grpo_pipeline.configs.schema import PipelineConfig
from grpo_pipeline.flows.retries import registry_task
from grpo_pipeline.flows.runs import experiment
from grpo_pipeline.flows.stages import active_run_id, resumable
from grpo_pipeline.tasks.data.stage import DatasetVersion
from grpo_pipeline.tasks.evaluate import EvalResult, read_jsonl
from grpo_pipeline.tasks.promote.decide import PromotionDecision, decide_promotion
from grpo_pipeline.tasks.promote.merge import merge_task
from grpo_pipeline.tasks.promote.registry import MERGED_VERSION_TAG, Registry
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
from grpo_pipeline.tasks.summary import AliasChange, Merged, Registered, RegistryOutcome
from grpo_pipeline.trainer.spec import TrainResult


def merge_stage(
    cfg: PipelineConfig, model_path: str, result: TrainResult, holdout: Path, run_dir: Path, run_id: str
) -> Merged:
    prompts = [str(r["prompt"]) for r in read_jsonl(holdout)]
    merged = resumable(merge_task)(
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


def decide_stage(cfg: PipelineConfig, trained: EvalResult, baseline: EvalResult) -> PromotionDecision:
    """The offline gate on the paired holdout rows: the skill reward compared (unless `promote.metric` names
    another column), the total and every reward guarded by its weight in the run's rewards (a reward the total
    counts against regresses when it rises)."""
    decision = decide_promotion(trained.rows, baseline.rows, cfg.promote, cfg.train.reward_set())
    mlflow.log_dict(decision.model_dump(), "decision.json")  # logged before any alias moves
    mlflow.set_tags({"decision": _verdict(decision)})
    return decision


def _verdict(decision: PromotionDecision) -> str:
    return "promote" if decision.promote else "reject"


@registry_task("register")
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
    run_id = active_run_id()
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
