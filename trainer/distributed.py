"""What one training process of several needs: its rank, a process group with timeouts, and the few things
the processes must agree on (stop after SIGTERM, the resume point, whose files make a checkpoint).

torchrun (`trainer/launch.py`) starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; without them every helper here is the one-process case and costs nothing, so
`python -m grpo_pipeline.trainer --spec job.json` alone is the single-process trainer it always was. Also here:
`problems`, the checks a launch must pass before any process starts (exit 2 with the numbers and a fix); the
world size and TRL's batch rule they apply are the config's own (`grpo_pipeline.configs.layout`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from grpo_pipeline.configs.layout import batch_problem
from grpo_pipeline.configs.library_fields import fields as library_fields
from grpo_pipeline.trainer.spec import JobSpec

log = logging.getLogger(__name__)
LAUNCH_DIR_ENV = "GRPO_LAUNCH_DIR"  # the node launcher's folder: each local rank's pid and exit code
VLLM_HOST_ENV = "GRPO_VLLM_SERVER_HOST"  # set by the node launcher in vllm_mode=server
SHARDING = ("fsdp", "zero3")  # strategies that split the base's weights between GPUs
T = TypeVar("T")


@dataclass
class Ranks:
    """This process's place in the job. `group` is a gloo group for control messages, so they travel as
    CPU tensors whatever backend (NCCL on GPUs) the training itself uses."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: Any = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: T) -> T:
        """Rank 0's value, on every rank."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather(self, value: T) -> list[T]:
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world  # filled in place, one value per rank
        dist.all_gather_object(out, value, group=self.group)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any: one tiny all-reduce."""
        if self.world == 1:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def gather_checkpoint(self, directory: Path) -> list[str]:
        """Copy into rank 0's `directory` the files other ranks wrote into theirs (each rank its RNG state; under
        FSDP or ZeRO its optimizer shards), so the checkpoint rank 0 uploads holds every rank's state. On one
        machine or several alike: a rank's folder is on its own node's disk. Returns the paths received.

        Sent as objects over the gloo group: a LoRA run's per-rank files are kilobytes to a few hundred MB.
        """
        if self.world == 1:
            return []
        import torch.distributed as dist

        listing = _listing(directory)
        listings = self.all_gather(listing)  # also a barrier: every rank has finished writing its part
        plan: dict[int, list[str]] = {}  # rank -> the paths it sends; rank 0's is the one broadcast
        if self.is_main:
            have = set(_listing(directory))  # re-read: ranks sharing this folder have written into it meanwhile
            for rank, theirs in enumerate(listings[1:], start=1):
                for path in sorted(set(theirs) - have):
                    plan.setdefault(rank, []).append(path)
                    have.add(path)
        plan = self.broadcast(plan)
        mine = [(p, (directory / p).read_bytes()) for p in plan.get(self.rank, [])]
        received: list[list[tuple[str, bytes]]] = [[] for _ in range(self.world)]
        dist.gather_object(mine, received if self.is_main else None, dst=0, group=self.group)
        names = []
        if self.is_main:
            for files in received[1:]:
                for path, data in files:
                    (directory / path).parent.mkdir(parents=True, exist_ok=True)
                    (directory / path).write_bytes(data)
                    names.append(path)
        return names


def _listing(directory: Path) -> dict[str, int]:
    if not directory.is_dir():
        return {}
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in directory.rglob("*") if p.is_file()}


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


_current = Ranks()


def current() -> Ranks:
    """The `Ranks` that `init` made in this process (the one-process one before)."""
    return _current


def init(timeout_s: int) -> Ranks:
    """Join the job's process group when torchrun started this process; the one-process `Ranks` otherwise.

    The group is made here, before the trainer's own, so that its timeout (train.distributed.timeout_s) holds
    from the first collective: accelerate reuses an initialised group.
    """
    world = _env_int("WORLD_SIZE", 1)
    if world == 1:
        return Ranks()
    import torch
    import torch.distributed as dist

    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    timeout = timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
        group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        group = None  # the default group is gloo already
        # On a CPU with several ranks, transformers resumes the optimizer with map_location=args.device, which
        # accelerate makes torch.device("cpu", 0), and torch.load cannot map to "cpu:0"; it is the CPU.
        torch.serialization.register_package(11, lambda obj: None, _cpu_with_index)
    log.info("rank %d/%d (local %d) pid %d", rank, world, local_rank, os.getpid())
    global _current
    _current = Ranks(rank, world, local_rank, group)
    return _current


def _cpu_with_index(storage: T, location: str) -> T | None:
    return storage if location.startswith("cpu:") else None


def finish() -> None:
    """Wait for every rank, then leave the group: no rank exits (and makes torchrun stop the others) while
    rank 0 still uploads the last checkpoint or the final adapter."""
    ranks = _current
    if ranks.world == 1:
        return
    import torch.distributed as dist

    try:
        ranks.barrier()
    except Exception as exc:  # a rank already gone: this rank's own exit code still stands
        log.warning("the final barrier failed (%s); exiting anyway", exc)
    finally:
        dist.destroy_process_group()


def rank_work_dir(work_dir: str, rank: int) -> Path:
    """Rank 0 keeps the spec's work_dir (the result file, the launcher's log); rank N > 0 works beside it in
    `ranks/N`, so two ranks never write one folder and one machine behaves as several nodes do."""
    return Path(work_dir) if rank == 0 else Path(work_dir) / "ranks" / str(rank)


def record(kind: str, value: int) -> None:
    """Leave this rank's pid or exit code where its node launcher reads it (nothing without a launcher)."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if folder:
        path = Path(folder) / f"rank-{os.environ.get('RANK', '0')}.{kind}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(value))
        tmp.replace(path)


# ------------------------------------------------------------------------------------ checks before launch


def _grpo_defaults() -> dict[str, Any]:
    """TRL's GRPOConfig defaults from the project's snapshot of the class (a test compares it with the installed
    one), not from TRL itself: importing TRL loads torch and transformers (10-20 s on a busy CPU), which the node
    launcher's check paid for and then the trainer it execs paid again."""
    return {name: f.default for name, f in library_fields("GRPOConfig").items()}


def problems(spec: JobSpec, gpus_per_node: int, defaults: dict[str, Any] | None = None) -> list[str]:
    """Everything about this launch that would fail after it started, each with the numbers and the fix.

    `gpus_per_node` is what the node has (0: a CPU machine), or, before a SkyPilot launch, what it asks for.
    """
    d, grpo, found = spec.train.distributed, spec.train.grpo, []
    ppn = d.processes(gpus_per_node)
    server = bool(grpo.get("use_vllm")) and grpo.get("vllm_mode", "colocate") == "server"
    if gpus_per_node and ppn + d.vllm_server_gpus > gpus_per_node:
        extra = f" + vllm_server_gpus ({d.vllm_server_gpus})" if d.vllm_server_gpus else ""
        found.append(
            f"train.distributed.processes_per_node ({ppn}){extra} needs {ppn + d.vllm_server_gpus} GPUs on "
            f"a node that has {gpus_per_node}: set processes_per_node <= {gpus_per_node - d.vllm_server_gpus} "
            "(one process per GPU), or ask for more GPUs per node"
        )
    if not gpus_per_node and d.strategy != "ddp":
        found.append(
            f"train.distributed.strategy={d.strategy} needs GPUs (accelerate's FSDP and DeepSpeed do not run "
            "on the CPU): use strategy ddp here, or launch on GPUs (train.launcher=sky)"
        )
    if d.nodes > 1 and not spec.checkpoint_uri.startswith("s3://"):
        found.append(
            f"train.distributed.nodes={d.nodes}: nodes do not share a local checkpoint directory "
            f"({spec.checkpoint_uri}), and every node resumes from the store: set "
            "train.checkpoint_uri=s3://bucket/prefix"
        )
    if d.strategy in SHARDING and spec.model.quantization != "none":
        found.append(
            f"train.distributed.strategy={d.strategy} shards the base's weights, and a bitsandbytes "
            f"{spec.model.quantization} base cannot be sharded as loaded here (FSDP and ZeRO-3 need "
            "bnb_4bit_quant_storage equal to the compute dtype for 4-bit, and do not shard int8): use "
            "strategy ddp or zero2 with a quantized base, or model.quantization=none"
        )
    if server and not (d.vllm_server_gpus or d.vllm_server_node):
        found.append(
            "train.grpo.vllm_mode=server needs GPUs for the server that the trainers do not use: set "
            "train.distributed.vllm_server_gpus=K (on the node) or vllm_server_node=true (a node of its own)"
        )
    if (d.vllm_server_gpus or d.vllm_server_node) and not server:
        found.append(
            "train.distributed.vllm_server_gpus / vllm_server_node give GPUs to a vLLM server only with "
            "train.grpo.use_vllm=true and vllm_mode=server; unset them"
        )
    if d.vllm_server_gpus and d.vllm_server_node:
        found.append("train.distributed: give vllm_server_gpus (GPUs on each node) or vllm_server_node, not both")
    if not gpus_per_node and server:
        found.append("train.grpo.vllm_mode=server needs GPUs; vLLM does not run on the CPU")
    trl = defaults if defaults is not None else _grpo_defaults()
    if batch := batch_problem(grpo, d.world_size(gpus_per_node), trl.get):
        found.append(batch)
    return found
