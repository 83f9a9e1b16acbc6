"""The search: for a workload, the cheapest GPU type and count that fit (`make_plan`: each type's best count by
`fit`, priced by `cost`), every other option with its price or why it does not fit; a run on this machine instead
(`plan_local`); the budget guard and the actual cost."""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.tasks.plan.architecture import architecture
from grpo_pipeline.tasks.plan.base import GIB, PlanError
from grpo_pipeline.tasks.plan.catalogue import GPU, Catalog, load_catalog
from grpo_pipeline.tasks.plan.cost import costs, step_seconds
from grpo_pipeline.tasks.plan.fit import capacity_bytes, fit
from grpo_pipeline.tasks.plan.memory import MemoryEstimate, ServerMemory, estimate_memory
from grpo_pipeline.tasks.plan.values import Assumptions, Estimate, Layout, Option, Plan, Reason, Settings
from grpo_pipeline.tasks.plan.workload import Workload


class BudgetExceeded(ConfigError):
    """The run's estimated cost is above `plan.budget_usd`; refused before anything launches."""


class Priced(NamedTuple):
    """Settings that fit, with their time and cost: options compare by (usd, hours)."""

    usd: float
    hours: float
    settings: Settings
    mem: MemoryEstimate
    est: Estimate
    server: ServerMemory | None


def counts_to_try(work: Workload, assumptions: Assumptions, layout: Layout) -> tuple[list[int], list[int]]:
    """(GPUs per node to try, the counts tried only when none of those can run the job)."""
    fixed = layout.distributed
    counts = [c for c in (1, 2, 4, 8, 16) if c <= assumptions.max_gpus]
    fallback: list[int] = []
    if fixed.processes_per_node:  # nodes too small for the processes (+ server GPUs) the launch fixes are no option
        per_node = fixed.processes_per_node + fixed.vllm_server_gpus
        counts = sorted({c for c in counts if c >= per_node} | {per_node})
    elif fixed.vllm_server_gpus and layout.vllm_server and work.vllm:
        # the server's K GPUs come on top of the trainers': a per-device batch and accumulation the user fixed may
        # leave 1 + K (or 2 + K, ...) the only node that runs them. Clouds sell nodes of 1, 2, 4, 8 GPUs, so such a
        # count is a fallback, tried only when no power of two can run the job
        fallback = sorted(
            {p + fixed.vllm_server_gpus for p in counts if p + fixed.vllm_server_gpus <= assumptions.max_gpus}
            - set(counts)
        )
    return counts, fallback


class Query(NamedTuple):
    """What one search sizes and prices every option for: the model, the workload and its step count, the
    assumptions, what the launch fixes, spot or on-demand pricing, whether the run is daily."""

    model_config: dict[str, Any]
    work: Workload
    steps: int
    assumptions: Assumptions
    layout: Layout
    spot: bool
    daily: bool


def price(q: Query, settings: Settings, gpu: GPU) -> tuple[float, Estimate]:
    """(hours, estimate) of the query's steps with these settings, set-up included; no monthly figures unless
    the run is daily."""
    train, gen = step_seconds(q.model_config, q.work, settings, gpu, q.assumptions)
    hours = q.steps * (train + gen) / 3600 + q.assumptions.setup_minutes / 60
    est = costs(hours, settings.gpus, gpu, q.spot, q.assumptions).model_copy(
        update={"train_s_per_step": train, "generation_s_per_step": gen}
    )
    if not q.daily:
        est = est.model_copy(update={"monthly_usd": None, "monthly_on_demand_usd": None, "monthly_spot_usd": None})
    return hours, est


def best_on(
    q: Query, gpu: GPU, counts: tuple[list[int], list[int]]
) -> tuple[Priced | None, MemoryEstimate | None, list[tuple[int, Reason]]]:
    """The cheapest settings on this GPU type (None: none fit), the smallest memory estimate made, and each GPU
    count's reason for not fitting. The counts are train.sky.accelerators' for this type when it pins one, else
    `counts` (counts to try, fallback counts tried only while nothing fits)."""
    tried, fallback = counts
    option: Priced | None = None
    smallest: MemoryEstimate | None = None
    whys: list[tuple[int, Reason]] = []
    pinned = (q.layout.gpus_per_node or {}).get(gpu.name)
    for count in [pinned] if pinned else tried + fallback:
        if option is not None and count in fallback:
            break
        settings, mem, server, why_not = fit(q.model_config, q.work, gpu, count, q.assumptions, q.layout)
        if why_not:
            whys.append((count, why_not))
        if mem is not None and (smallest is None or mem.total < smallest.total):
            smallest = mem
        if settings is None or mem is None:  # fit sizes (mem) whatever it settles (settings)
            continue
        hours, est = price(q, settings, gpu)
        candidate = Priced(est.usd, hours, settings, mem, est, server)
        if option is None or (candidate.usd, candidate.hours) < (option.usd, option.hours):
            option = candidate
    return option, smallest, whys


def deciding_reason(whys: list[tuple[int, Reason]]) -> Reason:
    """Why a GPU type fits at no count: the largest count's memory reason (the nearest to fitting), else the
    smallest count's batch reason (the world the batch was set for), else the largest count's layout reason."""
    by_count = [w for _, w in sorted(whys, key=lambda cw: cw[0])]
    memory, batch, layout = ([w for w in by_count if w.kind == kind] for kind in ("memory", "batch", "layout"))
    return memory[-1] if memory else batch[0] if batch else layout[-1]


def refused_option(gpu: GPU, why: Reason, smallest: MemoryEstimate | None, capacity_gib: float) -> Option:
    return Option(
        gpu=gpu.name,
        count=None,
        fits=False,
        need_gib=smallest.total / GIB if smallest else float("nan"),
        capacity_gib=capacity_gib,
        usd=None,
        hours=None,
        note=why.text,
        refused=why.kind,
    )


def fitting_option(gpu: GPU, best: Priced, capacity_gib: float) -> Option:
    return Option(
        gpu=gpu.name,
        count=best.settings.count,
        fits=True,
        need_gib=best.mem.total / GIB,
        capacity_gib=capacity_gib,
        usd=best.usd,
        hours=best.hours,
        note=best.settings.strategy,
        nodes=best.settings.nodes,
        vllm_server_gpus=best.settings.vllm_server_gpus,
    )


def nothing_fits(
    work: Workload, gpus: list[GPU], reasons: list[tuple[str, Reason]], options: list[Option], assumptions: Assumptions
) -> PlanError:
    """The error when no allowed GPU type fits, naming each one's reason and what to change."""
    said = "; ".join(f"{name}: {why.text}" for name, why in reasons)
    if reasons and all(why.kind == "batch" for _, why in reasons):  # the batch rule refused them, not memory
        return PlanError(
            f"no launch of this batch passes TRL's check at start: {said}; change "
            "train.grpo.per_device_train_batch_size, gradient_accumulation_steps or num_generations, "
            "or train.distributed.nodes / processes_per_node (plan.target_effective_batch: the total)"
        )
    needs = [o.need_gib for o in options if not math.isnan(o.need_gib)]
    if not needs:  # refused before any memory was estimated: the layout itself cannot run
        return PlanError(f"{work.model} cannot be planned as configured: {said}")
    need = min(needs)
    # GPUs refused for another reason than memory say it: more memory would not make them fit
    other = "; ".join(f"{name}: {why.text}" for name, why in reasons if why.kind != "memory")
    return PlanError(
        f"{work.model} does not fit any allowed GPU ({', '.join(g.name for g in gpus)}, up to "
        f"{assumptions.max_gpus} per node): it needs at least {need:.1f} GiB per GPU"
        + (f" ({other})" if other else "")
        + ". "
        + ("Quantize the base (model.quantization=nf4), " if work.quantization == "none" else "")
        + "lower the LoRA rank or completion length, enable gradient checkpointing, "
        "or allow larger GPUs (plan.allowed_gpus)"
    )


def plan_notes(work: Workload, assumptions: Assumptions, settings: Settings, server: ServerMemory | None) -> list[str]:
    """What the chosen plan's time rests on, and where a vLLM server runs and what it costs."""
    notes = [
        f"time assumes MFU {assumptions.mfu:.0%} and decoding at "
        f"{(assumptions.decode_efficiency_vllm if work.vllm else assumptions.decode_efficiency_transformers):.0%}"
        f" of memory bandwidth ({'vLLM' if work.vllm else 'transformers generate()'}); unvalidated on GPUs"
    ]
    if server is not None:
        notes.append(
            f"vllm_mode=server: `trl vllm-serve` on {settings.server_gpus()}, tensor parallel "
            f"{settings.vllm_tensor_parallel}, {server.total / GIB:.1f} GiB per GPU; the price counts its GPUs; "
            f"the merged weights are pushed to it each step at {assumptions.weight_sync_gbs:g} GB/s"
        )
        if settings.vllm_server_gpus and settings.train_nodes > 1:
            notes.append(
                f"vllm_server_gpus on each of {settings.train_nodes} nodes: only the first node's server "
                "generates (TRL's main process talks to one server), the others' GPUs idle; "
                "train.distributed.vllm_server_node=true serves from one node instead"
            )
    return notes


def make_plan(
    model_config: dict[str, Any],
    work: Workload,
    catalog: Catalog | None = None,
    *,
    allowed: list[str] | None = None,
    spot: bool = True,
    assumptions: Assumptions | None = None,
    daily: bool = True,
    layout: Layout | None = None,
) -> Plan:
    """The cheapest GPU type and count (of `allowed`, default: the whole catalog) that fit, with settings,
    time and cost; every other option is listed with its cost or why it does not fit. `layout`: what the
    launch fixes (see `Layout`); the price counts every GPU of every node, a vLLM server's included.

    >>> from grpo_pipeline.tasks.plan import load_model_config
    >>> p = make_plan(load_model_config("qwen2.5-7b")[1], Workload(model="qwen2.5-7b", quantization="nf4"))
    >>> p.settings.count, p.estimate.usd > 0, len(p.options) == len(load_catalog().gpus)
    (1, True, True)
    """
    catalog = catalog or load_catalog()
    assumptions = assumptions or Assumptions()
    if work.max_steps is None:
        raise PlanError("the planner needs a step count: set train.grpo.max_steps (or plan after the data stage)")
    gpus = [catalog.get(name) for name in allowed] if allowed else list(catalog.gpus.values())
    arch = architecture(model_config)
    layout = layout or Layout()
    counts = counts_to_try(work, assumptions, layout)
    query = Query(model_config, work, work.max_steps, assumptions, layout, spot, daily)
    best: Priced | None = None
    options: list[Option] = []
    reasons: list[tuple[str, Reason]] = []
    for gpu in gpus:
        option, smallest, whys = best_on(query, gpu, counts)
        capacity_gib = capacity_bytes(gpu, assumptions) / GIB
        if option is None:
            why = deciding_reason(whys)
            reasons.append((gpu.name, why))
            options.append(refused_option(gpu, why, smallest, capacity_gib))
            continue
        options.append(fitting_option(gpu, option, capacity_gib))
        if best is None or (option.usd, option.hours) < (best.usd, best.hours):
            best = option
    if best is None:
        raise nothing_fits(work, gpus, reasons, options, assumptions)
    return Plan(
        model=work.model,
        params=arch.params,
        workload=work,
        memory=best.mem,
        server_memory=best.server,
        settings=best.settings,
        estimate=best.est,
        options=options,
        assumptions=assumptions,
        catalog_as_of=catalog.as_of,
        catalog_source=catalog.source,
        notes=plan_notes(work, assumptions, best.settings, best.server),
    )


def local_ram_bytes() -> int:
    """Physical memory of this machine (Linux/macOS sysconf)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def plan_local(
    model_config: dict[str, Any],
    work: Workload,
    *,
    per_device_batch: int,
    gradient_accumulation: int,
    gradient_checkpointing: bool,
    daily: bool = True,
) -> Plan:
    """A run on this machine's CPU: memory of the configured settings against its RAM, and no rental cost.

    Time is not estimated: CPU throughput is not in the catalog and would be a guess.

    >>> from grpo_pipeline.tasks.plan import load_model_config
    >>> p = plan_local(load_model_config("smollm2-135m")[1], Workload(model="smollm2-135m", dtype="float32",
    ...                effective_batch=16), per_device_batch=16, gradient_accumulation=1, gradient_checkpointing=False)
    >>> p.settings.gpu, p.estimate.usd, p.estimate.hours
    ('local-cpu', 0.0, None)
    """
    arch = architecture(model_config)
    mem = estimate_memory(
        model_config,
        work,
        per_device_batch=per_device_batch,
        gradient_checkpointing=gradient_checkpointing,
        generation_batch=per_device_batch * gradient_accumulation,
    )
    ram = local_ram_bytes()
    settings = Settings(
        gpu="local-cpu",
        count=1,
        strategy="local",
        per_device_train_batch_size=per_device_batch,
        gradient_accumulation_steps=gradient_accumulation,
        steps_per_generation=gradient_accumulation,
        gradient_checkpointing=gradient_checkpointing,
        bf16=False,
    )
    zero = 0.0 if daily else None
    est = Estimate(
        train_s_per_step=None,
        generation_s_per_step=None,
        hours=None,
        gpu_hours=0.0,
        on_demand_usd=0.0,
        spot_usd=0.0,
        pricing="local",
        usd_per_gpu_hour=0.0,
        usd=0.0,
        monthly_usd=zero,
        monthly_on_demand_usd=zero,
        monthly_spot_usd=zero,
    )
    fits = not ram or mem.total <= ram
    option = Option(
        gpu="local-cpu",
        count=1,
        fits=fits,
        need_gib=mem.total / GIB,
        capacity_gib=ram / GIB,
        usd=0.0,
        hours=None,
        note="this machine's RAM",
    )
    notes = ["train.launcher=local: runs on this machine, no GPU rented, cost 0 USD; time not estimated"]
    if not fits:
        notes.append(f"needs {mem.total / GIB:.1f} GiB but this machine has {ram / GIB:.1f} GiB of RAM")
    return Plan(
        model=work.model,
        params=arch.params,
        workload=work,
        memory=mem,
        settings=settings,
        estimate=est,
        options=[option],
        assumptions=Assumptions(),
        catalog_as_of="",
        catalog_source="",
        notes=notes,
    )


def check_budget(plan: Plan, budget_usd: float | None) -> None:
    """Refuse a run whose estimated cost is above the budget (None = no limit), before anything launches.

    >>> from grpo_pipeline.tasks.plan import load_model_config
    >>> p = make_plan(load_model_config("qwen2.5-0.5b")[1], Workload(model="qwen2.5-0.5b", max_steps=10))
    >>> check_budget(p, None); check_budget(p, 1e6)
    >>> try: check_budget(p, 0.01)
    ... except BudgetExceeded as error: print(error)  # doctest: +ELLIPSIS
    estimated cost ... exceeds plan.budget_usd = $0.01...
    """
    if budget_usd is None or plan.estimate.usd <= budget_usd:
        return
    s, e = plan.settings, plan.estimate
    raise BudgetExceeded(
        f"estimated cost ${e.usd:,.2f} ({e.pricing}, {s.count}x {s.gpu}, {e.hours:.2f} h for "
        f"{plan.workload.max_steps} steps"
        + (
            f", incl. {plan.assumptions.preemption_overhead:.0%} expected preemption overhead"
            if e.pricing == "spot"
            else ""
        )
        + f") exceeds plan.budget_usd = ${budget_usd:,.2f}; lower train.grpo.max_steps or the completion length, "
        f"quantize the base, use spot GPUs, or raise plan.budget_usd"
    )


def actual_cost(gpu_hours: float | None, plan: Plan) -> float:
    """What the launched job cost: GPU-hours (summed across preemptions and restarts, so lost work is
    already in them) x the plan's price per GPU-hour; 0 for a local run.

    >>> from grpo_pipeline.tasks.plan import load_model_config
    >>> p = make_plan(load_model_config("qwen2.5-0.5b")[1], Workload(model="qwen2.5-0.5b", max_steps=10),
    ...               allowed=["L4"], spot=False)
    >>> actual_cost(2.0, p)
    1.61
    """
    if not gpu_hours or plan.estimate.pricing == "local":
        return 0.0
    return round(gpu_hours * plan.estimate.usd_per_gpu_hour, 6)
