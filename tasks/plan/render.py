"""A plan for a terminal: Rich tables of the memory breakdown, the chosen settings with time and cost, and
every GPU option (what `grpo-pipeline plan` prints without --json)."""

from __future__ import annotations

from rich.table import Table

from grpo_pipeline.tasks.plan.base import GIB
from grpo_pipeline.tasks.plan.memory import COMPONENTS
from grpo_pipeline.tasks.plan.values import Plan


def plan_tables(plan: Plan) -> list:
    """Rich tables for a terminal: memory breakdown, chosen settings with time and cost, every GPU option."""
    gib = plan.memory.gib()
    memory = Table(
        title=f"{plan.model}: {plan.params / 1e9:.2f} B parameters, {plan.memory.trainable_params / 1e6:,.1f} M trainable"
    )
    memory.add_column("memory per GPU")
    memory.add_column("GiB", justify="right")
    for key in COMPONENTS:
        if gib[key]:
            memory.add_row(key.replace("_", " "), f"{gib[key]:.2f}")
    memory.add_row("peak while training", f"{gib['training_peak']:.2f}")
    memory.add_row("peak while generating", f"{gib['generation_peak']:.2f}")
    memory.add_row("[bold]peak", f"[bold]{gib['total']:.2f}")

    s, e, w = plan.settings, plan.estimate, plan.workload
    chosen = Table(title="plan", show_header=False)
    chosen.add_column()
    chosen.add_column()
    nodes = f"{s.nodes} nodes x " if s.nodes > 1 else ""
    chosen.add_row("GPU", f"{nodes}{s.count}x {s.gpu} ({s.strategy}), {s.gpus} GPUs priced")
    if s.vllm_tensor_parallel:  # the node launcher's split: trainers on the first GPUs, the server on the rest
        trainers = s.processes_per_node or s.count
        where = f"{s.train_nodes} nodes" if s.train_nodes > 1 else "the node"
        chosen.add_row(
            "train",
            f"{s.world_size} processes: GPUs 0-{trainers - 1} of {where}"
            if trainers > 1
            else f"1 process: GPU 0 of {where}",
        )
        chosen.add_row(
            "serve",
            f"trl vllm-serve on {s.server_gpus()}, tensor parallel {s.vllm_tensor_parallel}"
            + (f", {plan.server_memory.total / GIB:.1f} GiB per GPU" if plan.server_memory else ""),
        )
    chosen.add_row(
        "batch",
        f"{s.per_device_train_batch_size} per device x {s.gradient_accumulation_steps} accumulation "
        f"x {s.world_size} processes = {w.effective_batch} completions/step ({w.num_generations} per prompt); "
        f"steps_per_generation {s.steps_per_generation}",
    )
    chosen.add_row(
        "precision",
        f"{w.quantization} base{' + double quant' if w.double_quant else ''}, {w.dtype}, "
        f"gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}, bf16 {s.bf16}",
    )
    if s.vllm_gpu_memory_utilization is not None:
        chosen.add_row("vLLM", f"colocated, vllm_gpu_memory_utilization {s.vllm_gpu_memory_utilization}")
    if e.hours is not None:
        chosen.add_row(
            "time",
            f"{e.hours:.2f} h for {w.max_steps} steps ({e.train_s_per_step:.1f} s training + "
            f"{e.generation_s_per_step:.1f} s generation per step, + setup)",
        )
    chosen.add_row(
        "cost",
        f"${e.usd:,.2f} {e.pricing}"
        + (
            f" (on-demand ${e.on_demand_usd:,.2f}; spot ${e.spot_usd:,.2f} incl. "
            f"{plan.assumptions.preemption_overhead:.0%} preemption overhead)"
            if e.pricing != "local"
            else " (this machine)"
        ),
    )
    if e.monthly_usd is not None and e.pricing != "local":
        chosen.add_row(
            "daily retraining", f"${e.monthly_usd:,.0f}/month ({e.pricing}); on-demand ${e.monthly_on_demand_usd:,.0f}"
        )
    for note in plan.notes:
        chosen.add_row("note", note)
    if plan.catalog_as_of:
        chosen.add_row("prices", f"catalog as of {plan.catalog_as_of}")

    options = Table(title="options (cheapest count of each GPU)")
    for col in ("GPU", "count", "need GiB", "usable GiB", "hours", "USD"):
        options.add_column(col, justify="left" if col == "GPU" else "right")
    for o in sorted(plan.options, key=lambda o: (not o.fits, o.usd or 0)):
        options.add_row(
            o.gpu,
            str(o.count or "-"),
            f"{o.need_gib:.1f}",
            f"{o.capacity_gib:.1f}",
            f"{o.hours:.2f}" if o.hours is not None else "-",
            f"{o.usd:,.2f}" if o.usd is not None else "does not fit",
        )
    return [memory, chosen, options]
