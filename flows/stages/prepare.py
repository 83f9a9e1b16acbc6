"""Before training: the dataset version, the base model (chosen among candidates, what its quantization costs), the
plan and its budget guard, and the configuration that trains, as the parent run shows it."""

from __future__ import annotations

from pathlib import Path

import mlflow

from grpo_pipeline.configs.library_fields import default as library_default
from grpo_pipeline.configs.schema import PipelineConfig
from grpo_pipeline.flows.stages import resumable
from grpo_pipeline.tasks.data.stage import DatasetVersion, data_task, log_lineage
from grpo_pipeline.tasks.model import resolve_model_task
from grpo_pipeline.tasks.plan import Plan, check_budget
from grpo_pipeline.tasks.plan.task import plan_task
from grpo_pipeline.tasks.quantize import quantization_cost_task, require_accepted
from grpo_pipeline.tasks.select import select_task


def data_stage(cfg: PipelineConfig) -> tuple[DatasetVersion, str]:
    """The dataset version (its verifiability check runs the run's answer checkers with their arguments), and
    the configured base resolved (its tokenizer counts the token budget)."""
    base_path = resolve_model_task(cfg.model, cfg.data_dir / "models")
    # Versions are content-keyed under one directory, so a run on unchanged data reuses the last one.
    dataset = data_task(cfg.data, cfg.data_dir / "datasets", base_path, cfg.train.reward_set())
    log_lineage(dataset)
    return dataset, base_path


def model_stage(cfg: PipelineConfig, base_path: str, val: Path) -> tuple[PipelineConfig, str]:
    """The base model: the best of `model.candidates` on the val split within memory and budget, or
    `model.base` (already resolved at `base_path`); then what its quantization costs, refused past its bound.
    Both rank by the rewards' weighted total, as training does."""
    rewards = cfg.train.reward_set()
    selected, model_path = cfg, base_path
    if cfg.model.candidates:
        selection = resumable(select_task)(
            cfg.model, cfg.train, cfg.plan, cfg.evaluate, rewards, val, cfg.data_dir / "models"
        )
        mlflow.log_table(selection.table(), "base_selection.json")
        selected = cfg.model_copy(update={"model": cfg.model.model_copy(update={"base": selection.chosen})})
        model_path = selection.chosen_path
    model = selected.model
    mlflow.log_params({"base": model.base, "path": model_path, "quantization": model.quantization})
    quantization = resumable(quantization_cost_task)(model_path, model, val, rewards, cfg.evaluate)
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
            "rewards": ",".join(entry.name for entry in cfg.train.rewards),
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
