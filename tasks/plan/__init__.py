"""Planner: GPU memory, GPU choice, batch settings, time and cost of a GRPO run, from a model's config.json.

Pure functions over plain data, importing neither torch, transformers nor Prefect, so `grpo-pipeline plan`
answers in well under a second and a GPU check can call `estimate_memory` on any config.json. By job:
`architecture` (the model catalogue), `workload` (what the run does), `memory` (the memory model),
`catalogue` (GPUs and prices), `values` (the plan and what it is made of), `fit` (the settings that fit one GPU
type and count), `cost` (time and price), `search` (the cheapest GPU choice, a local run, the budget), `stage` (the
pipeline's config in, a plan out), `render` (tables); `task` is the Prefect task, imported on its own.

    >>> p = make_plan(load_model_config("qwen2.5-7b")[1], Workload(model="qwen2.5-7b", quantization="nf4"))
    >>> p.settings.count, round(p.memory.total / GIB) < 24
    (1, True)
"""

from grpo_pipeline.tasks.plan.architecture import KNOWN_MODELS, architecture, load_model_config, model_config_for
from grpo_pipeline.tasks.plan.base import GIB, PlanError
from grpo_pipeline.tasks.plan.catalogue import load_catalog
from grpo_pipeline.tasks.plan.cost import step_seconds
from grpo_pipeline.tasks.plan.memory import MemoryEstimate, ServerMemory, estimate_memory, estimate_vllm_server
from grpo_pipeline.tasks.plan.render import plan_tables
from grpo_pipeline.tasks.plan.search import BudgetExceeded, actual_cost, check_budget, make_plan, plan_local
from grpo_pipeline.tasks.plan.stage import apply_plan, layout_for, plan_for_config, plan_run, workload_for
from grpo_pipeline.tasks.plan.values import Assumptions, Layout, Plan, Settings
from grpo_pipeline.tasks.plan.workload import Workload

__all__ = [
    "GIB",
    "KNOWN_MODELS",
    "Assumptions",
    "BudgetExceeded",
    "Layout",
    "MemoryEstimate",
    "Plan",
    "PlanError",
    "ServerMemory",
    "Settings",
    "Workload",
    "actual_cost",
    "apply_plan",
    "architecture",
    "check_budget",
    "estimate_memory",
    "estimate_vllm_server",
    "layout_for",
    "load_catalog",
    "load_model_config",
    "make_plan",
    "model_config_for",
    "plan_for_config",
    "plan_local",
    "plan_run",
    "plan_tables",
    "step_seconds",
    "workload_for",
]
