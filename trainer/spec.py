"""The job spec: everything one training job needs, as JSON, so a launcher can ship it to any node; and
what the job reports back (its result file, its tagged progress lines).

The trainer owns this contract and imports nothing else of the project but the config's sections it runs as they
are (the `train.*` fields it reads, the distributed layout, the health rules, the curriculum and dynamic sampling,
the rewards, the base's number formats: `configs/trainer_fields.py`, `layout.py`, `health.py`, `sampling.py`,
`rewards.py`, `dtypes.py`, each pure pydantic or typing importing nothing of the project but these), so a node runs
`python -m grpo_pipeline.trainer --spec job.json` without the orchestrator's libraries; the pipeline's stages fill
the spec in (`grpo_pipeline.tasks.job.build_job_spec`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

# the config's own sections, one definition each (tests/unit/test_layers.py: the only modules the trainer imports)
from grpo_pipeline.configs.base import StrictModel
from grpo_pipeline.configs.dtypes import DType, Quantization
from grpo_pipeline.configs.health import Action
from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.trainer_fields import TrainerFields


class ModelLoad(StrictModel):
    """How the base model is loaded: precision and bitsandbytes quantization."""

    quantization: Quantization
    double_quant: bool
    compute_dtype: DType
    trust_remote_code: bool


class ZeroSignal(BaseModel):
    """How much of the run had no learning signal: TRL's `frac_reward_zero_std` (the fraction of groups whose
    completions all got the same reward) over the logged steps; and what the curriculum did about it."""

    mean_fraction: float
    wasted_steps: int  # logged steps where every group had zero variance (no advantage, no gradient)
    logged_steps: int
    skipped_draws: int | None = None  # curriculum on: times a benched prompt was passed over
    benched_prompts: int | None = None  # curriculum on: prompts sitting out at the end
    # dynamic sampling on: mean_fraction is over every generated group; this over the groups trained on
    trained_fraction: float | None = None
    trained_wasted_steps: int | None = None  # dynamic sampling on: logged steps that trained on flat groups only


class HealthEvent(BaseModel):
    """A rule that fired: at which step, on what value against what threshold, and what was done."""

    model_config = ConfigDict(ser_json_inf_nan="strings")  # a non-finite loss is the value: "NaN", read back as nan
    rule: str
    step: int
    metric: str
    value: float
    threshold: float
    action: Action  # as configured; `taken` says what happened (a rollback past max_rollbacks is a stop)
    message: str
    taken: str | None = None  # "warned", "stopped", "rolled back to step N (learning rate x0.5)"


class TrainSettings(TrainerFields):
    """What the trainer runs: the `train.*` fields it reads (`TrainerFields`, the one declaration that the config's
    `TrainConfig` builds on too, so each has the same name, type, default and bounds on both sides), and the rewards
    resolved. Copied by `grpo_pipeline.tasks.job.train_settings`; tests/unit/test_config.py sets every one to a
    value other than its default and reads it back from the spec. A field's default is also what a spec written
    before that field existed reads."""

    rewards: RewardSet  # each reward's name, weight, arguments and role; the skill judges validation

    @model_validator(mode="before")
    @classmethod
    def _older_rewards(cls, data: Any) -> Any:
        """Specs written before version 2 held the rewards without their roles: version 0 as three loose fields
        (`rewards` the names, `reward_args`, the weights in `grpo.reward_weights`), version 1 as a RewardSet of
        parallel lists (`names`, `args`, `weights`). Read either as entries whose roles are the rewards' defaults;
        a set whose skill those cannot tell is refused whole, with the fix."""
        if not isinstance(data, dict):
            return data
        rewards = data.get("rewards")
        if isinstance(rewards, list):
            data = dict(data)
            grpo = dict(data.get("grpo") or {})
            weights = grpo.pop("reward_weights", None) or ()
            rewards = {"names": rewards, "args": data.pop("reward_args", {}), "weights": weights}
            data["rewards"], data["grpo"], version = rewards, grpo, 0
        elif isinstance(rewards, dict) and "names" in rewards:
            version = 1
        else:
            return data
        try:
            RewardSet.model_validate(rewards)
        except ValidationError as exc:
            raise ValueError(
                f"a job spec of version {version} (written before the rewards carried their roles, version "
                f"{SPEC_VERSION}) cannot be read: {exc.errors()[0]['msg'].removeprefix('Value error, ')}. Build "
                "the spec again from the run's configuration with that fix (`grpo-pipeline run` writes a new one)"
            ) from None
        return data

    @model_validator(mode="after")
    def _weights_once(self) -> TrainSettings:
        if "reward_weights" in self.grpo:  # TRL would get two lists of weights
            raise ValueError("grpo.reward_weights: the weights travel in rewards' entries, the RewardSet's own field")
        return self


# 2: the rewards as entries with their roles (RewardSet.entries); 1: as parallel lists; 0: as loose fields
SPEC_VERSION = 2


class JobSpec(StrictModel):
    version: int = SPEC_VERSION  # absent from older specs; their rewards' shape tells theirs (TrainSettings)
    model_path: str  # resolved: a local directory or a hub id
    model: ModelLoad
    train: TrainSettings
    train_file: str
    val_file: str | None = None
    work_dir: str  # local scratch: the HF output dir, the result file
    checkpoint_uri: str  # local directory or s3://bucket/prefix
    adapter_dir: str  # where the final adapter is written
    # a LoRA adapter directory to continue training (a warm start: model.init_adapter), already checked against
    # the base and train.lora by the pipeline; None: a fresh adapter from train.lora
    init_adapter: str | None = None
    # set when the adapter reaches the node through the checkpoint store (the SkyPilot launcher uploads it as the
    # store's `init-adapter` entry): every file it must have, `name -> (size, sha256)`, taken where the pipeline
    # checked it. The trainer fetches the entry and refuses any file that differs, is missing or is extra
    # (`grpo_pipeline.trainer.checkpoints.fetch_init_adapter`), so the store cannot swap the adapter.
    init_adapter_files: dict[str, tuple[int, str]] | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "grpo-pipeline"
    mlflow_run_id: str | None = None  # set by the launcher, so a relaunched job continues the same run

    @field_validator("version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v > SPEC_VERSION:
            raise ValueError(
                f"job spec version {v} is newer than this trainer reads ({SPEC_VERSION}): run the trainer of the "
                "pipeline release that wrote it"
            )
        return v

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def read(cls, path: Path) -> JobSpec:
        return cls.model_validate_json(Path(path).read_text())


class TrainingFailed(RuntimeError):
    """The job ended without a result: out of restarts, a bad spec, cancelled, or a failed managed job.
    Raised by every launcher (`grpo_pipeline.infra.launch`); defined with the job's contract so a stage can catch it
    without importing a launcher."""


RESULT_FILE = "result.json"

# How a trainer process ends, the launchers' contract with it (defined here alone; docs/reliability.md). Which
# failure ends with which code is one table, `EXITS` in trainer/train.py.
EXIT_FAILED = 1  # anything else, a reward's outage included: relaunched, resumed from the last checkpoint
EXIT_BAD_INPUT = 2  # the same job fails the same way again: never relaunched
EXIT_SUPERSEDED = 3  # a newer attempt owns the checkpoint store (trainer/fence.py): never relaunched
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM after a checkpoint; relaunch to resume
NOT_RELAUNCHED = frozenset({EXIT_BAD_INPUT, EXIT_SUPERSEDED})


class TrainResult(BaseModel):
    """What the trainer leaves in `<work_dir>/result.json` (and in the store's `final` entry)."""

    adapter_dir: str | None
    global_step: int
    max_steps: int
    resumed_from_step: int | None
    interrupted: bool  # stopped by SIGTERM after saving a checkpoint; relaunch to resume
    stopped_early: bool
    mlflow_run_id: str | None
    train_runtime_s: float
    first_step_s: float | None = None  # job start to first completed step (model load, fetch, resume)
    precision: Literal["fp32", "bf16", "fp16"] = (
        "fp32"  # the mixed precision it trained in (grpo_pipeline.trainer.precision)
    )
    metrics: dict[str, float]
    world_size: int = 1  # training processes, all nodes together
    restarts: int = 0  # filled by the launcher: relaunches after a preemption or an error
    gpu_hours: float | None = None  # filled by launchers that rent GPUs
    health: list[HealthEvent] = []  # every health rule that fired, in step order (grpo_pipeline.trainer.health)
    stopped_by: str | None = None  # the health event that ended training, in one line; None: it was not one
    rollbacks: int = 0  # restarts from an earlier, healthy checkpoint after a health rule's rollback
    best_step: int | None = None  # with a validation split: the step whose adapter was published (best val reward)
    best_val_reward: float | None = None
    zero_signal: ZeroSignal | None = None  # groups without reward variance, and prompts the curriculum benched


PROGRESS_TAG = "grpo-progress"  # a validation reward, printed by grpo_pipeline.trainer.callbacks.ReportValidation
BAD_INPUT_TAG = "grpo-bad-input"  # the trainer's exit-2 reason, for launchers that would otherwise relaunch

# What may stand before a tag: nothing, or the prefix SkyPilot puts on each line of a job's output, colored
# or not: `(task, pid=7) `, `(head, rank=0, pid=7) `, `(worker1, rank=1, pid=7, ip=10.0.0.2) `.
_ANSI = r"(?:\x1b\[[0-9;]*m)*"
_SKY_PREFIX = rf"{_ANSI}\([^()\n]*\bpid=\d+[^()\n]*\){_ANSI} "

_TAGGED = {tag: re.compile(rf"(?:{_SKY_PREFIX})?{re.escape(tag)} (.*)") for tag in (PROGRESS_TAG, BAD_INPUT_TAG)}


def _tagged_json(line: str, tag: str) -> dict | None:
    """The JSON object a trainer line carries after `tag`, or None. The tag must start the line (after
    SkyPilot's prefix alone): the trainer prints it so, while model text in the log (TRL's completion
    tables, a reward's message) can hold the tag mid-line and must not be taken for the trainer's word.
    The trainer's payload is one line of JSON (json.dumps escapes any newline in it).

    >>> _tagged_json('(task, pid=7) grpo-progress {"step": 1}', PROGRESS_TAG)
    {'step': 1}
    >>> _tagged_json('| 42 | grpo-progress {"step": 1}', PROGRESS_TAG) is None
    True
    """
    match = _TAGGED[tag].match(line)
    if not match:
        return None
    try:
        report = json.loads(match.group(1))
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def progress_line(step: int, val_reward: float) -> str:
    return f"{PROGRESS_TAG} {json.dumps({'step': step, 'val_reward': val_reward})}"


def parse_progress(line: str) -> dict | None:
    """The report in a line of trainer output (SkyPilot may prefix lines), or None.

    >>> parse_progress('(grpo-hpo-trial, pid=42) ' + progress_line(4, 0.5))
    {'step': 4, 'val_reward': 0.5}
    >>> parse_progress("{'loss': 0.1}") is None
    True
    """
    report = _tagged_json(line, PROGRESS_TAG)
    return report if report is not None and {"step", "val_reward"} <= report.keys() else None


def bad_input_line(message: str) -> str:
    return f"{BAD_INPUT_TAG} {json.dumps({'error': message})}"


def parse_bad_input(line: str) -> str | None:
    """The bad-input reason in a line of trainer output (SkyPilot may prefix lines), or None.

    >>> parse_bad_input("(task, pid=7) " + bad_input_line("reward 'x' returned nan for row 1"))
    "reward 'x' returned nan for row 1"
    >>> parse_bad_input("bad input: something") is None
    True
    """
    report = _tagged_json(line, BAD_INPUT_TAG)
    error = report.get("error") if report is not None else None
    return error if isinstance(error, str) else None
