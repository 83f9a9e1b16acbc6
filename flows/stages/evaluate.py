"""Evaluation: a model on a file of rows (the holdout, or the drift's new rows), scored by the run's weighted
total; the base, the candidate, and the champion on the base it was trained on (its adapter fetched from the
registry). A baseline (the base, the champion) is scored once: its scores are kept under data_dir and reused while
nothing that changes them has changed (`grpo_pipeline.tasks.baseline_cache`; `evaluate.cache_baseline`)."""

from __future__ import annotations

from pathlib import Path

import mlflow

from grpo_pipeline.configs.schema import ModelConfig, PipelineConfig
from grpo_pipeline.flows.retries import registry_task
from grpo_pipeline.flows.stages import resumable
from grpo_pipeline.tasks.baseline_cache import baseline_scores
from grpo_pipeline.tasks.evaluate import EvalResult, evaluate_task
from grpo_pipeline.tasks.model import resolve_model_task
from grpo_pipeline.tasks.promote.download import download
from grpo_pipeline.tasks.promote.registry import Registry, RegistryError


def evaluate_stage(
    cfg: PipelineConfig,
    model_path: str,
    holdout: Path,
    name: str,
    adapter: str | None = None,
    model: ModelConfig | None = None,
    label: str | None = None,
    baseline: bool = False,
) -> EvalResult:
    """`name` (base, candidate, champion) names its artifacts; `label` (else `name`) the model in progress lines.
    `baseline`: a model the candidate is compared with, whose scores come from the cache when it holds them; the
    stage run's tag `baseline.cached` says whether they did."""
    model = model or cfg.model
    rewards = cfg.train.reward_set()
    label = label or name

    def evaluate() -> EvalResult:
        # scored by the run's rewards: the skill, each reward and the weighted total GRPO optimised (`RewardSet.total`)
        return resumable(evaluate_task)(model_path, model, holdout, rewards, cfg.evaluate, adapter=adapter, label=label)

    if baseline:
        scored = baseline_scores(
            evaluate,
            data_dir=cfg.data_dir if cfg.evaluate.cache_baseline else None,
            model_path=model_path,
            model_cfg=model,
            holdout=holdout,
            rewards=rewards,
            cfg=cfg.evaluate,
            adapter=adapter,
            label=label,
            say=print,  # the flow logs prints: the run's log says where the baseline's scores came from
        )
        mlflow.set_tags(
            {
                "baseline.cached": str(scored.cached).lower(),
                **({"baseline.cache_key": scored.cache_key} if scored.cache_key else {"baseline.cache": "off"}),
            }
        )
        result: EvalResult = scored
    else:
        result = evaluate()
    mlflow.log_metrics(
        {"reward": result.reward, **{f"reward/{k}": v for k, v in result.per_reward.items()}, **result.metrics}
    )
    columns = {k: [row[k] for row in result.rows] for k in result.rows[0]} if result.rows else {}
    mlflow.log_table(columns, artifact_file=f"{name}_samples.json")
    return result


@registry_task("fetch-champion")  # a version that names no artifacts (RegistryError) is not retried
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
    return evaluate_stage(cfg, path, holdout, name, adapter=adapter, model=model, label=label, baseline=True)
