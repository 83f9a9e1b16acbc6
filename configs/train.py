"""`train.*`: what trains and how. TRL's `GRPOConfig` and PEFT's `LoraConfig` fields pass
through `train.grpo` and `train.lora`, checked against those classes' own fields, types and ranges (the snapshot in
`library_fields.json`, `library_ranges`), so nothing here re-declares them. The rewards (`reward_set()` resolves the
run's `RewardSet`), the launcher and SkyPilot, checkpoints, and the sections the trainer's job spec carries as they
are (`distributed`, `health`, `curriculum`, `dynamic_sampling`), with the checks across them a launch needs. The
fields the trainer reads are declared once, in `configs/trainer_fields.py`, which the job spec builds on too."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from grpo_pipeline.configs import library_fields, library_ranges
from grpo_pipeline.configs.base import StrictModel, close_match
from grpo_pipeline.configs.health import NON_FINITE
from grpo_pipeline.configs.launchers import LAUNCHERS, LauncherName, launcher_help, rented
from grpo_pipeline.configs.layout import batch_problem
from grpo_pipeline.configs.rewards import AUTO, ENTRY_FORM, RewardEntry, RewardSet
from grpo_pipeline.configs.trainer_fields import TrainerFields


def _check_passthrough(values: dict[str, Any], cls_name: str, owned: set[str]) -> dict[str, Any]:
    """Check keys and value types against a library dataclass (GRPOConfig, LoraConfig), from its snapshot."""
    fields = library_fields.fields(cls_name)
    for key, value in values.items():
        if key in owned:
            raise ValueError(f"'{key}' is set by the pipeline itself and cannot be overridden here")
        if key not in fields:
            raise ValueError(f"'{key}' is not a {cls_name} field{close_match(key, fields)}")
        try:
            TypeAdapter(fields[key].type).validate_python(value)
        except ValidationError as exc:
            raise ValueError(f"'{key}'={value!r} does not fit {cls_name}: {exc.errors()[0]['msg']}") from None
        library_ranges.check(cls_name, key, value)
    return values


class SkyConfig(StrictModel):
    """How `train.launcher=sky` launches the trainer as a SkyPilot managed job."""

    task_yaml: str = Field("sky/train.yaml", description="SkyPilot task YAML, relative to the project root")
    accelerators: list[str] | None = Field(
        None, description="ordered GPU candidates, e.g. ['H100:1', 'A100-80GB:1']; default: the YAML's list"
    )
    use_spot: bool = Field(True, description="spot instances: 60-80% cheaper, preemptions resumed from checkpoints")
    poll_seconds: float = Field(30, gt=0, description="how often the job's state is read")


def _grpo_default(name: str) -> Any:
    """GRPOConfig's default for a field (from the snapshot: no TRL import), for the batch rule."""
    return library_fields.default("GRPOConfig", name)


def dynamic_sampling_problem(grpo: dict[str, Any], world: int, default: Any) -> str | None:
    """Dynamic sampling keeps or drops whole groups on each process alone, so each process's generation batch
    must hold whole groups of num_generations (TRL only asks it of the global batch).

    >>> trl = {"gradient_accumulation_steps": 1}.get
    >>> dynamic_sampling_problem({"num_generations": 4, "per_device_train_batch_size": 2}, 2, trl)
    'train.dynamic_sampling needs whole groups on each process: per_device_train_batch_size x steps_per_generation = 2 x 1 = 2 completions is not a multiple of num_generations (4): set train.grpo.per_device_train_batch_size=4, or train.dynamic_sampling.enabled=false'
    >>> dynamic_sampling_problem({"num_generations": 4, "per_device_train_batch_size": 4}, 2, trl) is None
    True
    """

    def get(name: str) -> Any:
        return grpo[name] if grpo.get(name) is not None else default(name)

    pdb, gens = int(get("per_device_train_batch_size")), int(get("num_generations"))
    gbs = grpo.get("generation_batch_size")
    steps = (
        int(gbs) // (pdb * world)
        if gbs is not None
        else int(grpo.get("steps_per_generation") or get("gradient_accumulation_steps") or 1)
    )
    if (pdb * steps) % gens == 0:
        return None
    return (
        f"train.dynamic_sampling needs whole groups on each process: per_device_train_batch_size x "
        f"steps_per_generation = {pdb} x {steps} = {pdb * steps} completions is not a multiple of num_generations "
        f"({gens}): set train.grpo.per_device_train_batch_size={math.ceil(pdb / gens) * gens}, or "
        "train.dynamic_sampling.enabled=false"
    )


# Fields of GRPOConfig that the trainer derives from the spec; letting YAML set them would break resume.
GRPO_OWNED = {"output_dir", "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint"}


class TrainConfig(TrainerFields):
    """`train.*`: the fields the trainer reads (`TrainerFields`, declared there once), and where, how and with
    which rewards it is launched."""

    rewards: list[RewardEntry] = Field(
        # the skill alone: a format reward beside it is learned first and can displace the skill
        # (configs/demo-cpu.yaml says what it cost); the evaluation reports the format all the same
        default_factory=lambda: [RewardEntry(name=AUTO)],  # chosen from the task's answers (tasks/data/shape.py)
        description="the rewards, one entry each: {name, weight (1.0), args ({}), role (skill|shaping)}, or a bare "
        "name; names from grpo_pipeline.trainer.rewards.REWARDS (`grpo-pipeline rewards` lists them) or dotted paths "
        "'package.module:function'. Their weighted sum is what GRPO normalizes per group; the skill reward (the "
        "answer checker) is what every stage judges a model by (docs/training.md#rewards)",
    )
    checkpoint_uri: str | None = Field(
        None,
        description="root for checkpoints, a local directory or s3://bucket/prefix; each run writes under <root>/<run>; default: data_dir/runs/<run>/checkpoints",
    )
    max_restarts: int = Field(3, ge=0, description="relaunches after an abnormal trainer exit (not preemptions)")
    launcher: LauncherName = Field("local", description=launcher_help())
    sky: SkyConfig = SkyConfig()

    @field_validator("grpo")
    @classmethod
    def _grpo_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_passthrough(v, "GRPOConfig", GRPO_OWNED)

    @field_validator("lora")
    @classmethod
    def _lora_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_passthrough(v, "LoraConfig", set())

    @model_validator(mode="before")
    @classmethod
    def _rewards_entered_once(cls, data: Any) -> Any:
        """The weights and arguments live in each reward's entry; the loose fields they were once entered in (and
        TRL's own list) are refused with the entry form, never merged."""
        if not isinstance(data, dict):
            return data
        grpo = data.get("grpo")
        loose = [f"train.{key}" for key in ("reward_weights", "reward_args") if key in data]
        if isinstance(grpo, dict) and "reward_weights" in grpo:
            loose.append("train.grpo.reward_weights")
        if loose:
            raise ValueError(
                f"{' and '.join(loose)}: a reward's weight and arguments are set in its own entry of train.rewards, "
                f"e.g. {ENTRY_FORM}, or {{name: remote_verifier, args: {{url: 'http://grader:8000/score'}}}}"
            )
        return data

    @field_validator("rewards")
    @classmethod
    def _some_reward(cls, v: list[RewardEntry]) -> list[RewardEntry]:
        if not v:  # the names themselves are resolved at preflight (`grpo_pipeline.tasks.job.check_rewards`)
            raise ValueError("at least one reward is needed")
        return v

    @model_validator(mode="after")
    def _one_skill(self) -> TrainConfig:
        """The set must hold exactly one skill reward, named or by default, before any work (`RewardSet`)."""
        try:
            self.reward_set()
        except ValidationError as exc:  # the set's own message names train.rewards and the fix
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return self

    def reward_set(self) -> RewardSet:
        """The rewards as one value: each entry's name, weight, arguments and resolved role. The job spec carries
        it whole to the trainer (`grpo_pipeline.tasks.job.train_settings`)."""
        return RewardSet(entries=tuple(self.rewards))

    @model_validator(mode="after")
    def _rollback_has_checkpoints(self) -> TrainConfig:
        """A rollback returns to a checkpoint; with none written before the last step there is none to return to."""
        max_steps = self.grpo.get("max_steps")
        if not (isinstance(max_steps, int) and max_steps > 0 and self.checkpoint_every >= max_steps):
            return self
        nf = self.health.rule(NON_FINITE)
        if nf.action == "rollback" and "action" not in nf.model_fields_set:
            nf.action = "stop"  # the default asks for a rollback only where there is a checkpoint to return to
        if rolling := self.health.rolls_back():
            raise ValueError(
                f"train.health.{rolling[0]}.action=rollback needs checkpoints to return to, and train.checkpoint_every "
                f"({self.checkpoint_every}) >= train.grpo.max_steps ({max_steps}) writes none before the end: lower "
                f"train.checkpoint_every, or set train.health.{rolling[0]}.action=stop"
            )
        return self

    @model_validator(mode="after")
    def _launchable(self) -> TrainConfig:
        """What the launch needs that the train section alone can tell; the node checks the rest
        (grpo_pipeline.trainer.distributed.problems: GPUs present, strategy vs quantization), and preflight before that."""
        d, launcher = self.distributed, LAUNCHERS[self.launcher]
        if d.nodes > 1 and launcher.local:
            raise ValueError(
                f"train.distributed.nodes={d.nodes} needs train.launcher={rented()}: the {self.launcher} launcher "
                "runs one machine"
            )
        if d.nodes > 1 and not (self.checkpoint_uri or "").startswith("s3://"):
            raise ValueError(
                f"train.distributed.nodes={d.nodes}: nodes share no local checkpoint directory and each "
                "resumes from the store: set train.checkpoint_uri=s3://bucket/prefix"
            )
        gpu_counts = launcher.gpu_counts(self)
        if gpu_counts is not None and d.processes_per_node:
            need = d.processes_per_node + d.vllm_server_gpus
            if short := [c for c in gpu_counts if c < need]:
                raise ValueError(
                    f"train.distributed.processes_per_node={d.processes_per_node}"
                    f"{f' + vllm_server_gpus={d.vllm_server_gpus}' if d.vllm_server_gpus else ''} needs {need} "
                    f"GPUs per node, and train.sky.accelerators offers {short}: ask for GPU:{need}, or "
                    "set fewer processes (one per GPU)"
                )
        # each GPU count the launch may get; where the machine says (a local run), one process per GPU: the node
        # knows how many (checked there), so the count here is the CPU machine's 0, one process per node
        counts = gpu_counts if gpu_counts is not None and not d.processes_per_node else [0]
        for world in [d.world_size(c) for c in counts]:
            if problem := batch_problem(self.grpo, world, _grpo_default):
                raise ValueError(f"train.distributed ({world} processes): {problem}")
            if self.dynamic_sampling.enabled and (problem := dynamic_sampling_problem(self.grpo, world, _grpo_default)):
                raise ValueError(f"{problem} ({world} process{'es' if world > 1 else ''})")
        return self
