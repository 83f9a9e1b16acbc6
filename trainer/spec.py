"""The job spec: everything one training job needs, as JSON, so a launcher can ship it to any node; and
what the job reports back (its result file, its tagged progress lines).

The trainer owns this contract and imports nothing else of the project but the distributed layout's one type
(`grpo_pipeline.configs.layout`, pure pydantic), so a node runs `python -m grpo_pipeline.trainer --spec
job.json` without the orchestrator's libraries; the pipeline's stages fill the spec in
(`grpo_pipeline.tasks.job.build_job_spec`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# the one module of the project the trainer imports: the layout is the config's own type (configs/layout.py)
from grpo_pipeline.configs.layout import DistributedConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelLoad(_Strict):
    """How the base model is loaded: precision and bitsandbytes quantization."""

    quantization: Literal["none", "nf4", "fp4", "int8"]
    double_quant: bool
    compute_dtype: Literal["float32", "bfloat16", "float16"]
    trust_remote_code: bool


Action = Literal["off", "warn", "stop", "rollback"]


class RuleSettings(_Strict):
    """One health rule (`grpo_pipeline.trainer.health`): what to do when it fires, over how many logged steps, at what value."""

    action: Action
    window: int = Field(ge=1)
    threshold: float = Field(allow_inf_nan=False)


# The defaults, and what `grpo_pipeline.configs.schema.HealthConfig` repeats field by field (a unit test holds them equal);
# why each value: docs/training.md#health-rules.
HEALTH_DEFAULTS: dict[str, dict[str, Any]] = {
    "zero_variance": {"action": "warn", "window": 5, "threshold": 0.9},
    "entropy_collapse": {"action": "warn", "window": 5, "threshold": 0.1},
    "length_drift": {"action": "warn", "window": 5, "threshold": 3.0},
    "clipped_completions": {"action": "warn", "window": 5, "threshold": 0.5},
    "kl_blowup": {"action": "warn", "window": 3, "threshold": 1.0},
    "reward_collapse": {"action": "warn", "window": 5, "threshold": 0.01},
    "non_finite": {"action": "rollback", "window": 1, "threshold": 0.0},
}


def _rule(name: str) -> Any:  # a pydantic Field, typed as Any so it can default any field
    return Field(default_factory=lambda: RuleSettings(**HEALTH_DEFAULTS[name]))


class HealthSettings(_Strict):
    """The health rules the trainer runs (`grpo_pipeline.trainer.health`), and how a rollback changes the run."""

    zero_variance: RuleSettings = _rule("zero_variance")
    entropy_collapse: RuleSettings = _rule("entropy_collapse")
    length_drift: RuleSettings = _rule("length_drift")
    clipped_completions: RuleSettings = _rule("clipped_completions")
    kl_blowup: RuleSettings = _rule("kl_blowup")
    reward_collapse: RuleSettings = _rule("reward_collapse")
    non_finite: RuleSettings = _rule("non_finite")
    max_rollbacks: int = Field(2, ge=0)
    rollback_lr_factor: float = Field(0.5, gt=0, lt=1)

    def rule(self, name: str) -> RuleSettings:
        return getattr(self, name)

    def rolls_back(self) -> list[str]:
        return [name for name in HEALTH_DEFAULTS if self.rule(name).action == "rollback"]


# What `grpo_pipeline.configs.schema.CurriculumConfig` repeats (a unit test holds them equal); why: docs/training.md#fewer-wasted-steps.
CURRICULUM_DEFAULTS: dict[str, Any] = {"enabled": True, "patience": 1, "max_skips": 2}


class CurriculumSettings(_Strict):
    """Prompts whose groups had no reward variance sit out (`grpo_pipeline.trainer.sampling`)."""

    enabled: bool = CURRICULUM_DEFAULTS["enabled"]
    patience: int = Field(CURRICULUM_DEFAULTS["patience"], ge=1)  # zero-variance groups in a row before benching
    max_skips: int = Field(CURRICULUM_DEFAULTS["max_skips"], ge=1)  # passes a benched prompt sits out, then it is drawn


# What `grpo_pipeline.configs.schema.DynamicSamplingConfig` repeats (a unit test holds them equal); why:
# docs/training.md#dynamic-sampling.
DYNAMIC_SAMPLING_DEFAULTS: dict[str, Any] = {"enabled": False, "oversample": 2.0}


class DynamicSamplingSettings(_Strict):
    """DAPO-style dynamic sampling (`grpo_pipeline.trainer.dynamic_sampling`): generate `oversample` groups per
    group trained and train on the ones whose rewards differ."""

    enabled: bool = DYNAMIC_SAMPLING_DEFAULTS["enabled"]
    oversample: float = Field(DYNAMIC_SAMPLING_DEFAULTS["oversample"], gt=1, allow_inf_nan=False)


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


class TrainSettings(_Strict):
    """What the trainer runs: TRL's GRPOConfig and PEFT's LoraConfig fields, rewards, checkpointing, and how
    many processes run it."""

    grpo: dict[str, Any]
    lora: dict[str, Any]
    rewards: list[str]  # names in grpo_pipeline.trainer.rewards.REWARDS, or 'package.module:function'
    reward_args: dict[str, dict[str, Any]] = {}  # reward name -> keyword arguments (`resolve_rewards`)
    checkpoint_every: int
    keep_checkpoints: int
    early_stopping_patience: int | None
    s3_endpoint_url: str | None
    distributed: DistributedConfig = DistributedConfig()  # train.distributed as configured
    health: HealthSettings = HealthSettings()
    curriculum: CurriculumSettings = CurriculumSettings()
    dynamic_sampling: DynamicSamplingSettings = DynamicSamplingSettings()


class JobSpec(_Strict):
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
