"""Whether a workload fits nodes of `count` GPUs of one type, and with which settings.

`fit` walks the candidates in order (`candidates`: the launch shapes, the strategies, gradient checkpointing, the
batch splits), sizes each (`size`) and answers with the first that fits; a candidate that cannot run at all is a
`Reason` on the way, and the last of each kind is what a refusal says (`refusal`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

from grpo_pipeline.configs.layout import processes_per_node, world_size
from grpo_pipeline.tasks.plan.architecture import architecture
from grpo_pipeline.tasks.plan.base import GIB, PlanError
from grpo_pipeline.tasks.plan.catalogue import GPU
from grpo_pipeline.tasks.plan.memory import (
    SERVER_MEMORY_UTILIZATION,
    MemoryEstimate,
    ServerMemory,
    estimate_memory,
    estimate_vllm_server,
)
from grpo_pipeline.tasks.plan.values import Assumptions, Layout, Reason, Settings
from grpo_pipeline.tasks.plan.workload import Workload

# fit's answer: (the settings, their memory, the vLLM server's memory or None, None) when something fits, else
# (None, the estimate at the smallest settings or None, None, why not)
Fit = tuple[Settings | None, MemoryEstimate | None, ServerMemory | None, Reason | None]


class Shape(NamedTuple):
    """One way to lay out nodes of `count` GPUs: the vLLM server's GPUs on each (or a node of its own), the
    training processes per node and in all, each process's share of the effective batch, the server's tensor
    parallel size (0: no server)."""

    server_gpus: int
    server_node: bool
    procs: int
    world: int
    per_gpu: int
    tp: int


class Candidate(NamedTuple):
    """Settings to size: a shape, a strategy (and how many ways it shards the weights), checkpointing, a batch
    split (per-device batch, gradient accumulation, steps per generation)."""

    shape: Shape
    strategy: str
    shards: int
    ckpt: bool
    pdb: int
    accum: int
    spg: int


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


def check_groups(work: Workload) -> None:
    """Refuse an effective batch that is not whole groups of num_generations completions (PlanError)."""
    if work.effective_batch % work.num_generations:
        raise PlanError(
            f"the effective batch ({work.effective_batch}: plan.target_effective_batch, else "
            f"train.grpo.per_device_train_batch_size x gradient_accumulation_steps x training processes) "
            f"must be a multiple of num_generations ({work.num_generations}): GRPO normalises rewards within each "
            "prompt's group, and TRL refuses the run at start otherwise"
        )


def shapes(model_config: dict[str, Any], work: Workload, layout: Layout, count: int) -> Iterator[Shape | Reason]:
    """The launch shapes to try on nodes of `count` GPUs, in order; each one that cannot run, as its reason."""
    fixed = layout.distributed
    layouts = _server_layouts(work, layout, count)
    if not layouts:  # server mode, the planner choosing the server's GPUs, and a node of one GPU
        yield Reason(
            kind="layout",
            text=f"a vLLM server (vllm_mode=server) needs GPUs of its own, and {count} GPU per node leaves none "
            "to train on beside it",
        )
    for server_gpus, server_node in layouts:
        if not fixed.processes_per_node and server_gpus >= count:
            yield Reason(
                kind="layout",
                text=f"{server_gpus} vLLM server GPUs leave no GPU to train on beside them on a node of {count} GPUs",
            )
            continue
        # the launch's default: every GPU the server leaves
        procs = processes_per_node(count, fixed.processes_per_node, server_gpus)
        if procs + server_gpus > count:
            yield Reason(
                kind="layout",
                text=f"{procs} processes + {server_gpus} vLLM server GPUs do not fit {count} GPUs per node",
            )
            continue
        world = world_size(fixed.nodes, count, fixed.processes_per_node, server_gpus)
        if work.effective_batch % world:
            yield Reason(
                kind="batch",
                text=f"the effective batch ({work.effective_batch}) does not split over {world} training processes",
            )
            continue
        tp = count if server_node else server_gpus
        if tp and architecture(model_config).heads % tp:
            yield Reason(
                kind="layout",
                text=f"vLLM's tensor-parallel size {tp} does not divide the model's "
                f"{architecture(model_config).heads} attention heads",
            )
            continue
        yield Shape(server_gpus, server_node, procs, world, work.effective_batch // world, tp)


def strategies(work: Workload, layout: Layout, shape: Shape) -> Iterator[tuple[str, int] | Reason]:
    """(strategy, how many ways it shards the weights) to try on a shape, in order; each one that cannot run, as its
    reason. Least traffic first: ddp replicates everything, zero2 shards gradients and optimizer state, fsdp the
    weights too (the only one that helps a base too large for one GPU)."""
    names = [layout.strategy] if layout.strategy else ["single"] if shape.world == 1 else ["ddp", "zero2", "fsdp"]
    for strategy in names:
        sharded = strategy in ("fsdp", "zero3")
        if sharded and work.vllm and not shape.tp:
            yield Reason(
                kind="layout",
                text=f"{strategy} shards the weights, and colocated vLLM needs the whole model on each GPU",
            )
            continue
        if sharded and work.quantization != "none":
            # a bitsandbytes base is not sharded as the trainer loads it (grpo_pipeline.trainer.distributed.problems)
            yield Reason(kind="layout", text=f"{strategy} cannot shard a bitsandbytes {work.quantization} base")
            continue
        yield strategy, shape.world if sharded else 1


def batch_sizes(layout: Layout, per_gpu: int, cap: int) -> list[int]:
    """The per-device batches to try, largest first: the user's, else the divisors of the per-GPU share up to
    `cap` sequences."""
    if layout.per_device_train_batch_size:
        return [layout.per_device_train_batch_size]
    return [b for b in _divisors(per_gpu) if b <= cap]


def splits(
    work: Workload, layout: Layout, shape: Shape, pdbs: list[int], ckpt: bool
) -> Iterator[tuple[int, int, int] | Reason]:
    """(per-device batch, gradient accumulation, steps per generation) to try, in order; each split that does
    not make the effective batch, or that TRL refuses at start, as its reason. Under 'auto', checkpointing off
    tries only per-device batches of at least one prompt's group (or the whole per-GPU share if smaller); the
    smaller ones are tried with it on."""
    gens = work.num_generations
    floor = min(gens, shape.per_gpu) if (work.gradient_checkpointing == "auto" and not ckpt) else 1
    for pdb in pdbs:
        if pdb < floor and not layout.per_device_train_batch_size:
            break
        accum, rest = divmod(shape.per_gpu, pdb)
        if rest or (layout.gradient_accumulation_steps not in (None, accum)):
            yield Reason(
                kind="batch",
                text=f"per_device_train_batch_size x gradient_accumulation_steps x processes = {pdb} "
                f"x {layout.gradient_accumulation_steps or '?'} x {shape.world} cannot make the "
                f"effective batch of {work.effective_batch}",
            )
            continue
        for spg in [layout.steps_per_generation] if layout.steps_per_generation else _divisors(accum):
            if (
                pdb * shape.world * spg
            ) % gens:  # TRL refuses this at start (`batch_problem`), after the GPUs are paid for
                yield Reason(
                    kind="batch",
                    text=f"per_device_train_batch_size x processes x steps_per_generation = {pdb} x "
                    f"{shape.world} x {spg} = {pdb * shape.world * spg} completions is not a multiple of "
                    f"num_generations ({gens}), which TRL refuses at start",
                )
                continue
            yield pdb, accum, spg


def candidates(
    model_config: dict[str, Any], work: Workload, layout: Layout, count: int, cap: int
) -> Iterator[Candidate | Reason]:
    """Every candidate on nodes of `count` GPUs in the order `fit` sizes them (shape, strategy, checkpointing off
    before on, batch split), with the reasons of those that cannot run where they come."""
    ckpts = [False, True] if work.gradient_checkpointing == "auto" else [work.gradient_checkpointing]
    for shape in shapes(model_config, work, layout, count):
        if isinstance(shape, Reason):
            yield shape
            continue
        pdbs = batch_sizes(layout, shape.per_gpu, cap)
        for strategy in strategies(work, layout, shape):
            if isinstance(strategy, Reason):
                yield strategy
                continue
            name, shards = strategy
            for ckpt in ckpts:
                for split in splits(work, layout, shape, pdbs, ckpt):
                    yield split if isinstance(split, Reason) else Candidate(shape, name, shards, ckpt, *split)


def size(model_config: dict[str, Any], work: Workload, c: Candidate) -> tuple[MemoryEstimate, ServerMemory | None]:
    """A candidate's memory on each training GPU, and on each vLLM server GPU (None: no server)."""
    server = None
    if c.shape.tp:
        server = estimate_vllm_server(
            model_config, work, sequences=c.pdb * c.spg * c.shape.world, tensor_parallel=c.shape.tp
        )
    mem = estimate_memory(
        model_config,
        work,
        per_device_batch=c.pdb,
        gradient_checkpointing=c.ckpt,
        generation_batch=c.pdb * c.spg,
        shards=c.shards,
        vllm_server=bool(c.shape.tp),
    )
    if c.strategy == "zero2":  # ZeRO-2: each GPU keeps 1/world of the gradients and optimizer state
        world = c.shape.world
        mem = mem.model_copy(update={"gradients": mem.gradients // world, "optimizer": mem.optimizer // world})
    return mem, server


def settings_for(work: Workload, gpu: GPU, count: int, layout: Layout, c: Candidate, mem: MemoryEstimate) -> Settings:
    """The launch of a candidate that fits; colocated vLLM gets the share of GPU memory it needs, in 5 % steps."""
    util = None
    if work.vllm and not c.shape.tp:
        util = math.ceil(mem.vllm / (gpu.memory_gib * GIB) * 20) / 20
    return Settings(
        gpu=gpu.name,
        count=count,
        strategy=c.strategy,
        per_device_train_batch_size=c.pdb,
        gradient_accumulation_steps=c.accum,
        steps_per_generation=c.spg,
        gradient_checkpointing=c.ckpt,
        bf16=work.dtype == "bfloat16",
        vllm_gpu_memory_utilization=util,
        nodes=layout.distributed.nodes + c.shape.server_node,
        processes_per_node=c.shape.procs,
        vllm_server_gpus=c.shape.server_gpus,
        vllm_server_node=c.shape.server_node,
        vllm_tensor_parallel=c.shape.tp,
    )


def refusal(
    smallest: MemoryEstimate | None, why_server: str | None, why: dict[str, str], capacity: float, count: int
) -> Fit:
    """Why nothing fit: memory whenever a candidate was sized (the server's reason when a training share fit, then
    only it failed), else the last batch reason, else the last layout reason."""
    if smallest is not None:
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
    if why.get("batch"):
        return None, None, None, Reason(kind="batch", text=why["batch"])
    return (
        None,
        None,
        None,
        Reason(kind="layout", text=why.get("layout") or f"no layout was tried on {count} GPUs per node"),
    )


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
    check_groups(work)
    cap = max(1, assumptions.max_micro_batch_tokens // (work.prompt_tokens + work.completion_tokens))
    capacity = capacity_bytes(gpu, assumptions)
    server_capacity = gpu.memory_gib * GIB * SERVER_MEMORY_UTILIZATION
    smallest = None
    why: dict[str, str] = {}  # the last reason of each kind that a candidate could not run
    why_server = None  # the last vLLM server too large for its GPUs
    for c in candidates(model_config, work, layout, count, cap):
        if isinstance(c, Reason):
            why[c.kind] = c.text
            continue
        mem, server = size(model_config, work, c)
        if smallest is None or mem.total < smallest.total:
            smallest = mem
        if mem.total > capacity:
            continue
        if server is not None and server.total > server_capacity:
            why_server = (
                f"the vLLM server needs {server.total / GIB:.1f} GiB on each of {c.shape.tp} GPUs, "
                f"{server_capacity / GIB:.1f} GiB usable"
            )
            continue
        return settings_for(work, gpu, count, layout, c, mem), mem, server, None
    return refusal(smallest, why_server, why, capacity, count)
