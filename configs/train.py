"""`train.*`: what trains and how. TRL's `GRPOConfig` and PEFT's `LoraConfig` fields pass
through `train.grpo` and `train.lora`, checked against those classes' own fields, types and ranges (the snapshot in
`library_fields.json`, `library_ranges`), so nothing here re-declares them. The rewards (`reward_set()` resolves the
run's `RewardSet`), the launcher and SkyPilot, checkpoints, and the sections the trainer's job spec carries as they
are (`distributed`, `health`, `curriculum`, `dynamic_sampling`), with the checks across them a launch needs."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from grpo_pipeline.configs import library_fields, library_ranges
from grpo_pipeline.configs.base import StrictModel, close_match
from grpo_pipeline.configs.health import NON_FINITE, HealthConfig
from grpo_pipeline.configs.launchers import LAUNCHERS, LauncherName, launcher_help, rented
from grpo_pipeline.configs.layout import DistributedConfig, batch_problem
from grpo_pipeline.configs.rewards import ENTRY_FORM, RewardEntry, RewardSet
from grpo_pipeline.configs.sampling import CurriculumConfig, DynamicSamplingConfig


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


class TrainConfig(StrictModel):
    grpo: dict[str, Any] = Field(default_factory=dict, description="passed to trl.GRPOConfig")
    lora: dict[str, Any] = Field(default_factory=dict, description="passed to peft.LoraConfig")
    rewards: list[RewardEntry] = Field(
        default_factory=lambda: [RewardEntry(name="correct_answer"), RewardEntry(name="number_only")],
        description="the rewards, one entry each: {name, weight (1.0), args ({}), role (skill|shaping)}, or a bare "
        "name; names from grpo_pipeline.trainer.rewards.REWARDS (`grpo-pipeline rewards` lists them) or dotted paths "
        "'package.module:function'. Their weighted sum is what GRPO normalizes per group; the skill reward (the "
        "answer checker) is what every stage judges a model by (docs/training.md#rewards)",
    )
    checkpoint_uri: str | None = Field(
        None,
        description="root for checkpoints, a local directory or s3://bucket/prefix; each run writes under <root>/<run>; default: data_dir/runs/<run>/checkpoints",
    )
    checkpoint_every: int = Field(10, ge=1, description="steps between checkpoints: the most a preemption loses")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept in the store")
    early_stopping_patience: int | None = Field(
        None, ge=1, description="stop after this many evaluations without a better validation reward"
    )
    # The step's cuts (trainer/step.py): each computes what TRL's path computes. Unset (auto): on where it can apply,
    # TRL's path silently where it cannot; true: on, with one warning naming the setting and why where it cannot;
    # false: TRL's path.
    merged_generation: bool | None = Field(
        None,
        description="sample completions from the LoRA adapter merged into a copy of the base weights (exact: the "
        "base is put back bit for bit; the loss's forward and backward stay unmerged); unset: on where the node "
        "has no GPU (a cheaper decode step there, bench.step_profile), off on GPU nodes (the merged copy costs "
        "the adapted weights' memory again while generating). Cannot apply to a quantized base, a LoRA variant or "
        "bias, a LoRA dropout above 0 (TRL samples in train mode), vLLM or sharded weights: there it samples from "
        "the unmerged adapter, with a warning if set to true (trainer/generation.py)",
    )
    prefill_once: bool | None = Field(
        None,
        description="prefill each distinct prompt once and share its KV cache with the rows that repeat it (TRL "
        "repeats each prompt num_generations times before generate, which prefills every copy); the same decode "
        "batch and sampling draws, so the same completions, log-probs equal to float rounding. Unset: on where it "
        "can apply; it cannot with a static or quantized cache, beam search, assisted or vLLM generation, dropout "
        "while sampling: there generate prefills every row, with a warning if set to true (trainer/generation.py)",
    )
    share_prompt_forward: bool | None = Field(
        None,
        description="the loss's forward and backward run each distinct prompt once and share its keys and values "
        "with the rows that repeat it (TRL runs every copy: num_generations per prompt); the same log-probs, loss "
        "and gradients to float rounding. Unset: on where it can apply; it cannot with gradient checkpointing, "
        "dropout in train mode, DDP/FSDP wrappers, multimodal inputs: there every row runs, with a warning if set "
        "to true (trainer/shared_prompt.py)",
    )
    compact_lm_head: bool | None = Field(
        None,
        description="on a CPU node, TRL's fused LM head projects only the completion's positions onto the vocabulary, "
        "as it does on GPUs (same log-probs and loss; TRL's CPU path projects the prompt's positions too and drops "
        "them). Unset: on where this TRL has the compact branch, with a warning if set to true and it has not "
        "(trainer/lm_head.py)",
    )
    skip_zero_advantage: bool | None = Field(
        None,
        description="a training batch whose advantages are all zero (every group's completions scored alike) runs "
        "no loss forward or backward: its gradient is zero, given to every trainable weight as TRL's backward would "
        "give it, so the optimizer steps as before (exact; the demo's zero-variance batches are a third to a half "
        "of its steps). Unset: on where it can apply; it cannot where a zero advantage still has a gradient or "
        "skipping cannot be exact (beta > 0, an entropy bonus, a MoE auxiliary loss, Liger's loss, several "
        "processes): there every batch runs the loss, with a warning if set to true (trainer/zero_advantage.py)",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch's intra-op threads in the trainer (torch.set_num_threads); unset: torch's own choice (the "
        "node's cores), except in a search running hpo.concurrency local trials at once, which gives each trial its "
        "share of the cores (two trials of one thread each on 2 cores: 0.67-0.71x the wall time of one after the "
        "other at two threads, docs/training.md#hyperparameter-search)",
    )
    max_restarts: int = Field(3, ge=0, description="relaunches after an abnormal trainer exit (not preemptions)")
    launcher: LauncherName = Field("local", description=launcher_help())
    sky: SkyConfig = SkyConfig()
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, SeaweedFS); AWS when unset")
    distributed: DistributedConfig = Field(
        DistributedConfig(),
        description="several training processes (GPUs) and nodes: see docs/training.md#training-on-many-gpus",
    )
    health: HealthConfig = Field(
        HealthConfig(),
        description="collapse and reward-hacking guards: warn, stop or roll back (docs/training.md#health-rules)",
    )
    curriculum: CurriculumConfig = Field(
        CurriculumConfig(), description="prompts without reward variance sit out (docs/training.md#fewer-wasted-steps)"
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        DynamicSamplingConfig(),
        description="over-generate groups and train on those with reward variance (docs/training.md#dynamic-sampling)",
    )

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
