"""`grpo-pipeline plan`: GPU memory, GPU choice, batch settings, time and cost of a GRPO run, offline and without
torch: for a known model and workload options, or for a pipeline config; refused (exit 2) past its budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console

from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.failure import EXIT_CONFIG, options_error
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.loading import ConfigOpt, SetOpt, load

# pure Python (no torch, transformers or Prefect): its fields are the options
from grpo_pipeline.tasks import plan as planner

WORK = planner.Workload.model_fields  # each workload option below is a Workload field: its default, its help


PLAN_FLAGS: dict[str, str] = {}  # Workload field -> the option that sets it, to name it in an error


def _work(field: str, *flags: str) -> Any:  # typer.Option() is typed as returning Any
    PLAN_FLAGS[field] = flags[0] if flags else f"--{field.replace('_', '-')}"
    return typer.Option(*flags, help=WORK[field].description)


def _budget_usd(value: float | None) -> float | None:
    """--budget, refused by the parser (exit 2, and with --json the failure object) before any planning: a
    negative budget, or NaN, refuses every plan, and would reach the refusal's message with nothing to price."""
    if value is not None and not value >= 0:
        raise typer.BadParameter(
            f"{value:g} USD is not a budget; give the most a run may cost, 0 or more, or leave --budget out for no limit"
        )
    return value


def plan_cmd(
    model: Annotated[
        str | None,
        typer.Option(
            help="known id (qwen2.5-7b, meta-llama/Llama-3.1-70B, ...), config.json or model dir; default: the --config's model.base"
        ),
    ] = None,
    quantization: Annotated[str, _work("quantization", "--quant", "--quantization")] = WORK["quantization"].default,
    double_quant: Annotated[bool, _work("double_quant")] = WORK["double_quant"].default,
    lora_rank: Annotated[int, _work("lora_rank")] = WORK["lora_rank"].default,
    lora_targets: Annotated[str, _work("lora_targets", "--targets", "--lora-targets")] = WORK["lora_targets"].default,
    optimizer: Annotated[str, _work("optimizer")] = WORK["optimizer"].default,
    dtype: Annotated[str, _work("dtype")] = WORK["dtype"].default,
    effective_batch: Annotated[int, _work("effective_batch", "--batch", "--effective-batch")] = WORK[
        "effective_batch"
    ].default,
    num_generations: Annotated[int, _work("num_generations")] = WORK["num_generations"].default,
    prompt_tokens: Annotated[int, _work("prompt_tokens")] = WORK["prompt_tokens"].default,
    completion_tokens: Annotated[int, _work("completion_tokens")] = WORK["completion_tokens"].default,
    max_steps: Annotated[int, _work("max_steps", "--steps", "--max-steps")] = WORK["max_steps"].default,
    beta: Annotated[float, _work("beta")] = WORK["beta"].default,
    vllm: Annotated[bool, _work("vllm")] = WORK["vllm"].default,
    gradient_checkpointing: Annotated[str, _work("gradient_checkpointing")] = WORK["gradient_checkpointing"].default,
    gpus: Annotated[
        str | None, typer.Option(help="allowed GPU types, comma-separated; default: the whole catalog")
    ] = None,
    spot: Annotated[bool, typer.Option("--spot/--on-demand")] = True,
    budget: Annotated[
        float | None,
        typer.Option(help="refuse (exit 2) when the estimate is above this many USD", callback=_budget_usd),
    ] = None,
    catalog: Annotated[Path | None, typer.Option(help="YAML merged over configs/gpus.yaml")] = None,
    mfu: Annotated[float, typer.Option(help="assumed model FLOPs utilisation")] = planner.Assumptions.model_fields[
        "mfu"
    ].default,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
) -> None:
    """GPU memory, GPU choice, batch settings, time and cost of a GRPO run, offline and without torch."""
    work_options = {k: v for k, v in locals().items() if k in WORK and k != "model"}
    try:
        if model is None:
            _, cfg = load(config, overrides, as_json)
            result = planner.plan_run(cfg.model, cfg.train, cfg.plan)
            budget = cfg.plan.budget_usd if budget is None else budget
        else:
            name, model_config = planner.load_model_config(model)
            work = planner.Workload(model=name, **work_options)
            result = planner.make_plan(
                model_config,
                work,
                planner.load_catalog(catalog),
                spot=spot,
                allowed=gpus.split(",") if gpus else None,
                assumptions=planner.Assumptions(mfu=mfu),
            )
    except ValidationError as exc:  # a workload option out of range or not one of its choices
        _fail(as_json, options_error(exc, PLAN_FLAGS), EXIT_CONFIG)
    except (ConfigError, ValueError) as exc:  # PlanError included
        _fail(as_json, str(exc), EXIT_CONFIG)
    try:
        planner.check_budget(result, budget)
    except planner.BudgetExceeded as exc:
        # with --json the refusal is the last line, carrying the plan that was refused; else the tables first
        if not as_json:
            for table in planner.plan_tables(result):
                Console().print(table)
        _fail(as_json, str(exc), EXIT_CONFIG, plan=result.report())
    if as_json:
        print(json.dumps(result.report(), indent=2))
    else:
        for table in planner.plan_tables(result):
            Console().print(table)
