"""The planner's values: what the search assumes (`Assumptions`), what the launch fixes (`Layout`), what it
chooses (`Settings`), what that costs (`Estimate`), why a GPU was refused (`Reason`), each GPU's `Option`, and
the `Plan` that gathers them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from grpo_pipeline.configs.layout import DistributedConfig, Strategy, world_size
from grpo_pipeline.tasks.plan.base import GIB, Frozen
from grpo_pipeline.tasks.plan.memory import MemoryEstimate, ServerMemory
from grpo_pipeline.tasks.plan.workload import Workload


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
