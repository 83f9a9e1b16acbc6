"""The search: for a workload, the cheapest GPU type and count that fit, the batch split and checkpointing
that fit them, time and cost; a run on this machine instead; the budget guard and the actual cost."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field

from grpo_pipeline.configs.layout import DistributedConfig, Strategy, processes_per_node, world_size
from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.tasks.plan.architecture import architecture
from grpo_pipeline.tasks.plan.base import GIB, Frozen, PlanError
from grpo_pipeline.tasks.plan.catalogue import GPU, Catalog, load_catalog
from grpo_pipeline.tasks.plan.memory import (
    SERVER_MEMORY_UTILIZATION,
    MemoryEstimate,
    ServerMemory,
    estimate_memory,
    estimate_vllm_server,
    kv_bytes_per_token,
    weight_bytes_per_param,
)
from grpo_pipeline.tasks.plan.workload import DTYPE_BYTES, Workload


class BudgetExceeded(ConfigError):
    """The run's estimated cost is above `plan.budget_usd`; refused before anything launches."""


class Assumptions(Frozen):
    """The numbers the time and cost estimate rests on; shown with every plan."""

    mfu: float = Field(0.35, gt=0, le=1, description="model FLOPs utilisation of training and prefill")
    decode_efficiency_vllm: float = Field(0.6, gt=0, le=1, description="share of memory bandwidth vLLM decodes at")
    decode_efficiency_transformers: float = Field(
        0.15,
        gt=0,
        le=1,
        description="share of memory bandwidth transformers generate() decodes at (per-token Python overhead)",
    )
    multi_gpu_efficiency: float = Field(0.9, gt=0, le=1, description="throughput kept per GPU when there are several")
    headroom_fraction: float = Field(
        0.95, gt=0, le=1, description="usable share of GPU memory (allocator fragmentation)"
    )
    headroom_gib: float = Field(1.0, ge=0, description="CUDA context and library workspaces")
    setup_minutes: float = Field(15, ge=0, description="provisioning, install, model download, first step")
    preemption_overhead: float = Field(
        0.10, ge=0, description="extra spot GPU-time: lost steps since a checkpoint + restarts"
    )
    days_per_month: float = 30
    max_gpus: int = Field(8, ge=1)
    max_micro_batch_tokens: int = Field(
        16384,
        ge=1,
        description="largest micro-batch tried: past ~16k tokens a GPU is saturated and more only adds memory",
    )
    weight_sync_gbs: float = Field(
        25, gt=0, description="GB/s at which TRL pushes the merged bf16 weights to a vLLM server after each step (NCCL)"
    )


class Layout(Frozen):
    """What the launch already fixes and the search keeps: train.distributed (the config's own type, so the two
    cannot differ), the train.grpo batch fields the user set, train.sky.accelerators' GPU counts. None (or, in
    `distributed`, a field the user left unset): the planner chooses."""

    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig,
        description="train.distributed: its nodes and processes_per_node hold; "
        "its strategy only when set; vllm_server_gpus 0: the fewest that hold the server",
    )
    gpus_per_node: dict[str, int] | None = Field(None, description="GPU name -> GPUs per node (train.sky.accelerators)")
    vllm_server: bool = Field(
        False, description="train.grpo.use_vllm with vllm_mode=server: generation on GPUs of its own"
    )
    per_device_train_batch_size: int | None = Field(None, ge=1)
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    steps_per_generation: int | None = Field(None, ge=1)

    @property
    def strategy(self) -> Strategy | None:
        """The strategy the user set; None: the planner chooses (the config's default, ddp, is a default only)."""
        return self.distributed.strategy if "strategy" in self.distributed.model_fields_set else None


class Settings(Frozen):
    """The launch: `count` GPUs of type `gpu` on each of `nodes` nodes (SkyPilot's `GPU:count` and num_nodes,
    the vLLM server's node included); on each training node processes_per_node trainers on GPUs 0..p-1 and, in
    vllm_mode=server, `trl vllm-serve` on the last vllm_server_gpus (trainer/launch.py's split)."""

    gpu: str
    count: int
    strategy: Literal["single", "ddp", "zero2", "fsdp", "zero3", "local"]  # several GPUs: train.distributed.strategy
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    gradient_checkpointing: bool
    bf16: bool
    vllm_gpu_memory_utilization: float | None = None
    nodes: int = 1
    processes_per_node: int | None = None  # None: count (no server GPUs on the node)
    vllm_server_gpus: int = 0
    vllm_server_node: bool = False
    vllm_tensor_parallel: int = 0  # 0: no vLLM server

    @property
    def train_nodes(self) -> int:
        return self.nodes - self.vllm_server_node

    @property
    def world_size(self) -> int:
        """Training processes, all nodes together: what TRL's batch rule and the per-GPU share count."""
        return world_size(self.train_nodes, self.count, self.processes_per_node, self.vllm_server_gpus)

    @property
    def gpus(self) -> int:
        """Every GPU rented, the server's included: what the price counts."""
        return self.nodes * self.count

    def server_gpus(self) -> str:
        """Which GPUs serve, in the node launcher's terms ('' without a server)."""
        if self.vllm_server_node:
            return f"node {self.nodes - 1} (all {self.count} GPUs)"
        if self.vllm_server_gpus:
            first = self.count - self.vllm_server_gpus
            where = "each node" if self.train_nodes > 1 else "the node"
            return (
                f"GPUs {first}-{self.count - 1} of {where}" if self.vllm_server_gpus > 1 else f"GPU {first} of {where}"
            )
        return ""

    def distributed_overrides(self) -> dict[str, Any]:
        """The `train.distributed` fields this plan sets (`DistributedConfig` names), as the node launcher reads
        them: trainers on the first GPUs of each node, the server on the rest or on a node of its own."""
        return {
            "strategy": "ddp" if self.strategy in ("single", "local") else self.strategy,
            "processes_per_node": self.processes_per_node or self.count,
            "vllm_server_gpus": self.vllm_server_gpus,
            "vllm_server_node": self.vllm_server_node,
        }

    def grpo_overrides(self) -> dict[str, Any]:
        """The `train.grpo` fields this plan sets (TRL GRPOConfig names)."""
        out: dict[str, Any] = {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "steps_per_generation": self.steps_per_generation,
            "gradient_checkpointing": self.gradient_checkpointing,
            "bf16": self.bf16,
        }
        if self.vllm_gpu_memory_utilization is not None:
            out["vllm_gpu_memory_utilization"] = self.vllm_gpu_memory_utilization
        return out


class Estimate(Frozen):
    train_s_per_step: float | None
    generation_s_per_step: float | None
    hours: float | None
    gpu_hours: float
    on_demand_usd: float
    spot_usd: float  # includes the expected preemption overhead
    pricing: Literal["spot", "on-demand", "local"]
    usd_per_gpu_hour: float  # catalog price under the chosen pricing
    usd: float  # the estimate under the chosen pricing: what the budget guard compares
    monthly_usd: float | None  # daily retraining, chosen pricing
    monthly_on_demand_usd: float | None
    monthly_spot_usd: float | None


class Reason(Frozen):
    """Why a GPU type and count was refused: `memory` (an estimate was made and is over the GPU's, or the vLLM
    server's, capacity), `batch` (no split passes the effective batch or TRL's num_generations rule at start) or
    `layout` (the configured processes, server GPUs, strategy or tensor parallel cannot run on it at all)."""

    kind: Literal["memory", "batch", "layout"]
    text: str


# fit's answer: (the settings, their memory, the vLLM server's memory or None, None) when something fits, else
# (None, the estimate at the smallest settings or None, None, why not)
Fit = tuple[Settings | None, MemoryEstimate | None, ServerMemory | None, Reason | None]


class Option(Frozen):
    gpu: str
    count: int | None
    fits: bool
    need_gib: float  # per GPU, at the chosen (or smallest) settings
    capacity_gib: float
    usd: float | None
    hours: float | None
    note: str = ""
    nodes: int = 1
    vllm_server_gpus: int = 0
    refused: Literal["memory", "batch", "layout"] | None = None  # the kind of `note` when it does not fit


class Plan(Frozen):
    model: str
    params: int
    workload: Workload
    memory: MemoryEstimate
    server_memory: ServerMemory | None = None  # per server GPU, vllm_mode=server only
    settings: Settings
    estimate: Estimate
    options: list[Option]
    assumptions: Assumptions
    catalog_as_of: str
    catalog_source: str
    notes: list[str] = []

    def report(self) -> dict[str, Any]:
        """Everything, JSON-ready, with the memory breakdown in GiB (what `grpo-pipeline plan --json` prints)."""
        return {**self.model_dump(mode="json"), "memory_gib": {k: round(v, 3) for k, v in self.memory.gib().items()}}

    def summary(self) -> dict[str, Any]:
        """Flat numbers for MLflow params/metrics. plan_gpus_total: every GPU rented on every node (the vLLM
        server's included, what the price counts); plan_world_size: the training processes among them."""
        return {
            "plan_gpu": self.settings.gpu,
            "plan_gpus_total": self.settings.gpus,
            "plan_nodes": self.settings.nodes,
            "plan_gpus_per_node": self.settings.count,
            "plan_world_size": self.settings.world_size,
            "plan_memory_gib": round(self.memory.total / GIB, 2),
            "plan_hours": self.estimate.hours,
            "cost_usd_estimated": round(self.estimate.usd, 2),
            "plan_pricing": self.estimate.pricing,
            **{f"plan_{k}": v for k, v in self.settings.grpo_overrides().items()},
        }


def _divisors(n: int) -> list[int]:
    """Descending divisors.

    >>> _divisors(12)
    [12, 6, 4, 3, 2, 1]
    """
    return sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)


def capacity_bytes(gpu: GPU, assumptions: Assumptions) -> float:
    return gpu.memory_gib * GIB * assumptions.headroom_fraction - assumptions.headroom_gib * GIB


def _server_layouts(work: Workload, layout: Layout, count: int) -> list[tuple[int, bool]]:
    """(vllm_server_gpus per node, vllm_server_node) to try on nodes of `count` GPUs: none without a server;
    the user's when given; else 1, 2, 4, ... server GPUs per node while trainers keep at least one."""
    fixed = layout.distributed
    if not (work.vllm and layout.vllm_server):
        return [(0, False)]
    if fixed.vllm_server_node:
        return [(0, True)]
    if fixed.vllm_server_gpus:
        return [(fixed.vllm_server_gpus, False)]
    return [(k, False) for k in (1, 2, 4, 8, 16) if k < count]


def fit(
    model_config: dict[str, Any],
    work: Workload,
    gpu: GPU,
    count: int,
    assumptions: Assumptions,
    layout: Layout | None = None,
) -> Fit:
    """The largest per-device batch (and its split) that fits nodes of `count` GPUs of this type, or None.

    `layout` holds what the launch already fixes (nodes, processes, strategy, the vLLM server's GPUs, the batch
    fields the user set); the rest is chosen. Micro-batches are capped at `max_micro_batch_tokens` (at least
    one sequence) unless the user set the per-device batch.

    Returns (Settings, MemoryEstimate, ServerMemory | None, None) or (None, the estimate at the smallest settings
    or None, None, the `Reason`). The reason is memory whenever some memory estimate was made (a split that passed
    the batch rules and could run was sized, and did not fit), else the batch rule's, else the layout's.
    Gradient checkpointing 'auto' leaves it off when a micro-batch of at least one prompt's group
    (num_generations, or the whole per-GPU share if smaller) fits without it: it costs ~1/3 more compute.
    """
    layout = layout or Layout()
    fixed = layout.distributed
    gens = work.num_generations
    if work.effective_batch % gens:
        raise PlanError(
            f"the effective batch ({work.effective_batch}: plan.target_effective_batch, else "
            f"train.grpo.per_device_train_batch_size x gradient_accumulation_steps x training processes) "
            f"must be a multiple of num_generations ({gens}): GRPO normalises rewards within each "
            "prompt's group, and TRL refuses the run at start otherwise"
        )
    cap = max(1, assumptions.max_micro_batch_tokens // (work.prompt_tokens + work.completion_tokens))
    capacity = capacity_bytes(gpu, assumptions)
    server_capacity = gpu.memory_gib * GIB * SERVER_MEMORY_UTILIZATION
    ckpts = [False, True] if work.gradient_checkpointing == "auto" else [work.gradient_checkpointing]
    smallest = None
    # why nothing fits, by kind; a memory reason (some split could run and was sized) beats the others
    why_server = why_batch = why_layout = None
    layouts = _server_layouts(work, layout, count)
    if not layouts:  # server mode, the planner choosing the server's GPUs, and a node of one GPU
        why_layout = (
            f"a vLLM server (vllm_mode=server) needs GPUs of its own, and {count} GPU per node leaves none "
            "to train on beside it"
        )
    for server_gpus, server_node in layouts:
        if not fixed.processes_per_node and server_gpus >= count:
            why_layout = (
                f"{server_gpus} vLLM server GPUs leave no GPU to train on beside them on a node of {count} GPUs"
            )
            continue
        # the launch's default: every GPU the server leaves
        procs = processes_per_node(count, fixed.processes_per_node, server_gpus)
        if procs + server_gpus > count:
            why_layout = f"{procs} processes + {server_gpus} vLLM server GPUs do not fit {count} GPUs per node"
            continue
        world = world_size(fixed.nodes, count, fixed.processes_per_node, server_gpus)
        if work.effective_batch % world:
            why_batch = f"the effective batch ({work.effective_batch}) does not split over {world} training processes"
            continue
        per_gpu = work.effective_batch // world
        tp = count if server_node else server_gpus
        if tp and architecture(model_config).heads % tp:
            why_layout = (
                f"vLLM's tensor-parallel size {tp} does not divide the model's "
                f"{architecture(model_config).heads} attention heads"
            )
            continue
        # least traffic first: ddp replicates everything, zero2 shards gradients and optimizer state, fsdp the
        # weights too (the only one that helps a base too large for one GPU)
        strategies = [layout.strategy] if layout.strategy else ["single"] if world == 1 else ["ddp", "zero2", "fsdp"]
        pdbs = (
            [layout.per_device_train_batch_size]
            if layout.per_device_train_batch_size
            else [b for b in _divisors(per_gpu) if b <= cap]
        )
        for strategy in strategies:
            sharded = strategy in ("fsdp", "zero3")
            if sharded and work.vllm and not tp:
                why_layout = f"{strategy} shards the weights, and colocated vLLM needs the whole model on each GPU"
                continue
            if sharded and work.quantization != "none":
                # a bitsandbytes base is not sharded as the trainer loads it (grpo_pipeline.trainer.distributed.problems)
                why_layout = f"{strategy} cannot shard a bitsandbytes {work.quantization} base"
                continue
            shards = world if sharded else 1
            for ckpt in ckpts:
                floor = min(gens, per_gpu) if (work.gradient_checkpointing == "auto" and not ckpt) else 1
                for pdb in pdbs:
                    if pdb < floor and not layout.per_device_train_batch_size:
                        break
                    accum, rest = divmod(per_gpu, pdb)
                    if rest or (layout.gradient_accumulation_steps not in (None, accum)):
                        why_batch = (
                            f"per_device_train_batch_size x gradient_accumulation_steps x processes = {pdb} "
                            f"x {layout.gradient_accumulation_steps or '?'} x {world} cannot make the "
                            f"effective batch of {work.effective_batch}"
                        )
                        continue
                    for spg in [layout.steps_per_generation] if layout.steps_per_generation else _divisors(accum):
                        if (
                            pdb * world * spg
                        ) % gens:  # TRL refuses this at start (`batch_problem`), after the GPUs are paid for
                            why_batch = (
                                f"per_device_train_batch_size x processes x steps_per_generation = {pdb} x "
                                f"{world} x {spg} = {pdb * world * spg} completions is not a multiple of "
                                f"num_generations ({gens}), which TRL refuses at start"
                            )
                            continue
                        server = None
                        if tp:
                            server = estimate_vllm_server(
                                model_config, work, sequences=pdb * spg * world, tensor_parallel=tp
                            )
                        mem = estimate_memory(
                            model_config,
                            work,
                            per_device_batch=pdb,
                            gradient_checkpointing=ckpt,
                            generation_batch=pdb * spg,
                            shards=shards,
                            vllm_server=bool(tp),
                        )
                        if strategy == "zero2":  # ZeRO-2: each GPU keeps 1/world of the gradients and optimizer state
                            mem = mem.model_copy(
                                update={"gradients": mem.gradients // world, "optimizer": mem.optimizer // world}
                            )
                        if smallest is None or mem.total < smallest.total:
                            smallest = mem
                        if mem.total > capacity:
                            continue
                        if server is not None and server.total > server_capacity:
                            why_server = (
                                f"the vLLM server needs {server.total / GIB:.1f} GiB on each of {tp} GPUs, "
                                f"{server_capacity / GIB:.1f} GiB usable"
                            )
                            continue
                        util = None
                        if work.vllm and not tp:
                            util = math.ceil(mem.vllm / (gpu.memory_gib * GIB) * 20) / 20
                        return (
                            Settings(
                                gpu=gpu.name,
                                count=count,
                                strategy=strategy,
                                per_device_train_batch_size=pdb,
                                gradient_accumulation_steps=accum,
                                steps_per_generation=spg,
                                gradient_checkpointing=ckpt,
                                bf16=work.dtype == "bfloat16",
                                vllm_gpu_memory_utilization=util,
                                nodes=fixed.nodes + server_node,
                                processes_per_node=procs,
                                vllm_server_gpus=server_gpus,
                                vllm_server_node=server_node,
                                vllm_tensor_parallel=tp,
                            ),
                            mem,
                            server,
                            None,
                        )
    if smallest is not None:  # sized: the server's reason when a training share fit (then only it failed)
        return (
            None,
            smallest,
            None,
            Reason(
                kind="memory",
                text=why_server
                or (
                    f"needs {smallest.total / GIB:.1f} GiB per training GPU at the smallest settings, "
                    f"{capacity / GIB:.1f} GiB usable"
                ),
            ),
        )
    if why_batch:
        return None, None, None, Reason(kind="batch", text=why_batch)
    return None, None, None, Reason(kind="layout", text=why_layout or f"no layout was tried on {count} GPUs per node")


def step_seconds(
    model_config: dict[str, Any], work: Workload, settings: Settings, gpu: GPU, assumptions: Assumptions
) -> tuple[float, float]:
    """(training, generation) seconds per optimizer step.

    Training: FLOPs per token = forward 2N + input gradients 2N + weight gradients 2N (full fine-tuning
    only; LoRA's are negligible) + a recomputed forward 2N with checkpointing + the reference forward 2N
    when beta > 0; N = matmul parameters; at `mfu` of the GPU's dense bf16 peak. So LoRA is ~4N per
    token, ~6N with checkpointing; full fine-tuning 6N / 8N.
    Generation: prefill is compute-bound (2N per prompt token); each decoding step reads the weights and
    the KV cache once for the whole generation batch, at `decode_efficiency` of memory bandwidth, or is
    compute-bound (2N per sequence) when the batch is large, whichever is slower. With a vLLM server the
    whole job's generation batch decodes there, tensor-parallel (each of its GPUs reads 1/tp of the weights and
    KV cache), and TRL then pushes the merged bf16 weights to it once per optimizer step (`weight_sync_gbs`);
    trainers and server take turns, so the times add.
    """
    arch = architecture(model_config)
    n = arch.matmul_params
    full = work.lora_rank == 0
    per_token = n * (
        4 + (2 if full else 0) + (2 if settings.gradient_checkpointing else 0) + (2 if work.beta > 0 else 0)
    )
    world = settings.world_size
    seqs = work.effective_batch // world  # per training GPU per optimizer step
    peak = gpu.bf16_tflops * 1e12 * assumptions.mfu
    scale = 1 / assumptions.multi_gpu_efficiency if world > 1 else 1
    train = per_token * seqs * (work.prompt_tokens + work.completion_tokens) / peak * scale

    a = DTYPE_BYTES[work.dtype]
    weight_read = (
        arch.linear_params * weight_bytes_per_param(work.quantization, work.double_quant, work.dtype)
        + arch.other_params * a
    )
    gen_batch = settings.per_device_train_batch_size * settings.steps_per_generation
    tp = settings.vllm_tensor_parallel
    sync = 0.0
    if tp:  # the server: bf16 weights and the whole job's batch, split over its tp GPUs
        weight_read = arch.params * 2 / tp
        gen_batch *= world
        kv_token = kv_bytes_per_token(arch, 2) / min(tp, arch.kv_heads)
        gen_peak = peak * tp
        gen_scale = 1 / assumptions.multi_gpu_efficiency if tp > 1 else 1
        sync = arch.params * 2 / (assumptions.weight_sync_gbs * 1e9)
    else:
        if settings.strategy in ("fsdp", "zero3"):
            weight_read /= world
        kv_token = kv_bytes_per_token(arch, a)
        gen_peak, gen_scale = peak, scale
    rounds = settings.gradient_accumulation_steps // settings.steps_per_generation
    eff = assumptions.decode_efficiency_vllm if work.vllm else assumptions.decode_efficiency_transformers
    bandwidth = gpu.bandwidth_tbs * 1e12 * eff
    decode = 0.0
    for t in range(work.completion_tokens):
        read = weight_read + gen_batch * (work.prompt_tokens + t) * kv_token
        decode += max(read / bandwidth, 2 * n * gen_batch / gen_peak)
    prefill = 2 * n * gen_batch * work.prompt_tokens / gen_peak
    return train, rounds * (prefill + decode) * gen_scale + sync


def _costs(hours: float, count: int, gpu: GPU, spot: bool, assumptions: Assumptions) -> Estimate:
    gpu_hours = hours * count
    on_demand = gpu_hours * gpu.on_demand_usd_h
    spot_usd = gpu_hours * (1 + assumptions.preemption_overhead) * gpu.spot_usd_h
    usd = spot_usd if spot else on_demand
    days = assumptions.days_per_month
    return Estimate(
        train_s_per_step=None,
        generation_s_per_step=None,
        hours=hours,
        gpu_hours=gpu_hours,
        on_demand_usd=on_demand,
        spot_usd=spot_usd,
        pricing="spot" if spot else "on-demand",
        usd_per_gpu_hour=gpu.spot_usd_h if spot else gpu.on_demand_usd_h,
        usd=usd,
        monthly_usd=usd * days,
        monthly_on_demand_usd=on_demand * days,
        monthly_spot_usd=spot_usd * days,
    )


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
    fixed = layout.distributed
    counts = [c for c in (1, 2, 4, 8, 16) if c <= assumptions.max_gpus]
    fallback: list[int] = []  # counts tried only when none of `counts` can run the job
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
    best = None
    options = []
    reasons = []
    for gpu in gpus:
        option = None
        smallest = None
        whys: list[tuple[int, Reason]] = []
        pinned = (layout.gpus_per_node or {}).get(gpu.name)
        for count in [pinned] if pinned else counts + fallback:
            if option is not None and count in fallback:
                break
            settings, mem, server, why_not = fit(model_config, work, gpu, count, assumptions, layout)
            if why_not:
                whys.append((count, why_not))
            if mem is not None and (smallest is None or mem.total < smallest.total):
                smallest = mem
            if settings is None or mem is None:  # fit sizes (mem) whatever it settles (settings)
                continue
            train, gen = step_seconds(model_config, work, settings, gpu, assumptions)
            hours = work.max_steps * (train + gen) / 3600 + assumptions.setup_minutes / 60
            est = _costs(hours, settings.gpus, gpu, spot, assumptions).model_copy(
                update={"train_s_per_step": train, "generation_s_per_step": gen}
            )
            if not daily:
                est = est.model_copy(
                    update={"monthly_usd": None, "monthly_on_demand_usd": None, "monthly_spot_usd": None}
                )
            candidate = (est.usd, hours, settings, mem, est, server)
            if option is None or candidate[:2] < option[:2]:
                option = candidate
        cap = capacity_bytes(gpu, assumptions) / GIB
        if option is None:
            need = smallest.total / GIB if smallest else float("nan")
            # the largest count's memory reason (the nearest to fitting), else the smallest count's batch reason
            # (the world the batch was set for), else the largest count's layout reason
            by_count = [w for _, w in sorted(whys, key=lambda cw: cw[0])]
            memory, batch, layout_ = ([w for w in by_count if w.kind == kind] for kind in ("memory", "batch", "layout"))
            why = memory[-1] if memory else batch[0] if batch else layout_[-1]
            reasons.append((gpu.name, why))
            options.append(
                Option(
                    gpu=gpu.name,
                    count=None,
                    fits=False,
                    need_gib=need,
                    capacity_gib=cap,
                    usd=None,
                    hours=None,
                    note=why.text,
                    refused=why.kind,
                )
            )
            continue
        usd, hours, settings, mem, est, _ = option
        options.append(
            Option(
                gpu=gpu.name,
                count=settings.count,
                fits=True,
                need_gib=mem.total / GIB,
                capacity_gib=cap,
                usd=usd,
                hours=hours,
                note=settings.strategy,
                nodes=settings.nodes,
                vllm_server_gpus=settings.vllm_server_gpus,
            )
        )
        if best is None or (usd, hours) < (best[0], best[1]):
            best = option
    if best is None:
        said = "; ".join(f"{name}: {why.text}" for name, why in reasons)
        if reasons and all(why.kind == "batch" for _, why in reasons):  # the batch rule refused them, not memory
            raise PlanError(
                f"no launch of this batch passes TRL's check at start: {said}; change "
                "train.grpo.per_device_train_batch_size, gradient_accumulation_steps or num_generations, "
                "or train.distributed.nodes / processes_per_node (plan.target_effective_batch: the total)"
            )
        needs = [o.need_gib for o in options if not math.isnan(o.need_gib)]
        if not needs:  # refused before any memory was estimated: the layout itself cannot run
            raise PlanError(f"{work.model} cannot be planned as configured: {said}")
        need = min(needs)
        # GPUs refused for another reason than memory say it: more memory would not make them fit
        other = "; ".join(f"{name}: {why.text}" for name, why in reasons if why.kind != "memory")
        raise PlanError(
            f"{work.model} does not fit any allowed GPU ({', '.join(g.name for g in gpus)}, up to "
            f"{assumptions.max_gpus} per node): it needs at least {need:.1f} GiB per GPU"
            + (f" ({other})" if other else "")
            + ". "
            + ("Quantize the base (model.quantization=nf4), " if work.quantization == "none" else "")
            + "lower the LoRA rank or completion length, enable gradient checkpointing, "
            "or allow larger GPUs (plan.allowed_gpus)"
        )
    _, _, settings, mem, est, server = best
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
    return Plan(
        model=work.model,
        params=arch.params,
        workload=work,
        memory=mem,
        server_memory=server,
        settings=settings,
        estimate=est,
        options=options,
        assumptions=assumptions,
        catalog_as_of=catalog.as_of,
        catalog_source=catalog.source,
        notes=notes,
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
