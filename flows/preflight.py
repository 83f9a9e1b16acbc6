"""The checks a run makes before any work is done, each failure a `ConfigError` (exit 2 from the CLI) that
names the field and the fix: what the configuration alone cannot know (files on this worker, importable
rewards, a reachable store or cloud, the budget against the planner's estimate).

They run once per run: `grpo-pipeline run` and `hpo` make them before a flow run exists (so a refused input
leaves no failed flow run behind) and start the flow on the checked config; a deployment's flow run makes them
first thing."""

from __future__ import annotations

from grpo_pipeline.configs.schema import PipelineConfig
from grpo_pipeline.infra import launch
from grpo_pipeline.tasks.data.sources import check_local_sources
from grpo_pipeline.tasks.evaluate import score_columns
from grpo_pipeline.tasks.job import check_rewards
from grpo_pipeline.tasks.model import check_model_paths
from grpo_pipeline.tasks.plan import Plan, check_budget, plan_run
from grpo_pipeline.tasks.promote.decide import check_policy


def preflight(cfg: PipelineConfig) -> Plan | None:
    """Raise on the first input that would fail the run later; return the plan the budget was priced with
    (None without `plan.budget_usd`), which the plan stage reuses when the resolved base plans the same."""
    check_local_sources(cfg.data)
    check_model_paths(cfg.model)
    rewards = cfg.train.reward_set()
    check_rewards(rewards, cfg.evaluate)  # evaluate.* too: a typo there fails after training
    check_policy(
        cfg.promote, score_columns(rewards, cfg.evaluate), rewards
    )  # promote.metric and guardrails name columns
    priced = None
    if cfg.plan.budget_usd is not None:  # the configured base; the plan stage checks the chosen one again
        priced = plan_run(cfg.model, cfg.train, cfg.plan)
        check_budget(priced, cfg.plan.budget_usd)
    # the distributed launch, and what the launcher needs: the store it writes to (a SkyPilot node's, this machine's)
    launch.check_launcher(cfg.train, cfg.mlflow_uri, cfg.model)
    return priced
