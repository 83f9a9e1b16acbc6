"""The pipeline's plan stage: the config's model, train and plan sections in, their workload, their plan, and
the config the plan sets (batch split, checkpointing, bf16, the launcher's GPU options) out. What a launcher that
rents GPUs offers (its GPU options, those the config pins, spot or on-demand prices) and how the plan's choice is
written back are its registry entry's (`grpo_pipeline.configs.launchers.Rental`). Where a `train.grpo` or `train.lora` field is
unset, TRL's or PEFT's own default stands in (read from `grpo_pipeline.configs.library_fields`), since that is what trains.
"""

from __future__ import annotations

import math
from typing import Any, get_args

from pydantic import ValidationError

from grpo_pipeline.configs.launchers import LAUNCHERS
from grpo_pipeline.configs.layout import DistributedConfig, batch_problem
from grpo_pipeline.configs.library_fields import default
from grpo_pipeline.configs.schema import ModelConfig, PipelineConfig, PlanConfig, TrainConfig
from grpo_pipeline.tasks.plan.architecture import architecture, model_config_for
from grpo_pipeline.tasks.plan.base import PlanError
from grpo_pipeline.tasks.plan.catalogue import load_catalog
from grpo_pipeline.tasks.plan.search import make_plan, plan_local
from grpo_pipeline.tasks.plan.values import Assumptions, Layout, Plan
from grpo_pipeline.tasks.plan.workload import Optimizer, Workload


def _grpo(train: TrainConfig, name: str) -> Any:
    """A `train.grpo` field as TRL will see it: the configured value, else GRPOConfig's default."""
    return train.grpo.get(name, default("GRPOConfig", name))


def _vllm_server(train: TrainConfig) -> bool:
    return bool(_grpo(train, "use_vllm")) and _grpo(train, "vllm_mode") == "server"


def pinned_world(train: TrainConfig) -> int | None:
    """Training processes the config itself fixes: nodes x processes_per_node, else nodes x (the GPUs per node
    that the launcher's entry says the config asks for, less the vLLM server's) when every option asks the same
    count, as the node launcher would start them; None: the planner chooses.

    >>> from grpo_pipeline.configs.schema import load_config
    >>> sky = load_config(None, ["train.launcher=sky", "train.sky.accelerators=[H100:4]"])
    >>> pinned_world(sky.train), pinned_world(load_config(None).train)
    (4, None)
    """
    d = train.distributed
    if d.processes_per_node:
        return d.world_size(0)  # the processes set hold on any node
    counts = LAUNCHERS[train.launcher].gpu_counts(train)
    if counts is not None and len(counts) == 1:
        return d.world_size(counts[0])
    return None


def layout_for(train: TrainConfig) -> Layout:
    """What the launch fixes already, and the plan must keep: train.distributed's fields the user set, the
    train.grpo batch fields the user set (apply_plan never overrides them), the GPU counts the config pins
    (its launcher's `Rental.pinned_gpus`; none for a local run)."""
    facts = LAUNCHERS[train.launcher]
    pinned = {} if facts.local else facts.rents().pinned_gpus(train)
    return Layout(
        distributed=train.distributed,
        gpus_per_node=pinned or None,
        vllm_server=_vllm_server(train),
        **{
            k: train.grpo.get(k)
            for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation")
        },
    )


def workload_for(
    model: ModelConfig, train: TrainConfig, plan: PlanConfig, name: str, train_rows: int | None = None
) -> Workload:
    """The run the config's sections describe: model precision, LoRA, GRPO lengths and batch, steps
    (max_steps, else epochs x train_rows / prompts per step, else None: unknown).

    The effective batch is plan.target_effective_batch, else what TRL will run: per_device_train_batch_size x
    gradient_accumulation_steps x the training processes the config fixes (`pinned_world`; 1 when the
    planner chooses them, and then it keeps that total whatever it picks)."""
    lora = train.lora
    generations = _grpo(train, "num_generations")
    effective = plan.target_effective_batch or (
        _grpo(train, "per_device_train_batch_size")
        * _grpo(train, "gradient_accumulation_steps")
        * (pinned_world(train) or 1)
    )
    steps = _grpo(train, "max_steps")
    if steps is None or steps <= 0:
        steps = (
            None
            if not train_rows
            else math.ceil(_grpo(train, "num_train_epochs") * train_rows / (effective / generations))
        )
    optimizer = plan.optimizer or _grpo(train, "optim")
    if optimizer not in get_args(Optimizer):
        raise PlanError(
            f"optimizer {optimizer!r} (train.grpo.optim) is unknown to the planner; set plan.optimizer "
            f"to one of {list(get_args(Optimizer))}"
        )
    targets = lora.get("target_modules", default("LoraConfig", "target_modules"))
    try:
        return Workload(
            model=name,
            quantization=model.quantization,
            double_quant=model.double_quant,
            dtype=model.compute_dtype,
            lora_rank=lora.get("r", default("LoraConfig", "r")),
            lora_targets=tuple(targets) if isinstance(targets, list) else targets,
            optimizer=optimizer,
            # a value set in train.grpo is what trains (apply_plan keeps it), so the plan sizes that one
            gradient_checkpointing=(
                train.grpo.get("gradient_checkpointing", "auto")
                if plan.gradient_checkpointing == "auto"
                else plan.gradient_checkpointing
            ),
            prompt_tokens=plan.prompt_tokens,
            completion_tokens=_grpo(train, "max_completion_length"),
            num_generations=generations,
            effective_batch=effective,
            max_steps=steps,
            beta=_grpo(train, "beta"),
            vllm=_grpo(train, "use_vllm"),
        )
    except ValidationError as exc:
        raise PlanError(f"cannot plan this configuration: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


def plan_for_config(
    model: ModelConfig,
    train: TrainConfig,
    plan: PlanConfig,
    model_config: dict[str, Any],
    name: str,
    train_rows: int | None = None,
) -> Plan:
    """The plan for the config's sections. A local launcher (train.launcher=local): this machine, memory against its
    RAM, 0 USD. One that rents GPUs (sky): the cheapest of plan.allowed_gpus (default: the launcher's GPU options,
    for sky train.sky.accelerators or its task YAML's list), priced as the launcher rents them (plan.spot, when set,
    overrides it).

    >>> from grpo_pipeline.configs.files import packaged
    >>> from grpo_pipeline.configs.schema import load_config
    >>> from grpo_pipeline.tasks.plan import load_model_config
    >>> cfg = load_config(packaged("qwen2.5-7b-qlora.yaml"), ["train.launcher=sky"])
    >>> p = plan_for_config(cfg.model, cfg.train, cfg.plan, load_model_config(cfg.model.base)[1], "qwen2.5-7b")
    >>> p.settings.gpu in ("H100", "A100-80GB", "L40S"), p.estimate.pricing
    (True, 'spot')
    """
    work = workload_for(model, train, plan, name, train_rows)
    facts = LAUNCHERS[train.launcher]
    if facts.local:
        pdb = _grpo(train, "per_device_train_batch_size")
        return plan_local(
            model_config,
            work,
            per_device_batch=pdb,
            # per process: the effective batch counts every process of the run
            gradient_accumulation=max(1, work.effective_batch // (pdb * (pinned_world(train) or 1))),
            gradient_checkpointing=_grpo(train, "gradient_checkpointing"),
            daily=plan.daily_projection,
        )
    rental = facts.rents()
    try:
        allowed = plan.allowed_gpus or rental.gpu_options(train)
    except ValueError as exc:  # its task file, unreadable
        raise PlanError(str(exc)) from None
    spot = rental.spot(train) if plan.spot is None else plan.spot
    assumptions = Assumptions(mfu=plan.mfu, preemption_overhead=plan.preemption_overhead)
    made = make_plan(
        model_config,
        work,
        load_catalog(plan.gpu_catalog),
        allowed=allowed or None,
        spot=spot,
        assumptions=assumptions,
        daily=plan.daily_projection,
        layout=layout_for(train),
    )
    notes = list(made.notes)
    if work.dtype == "float32":
        notes.append("model.compute_dtype=float32 keeps fp32 weights on the GPU (2x bf16); bfloat16 is usual there")
    return made.model_copy(update={"notes": notes})


def apply_plan(cfg: PipelineConfig, plan: Plan) -> PipelineConfig:
    """The config a run on rented GPUs trains with: the plan's batch split, checkpointing and bf16 for every
    `train.grpo` field the user left unset, and the GPU options that fit with the plan's GPU count and strategy,
    cheapest first, as its launcher writes them (`Rental.launch_on`: for sky, `train.sky.accelerators` unless set;
    SkyPilot takes the first one it can get);
    with several GPUs, each `train.distributed` layout field the user left unset (strategy, processes_per_node,
    vllm_server_gpus, vllm_server_node) from the plan. A local run is left as it is.

    >>> from grpo_pipeline.configs.files import packaged
    >>> from grpo_pipeline.configs.schema import load_config
    >>> from grpo_pipeline.tasks.plan import load_model_config
    >>> cfg = load_config(packaged("qwen2.5-7b-qlora.yaml"), ["train.launcher=sky"])
    >>> plan = plan_for_config(cfg.model, cfg.train, cfg.plan, load_model_config(cfg.model.base)[1], "qwen2.5-7b")
    >>> planned = apply_plan(cfg, plan)
    >>> planned.train.sky.accelerators[0] == f"{plan.settings.gpu}:{plan.settings.count}"
    True
    >>> planned.train.grpo["steps_per_generation"] == plan.settings.steps_per_generation  # unset: planned
    True
    >>> planned.train.grpo["gradient_checkpointing"]  # set in the recipe: kept
    True
    """
    facts = LAUNCHERS[cfg.train.launcher]
    if facts.local:
        return cfg
    grpo = {**plan.settings.grpo_overrides(), **cfg.train.grpo}
    settings = plan.settings
    # the same GPU count and strategy as the plan: its batch split holds for those and no other
    fitting = sorted(
        (
            o
            for o in plan.options
            if o.fits
            and o.usd is not None
            and o.count == settings.count
            and o.note == settings.strategy
            and o.nodes == settings.nodes
            and o.vllm_server_gpus == settings.vllm_server_gpus
        ),
        key=lambda o: o.usd if o.usd is not None else math.inf,  # never None: the filter above
    )
    train = facts.rents().launch_on(cfg.train, [f"{o.gpu}:{o.count}" for o in fitting])
    distributed = train.distributed
    if settings.gpus > 1 or settings.strategy not in ("single", "ddp"):
        # the planned layout, as the node launcher reads it (trainers on the first GPUs, the server on the rest),
        # field by field: what the user set stays (the plan was sized with it), the plan fills in the rest. Server
        # mode always sets vllm_server_gpus or vllm_server_node, and the planned strategy must still be written
        unset = {k: v for k, v in settings.distributed_overrides().items() if k not in distributed.model_fields_set}
        if unset:
            distributed = DistributedConfig(**{**distributed.model_dump(exclude_unset=True), **unset})
    world = distributed.world_size(settings.count)
    # TRL's check at start, made before any GPU is rented
    if problem := batch_problem(grpo, world, lambda name: default("GRPOConfig", name)):
        raise PlanError(f"the planned launch ({world} training processes) would fail at start: {problem}")
    return cfg.model_copy(update={"train": train.model_copy(update={"grpo": grpo, "distributed": distributed})})


def plan_run(
    model: ModelConfig,
    train: TrainConfig,
    plan: PlanConfig,
    model_path: str | None = None,
    train_rows: int | None = None,
    priced: Plan | None = None,
) -> Plan:
    """The plan of a run: for the model's own config.json when resolved, else the shipped one.

    `priced`: the plan preflight priced the budget with, for these same sections before the model was resolved
    (`model_path` None); it is the answer again when the resolved model has the same name and architecture,
    the only parts of config.json the planner reads, so the run plans once.
    """
    name, model_config = model_config_for(model.base, model_path)
    if priced is not None and train_rows is None:
        priced_name, priced_config = model_config_for(model.base)
        if (name, architecture(model_config)) == (priced_name, architecture(priced_config)):
            return priced
    return plan_for_config(model, train, plan, model_config, name, train_rows)
