"""The distributed layout, typed once: how many processes train on how many nodes, what each GPU holds, and
the two rules every reader of it applies (the world size, and TRL's rule that a batch holds whole groups).

`train.distributed` in the pipeline's config, the job spec the trainer reads on the node
(`grpo_pipeline.trainer.spec.TrainSettings.distributed`) and the planner's fixed layout
(`grpo_pipeline.tasks.plan.Layout`) are this one class, so a field, a bound or a default cannot differ between
them. Pure pydantic and the standard library, importing nothing else of the project: the trainer, a leaf that
a node runs alone, may import this module and the config's other sections it runs as they are (health, sampling,
rewards), and no other of `configs` (tests/unit/test_layers.py holds it so).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Strategy = Literal["ddp", "fsdp", "zero2", "zero3"]

# Keys of accelerate's config file that train.distributed itself sets (nodes, processes, strategy) or that
# train.grpo does (precision): given in train.distributed.accelerate they would disagree with the launch.
ACCELERATE_OWNED = {
    "distributed_type",
    "num_machines",
    "num_processes",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "mixed_precision",
    "use_cpu",
    "gpu_ids",
}


def processes_per_node(gpus_per_node: int, processes: int | None = None, vllm_server_gpus: int = 0) -> int:
    """Training processes on one node: `processes` when set, else one per GPU the vLLM server leaves, and one on
    a machine without GPUs (`gpus_per_node` 0), as `grpo_pipeline.trainer.launch` starts them.

    >>> processes_per_node(8), processes_per_node(8, vllm_server_gpus=2), processes_per_node(0), processes_per_node(8, 4)
    (8, 6, 1, 4)
    """
    return processes or max(gpus_per_node - vllm_server_gpus, 1)


def world_size(nodes: int, gpus_per_node: int, processes: int | None = None, vllm_server_gpus: int = 0) -> int:
    """Training processes of the whole job, `nodes` training nodes together (a vLLM server's own node not among
    them): what TRL's batch rule and each process's share of the batch count.

    >>> world_size(2, 8), world_size(2, 8, vllm_server_gpus=2), world_size(1, 0), world_size(3, 8, processes=4)
    (16, 12, 1, 12)
    """
    return nodes * processes_per_node(gpus_per_node, processes, vllm_server_gpus)


def batch_problem(grpo: dict[str, Any], world: int, default: Callable[[str], Any]) -> str | None:
    """TRL's rule for `world` processes, checked before any launch: each generation batch holds whole groups of
    num_generations. `default(name)`: GRPOConfig's default for a field `grpo` leaves unset (None counts as unset).

    >>> trl = {"gradient_accumulation_steps": 1}.get
    >>> batch_problem({"num_generations": 8, "per_device_train_batch_size": 4}, 3, trl)
    'the global batch per_device_train_batch_size x processes x steps_per_generation = 4 x 3 x 1 = 12 completions is not a multiple of num_generations (8), and TRL needs whole groups: set train.grpo.per_device_train_batch_size=8'
    >>> batch_problem({"num_generations": 4, "per_device_train_batch_size": 2}, 2, trl) is None
    True
    >>> batch_problem({"num_generations": 4, "per_device_train_batch_size": 2, "generation_batch_size": 6}, 2, trl)
    'train.grpo.generation_batch_size (6) is not a multiple of per_device_train_batch_size x processes = 2 x 2 = 4: set it to 8'
    """

    def get(name: str) -> Any:
        return grpo[name] if grpo.get(name) is not None else default(name)

    pdb, gens = int(get("per_device_train_batch_size")), int(get("num_generations"))
    gbs = grpo.get("generation_batch_size")
    if gbs is not None:
        if gbs % (pdb * world):
            return (
                f"train.grpo.generation_batch_size ({gbs}) is not a multiple of per_device_train_batch_size x "
                f"processes = {pdb} x {world} = {pdb * world}: set it to {math.ceil(gbs / (pdb * world)) * pdb * world}"
            )
        total = gbs
        how = f"generation_batch_size = {gbs}"
    else:
        steps = int(grpo.get("steps_per_generation") or get("gradient_accumulation_steps") or 1)
        total = pdb * world * steps
        how = f"per_device_train_batch_size x processes x steps_per_generation = {pdb} x {world} x {steps} = {total}"
        if total % gens:
            unit = gens // math.gcd(gens, world * steps)  # the per-device batches that give whole groups
            return (
                f"the global batch {how} completions is not a multiple of num_generations ({gens}), and TRL needs "
                f"whole groups: set train.grpo.per_device_train_batch_size={math.ceil(pdb / unit) * unit}"
            )
    if total % gens:
        return f"{how} completions is not a multiple of num_generations ({gens}): TRL needs whole groups"
    return None


class DistributedConfig(BaseModel):
    """How many processes train, on how many nodes, and what each GPU holds. `trainer/launch.py` runs them
    under torchrun, with FSDP / DeepSpeed set up from configs/accelerate/<strategy>.yaml (TRL's recipes).
    The defaults train on every GPU of one node (one process on a CPU machine), each holding the whole model."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    nodes: int = Field(
        1, ge=1, description="machines; more than one needs train.launcher=sky and an s3:// checkpoint_uri"
    )
    processes_per_node: int | None = Field(
        None,
        ge=1,
        description="training processes per node, one per GPU; None: as many as the node has GPUs (1 on a CPU)",
    )
    strategy: Strategy = Field(
        "ddp",
        description="ddp: each GPU holds everything (fastest while it fits); zero2: optimizer state and gradients "
        "sharded (DeepSpeed); zero3 / fsdp: the weights too (DeepSpeed / FSDP2): least memory per GPU, most traffic",
    )
    timeout_s: int = Field(
        600,
        ge=30,
        description="collective and rendezvous timeout: a dead or stuck rank ends the job after this, never a hang",
    )
    accelerate: dict[str, Any] = Field(
        default_factory=dict,
        description="merged over configs/accelerate/<strategy>.yaml (accelerate's config-file format), "
        "e.g. {fsdp_config: {fsdp_activation_checkpointing: true}} or {deepspeed_config: {offload_optimizer_device: cpu}}",
    )
    vllm_server_gpus: int = Field(
        0,
        ge=0,
        description="with train.grpo vllm_mode=server: GPUs of each node given to `trl vllm-serve`; trainers get the rest",
    )
    vllm_server_node: bool = Field(
        False, description="with vllm_mode=server on several nodes: one more node runs `trl vllm-serve` on all its GPUs"
    )

    @field_validator("accelerate")
    @classmethod
    def _not_owned(cls, v: dict[str, Any]) -> dict[str, Any]:
        if owned := sorted(ACCELERATE_OWNED & set(v)):
            raise ValueError(
                f"{owned} follow from train.distributed (nodes, processes_per_node, strategy) and "
                "train.grpo (bf16); set them there"
            )
        return v

    def processes(self, gpus_per_node: int) -> int:
        """Training processes on a node of `gpus_per_node` GPUs (0: a CPU machine) under this layout."""
        return processes_per_node(gpus_per_node, self.processes_per_node, self.vllm_server_gpus)

    def world_size(self, gpus_per_node: int) -> int:
        """Training processes of the job on nodes of `gpus_per_node` GPUs.

        >>> DistributedConfig(nodes=2, vllm_server_gpus=1).world_size(4), DistributedConfig().world_size(0)
        (6, 1)
        """
        return world_size(self.nodes, gpus_per_node, self.processes_per_node, self.vllm_server_gpus)
