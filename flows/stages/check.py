"""Before the search and training: can GRPO learn the task on the chosen base (`grpo_pipeline.tasks.check`)? The
figures go to the stage run as metrics, the verdict as a tag, the whole check as task_check.json; the verdict line is
printed; a `too_hard` task ends the run here (`check.on_too_hard=refuse`, exit 2) before anything is trained."""

from __future__ import annotations

import mlflow

from grpo_pipeline.configs.schema import ConfigError, PipelineConfig
from grpo_pipeline.tasks.check import TaskCheck, cache_dir, check_task
from grpo_pipeline.tasks.data.stage import DatasetVersion


def check_stage(cfg: PipelineConfig, dataset: DatasetVersion, model_path: str) -> TaskCheck:
    """The check on the base at `model_path` (the chosen one) with the run's rewards and recipe; logged, then
    refused when too hard and `check.on_too_hard` is refuse."""
    check = check_task(
        dataset, model_path, cfg.model, cfg.train.reward_set(), cfg.train, cfg.check, cache_dir(cfg.data_dir)
    )
    mlflow.log_metrics(check.metrics())
    mlflow.set_tags({"task_check.verdict": check.verdict, "task_check.cached": str(check.cached).lower()})
    mlflow.log_dict(check.model_dump(mode="json"), "task_check.json")
    print(check.line())
    if check.verdict == "too_hard":
        fixes = "; ".join(check.fixes)
        if cfg.check.on_too_hard == "refuse":
            raise ConfigError(
                f"{check.line()}. Nothing was trained. Fixes: {fixes}; or train anyway with "
                "--set check.on_too_hard=warn (grpo-pipeline task check shows the figures)"
            )
        print(f"task check: training anyway (check.on_too_hard=warn); fixes: {fixes}")
    return check
