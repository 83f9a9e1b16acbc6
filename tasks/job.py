"""The training job: its spec, built from the pipeline's `train` and `model` sections (pure), and the checks
the job's own settings must pass before any work is done; the adapter a warm start trains from
(`model.init_adapter`: what it names, and whether it fits). Launching it is infra's (`grpo_pipeline.infra.launch`)."""

from __future__ import annotations

import ast
import difflib
import re
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from grpo_pipeline.configs.rewards import AUTO, RewardSet
from grpo_pipeline.configs.schema import CHAMPION_OR_BASE, DEMO_MODEL, ConfigError, EvalConfig, ModelConfig, TrainConfig
from grpo_pipeline.configs.trainer_fields import TrainerFields
from grpo_pipeline.trainer.checkpoints import open_store
from grpo_pipeline.trainer.loading import adapter_mismatch
from grpo_pipeline.trainer.rewards import REWARDS, describe, resolve_reward
from grpo_pipeline.trainer.spec import JobSpec, ModelLoad, TrainSettings

SHOWN_METRICS = ("reward", "reward_std", "loss", "completions/mean_length", "step_time")


def model_load(model: ModelConfig) -> ModelLoad:
    """How the trainer (and every stage that loads the base) loads it."""
    return ModelLoad.model_validate(model.model_dump(include=set(ModelLoad.model_fields)))


def train_settings(train: TrainConfig) -> TrainSettings:
    """What of the `train` section the trainer itself runs (not where or how often it is launched): the fields
    the config and the job spec both build on (`TrainerFields`), and the rewards whole (`TrainConfig.reward_set`:
    each reward's name, weight, arguments and role as one value).

    >>> s = train_settings(TrainConfig(rewards=["correct_answer", {"name": "number_only", "weight": 0.5}]))
    >>> s.rewards.weights, s.rewards.skill
    ((1.0, 0.5), 'correct_answer')
    """
    settings = train.model_dump(include=set(TrainerFields.model_fields))
    return TrainSettings.model_validate({**settings, "rewards": train.reward_set()})


def build_job_spec(
    train: TrainConfig,
    model: ModelConfig,
    model_path: str,
    splits: dict[str, Path],
    run_dir: Path,
    *,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str | None = None,
    mlflow_run_id: str | None = None,
    init_adapter: str | None = None,
) -> JobSpec:
    """Everything the trainer needs, with paths made absolute so the job can run from anywhere.

    Checkpoints go under the run's own name: a configured `train.checkpoint_uri` is a root shared by
    runs, and a new run must never resume from (or report) another run's checkpoints. `init_adapter`: the local
    directory of the adapter a warm start continues (`WarmStart.adapter_dir`).
    """
    run_dir = run_dir.resolve()
    root = train.checkpoint_uri
    checkpoints = f"{root.rstrip('/')}/{run_dir.name}" if root else str(run_dir / "checkpoints")
    return JobSpec(
        model_path=model_path,
        model=model_load(model),
        train=train_settings(train),
        train_file=str(Path(splits["train"]).resolve()),
        val_file=str(Path(splits["val"]).resolve()) if train.early_stopping_patience else None,
        work_dir=str(run_dir / "train"),
        checkpoint_uri=checkpoints,
        adapter_dir=str(run_dir / "adapter"),
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_run_id=mlflow_run_id,
        init_adapter=str(Path(init_adapter).resolve()) if init_adapter else None,
        **({"mlflow_experiment": mlflow_experiment} if mlflow_experiment else {}),
    )


# ------------------------------------------------------------------------------------------------ warm start


class RegisteredAdapter(BaseModel):
    """A registered model's version or alias, as `model.init_adapter` names it."""

    kind: Literal["version", "alias"]
    model: str  # the registered model
    ref: str  # the version number or the alias


class RunAdapter(BaseModel):
    """A run's artifact, as `model.init_adapter` names it (runs:/<run id>/<path>)."""

    kind: Literal["run"] = "run"
    ref: str  # the runs:/ URI


AdapterRef = RegisteredAdapter | RunAdapter  # what `model.init_adapter` names


def parse_init_adapter(value: str, registered_model: str) -> AdapterRef | None:
    """`model.init_adapter` (validated by the schema) as a reference; None for 'none'.

    >>> parse_init_adapter("champion", "grpo-adapter")
    RegisteredAdapter(kind='alias', model='grpo-adapter', ref='champion')
    >>> parse_init_adapter("champion_or_base", "grpo-adapter")  # the same alias; the caller decides what none means
    RegisteredAdapter(kind='alias', model='grpo-adapter', ref='champion')
    >>> parse_init_adapter("models:/other/7", "grpo-adapter")
    RegisteredAdapter(kind='version', model='other', ref='7')
    >>> parse_init_adapter("runs:/0a1b/adapter", "grpo-adapter").kind
    'run'
    """
    if value == "none":
        return None
    if value in ("champion", CHAMPION_OR_BASE):
        return RegisteredAdapter(kind="alias", model=registered_model, ref="champion")
    if match := re.fullmatch(r"models:/([^/@]+)/(\d+)", value):
        return RegisteredAdapter(kind="version", model=match[1], ref=match[2])
    if match := re.fullmatch(r"models:/([^/@]+)@([\w-]+)", value):
        return RegisteredAdapter(kind="alias", model=match[1], ref=match[2])
    return RunAdapter(ref=value)


class WarmStart(BaseModel):
    """The adapter this run continues: where it came from (the parent version, when it is a registered one) and
    where it lies here. What the registered version records as its parent and the summary names."""

    requested: str  # model.init_adapter as configured (champion, models:/..., runs:/...)
    uri: str  # what was loaded: models:/<name>/<version>, or the runs:/ URI
    model: str | None = None  # the parent's registered model, None for a run's artifact
    version: str | None = None  # the parent version
    adapter_dir: str  # the downloaded adapter (adapter_config.json, weights)

    @property
    def parent(self) -> str:
        """How the report names it: 'v3', or the run URI."""
        return f"v{self.version}" if self.version else self.uri


def base_names(model: ModelConfig, data_dir: Path) -> set[str]:
    """The names `model.base` goes by in an adapter_config.json the trainer wrote: as configured, and as the
    path it resolves to (the demo model is converted into `<data_dir>/models/`)."""
    names = {model.base}
    local = Path(data_dir) / "models" / DEMO_MODEL if model.base == DEMO_MODEL else Path(model.base).expanduser()
    names |= {str(local), str(local.resolve())}
    return names


def check_init_adapter(adapter_config: dict, bases: set[str], lora: dict, where: str) -> None:
    """Refuse, before any work, an adapter of another base or LoRA shape (`grpo_pipeline.trainer.loading.adapter_mismatch`),
    naming `model.init_adapter` and what it resolved to (`where`)."""
    if problem := adapter_mismatch(adapter_config, bases, lora):
        raise ConfigError(f"model.init_adapter ({where}): {problem}")


def reward_fields(rewards: RewardSet, evaluate: EvalConfig) -> list[tuple[str, str]]:
    """Every reward name the config holds, each with the field that holds it: the training's, then the
    evaluation's accuracy and format rewards (scored even when training does not use them).

    >>> reward_fields(RewardSet(names=("math_answer",)), EvalConfig(accuracy_reward="math_answer", format_reward=None))
    [('train.rewards', 'math_answer'), ('evaluate.accuracy_reward', 'math_answer')]
    """
    named = [("train.rewards", name) for name in rewards.names]
    return named + [
        (f"evaluate.{key}", name) for key in ("accuracy_reward", "format_reward") if (name := getattr(evaluate, key))
    ]


def check_rewards(rewards: RewardSet, evaluate: EvalConfig) -> None:
    """Every reward name the config holds (`reward_fields`) resolves (a registered name, with the closest one
    suggested, or an importable 'package.module:function'), takes the arguments its `train.rewards` entry gives it
    and has those it requires. Each failure
    names the field to fix and, for arguments, the valid ones: a typo fails here, before any stage runs,
    not in each search trial after it trained. The columns a reward needs come from the source with each row
    (the data stage carries them, and quarantines a row that lacks one, naming the column).

    >>> check_rewards(RewardSet(names=("correct_answer",)), EvalConfig(accuracy_reward="corect_answer"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    grpo_pipeline.configs.schema.ConfigError: evaluate.accuracy_reward: unknown reward 'corect_answer'; did you mean 'correct_answer'? (registered: math_answer, ..., or use 'package.module:function')
    """
    for field, name in reward_fields(rewards, evaluate):
        if name == AUTO:  # every entry point resolves it first (grpo_pipeline.tasks.data.shape.task_rewards)
            raise ConfigError(
                f"{field}: '{AUTO}' is chosen from the source's answers before the run's checks, and was not: name "
                "the skill reward (grpo-pipeline rewards lists them)"
            )
        try:
            describe(name)  # the name alone
        except ValueError as exc:
            close = difflib.get_close_matches(name, list(REWARDS), n=1) if ":" not in name else []
            reason = str(exc)
            if close and (known := reason.partition("; registered: "))[1]:
                reason = f"{known[0]}; did you mean '{close[0]}'? (registered: {known[2]})"
            raise ConfigError(f"{field}: {reason}") from None
        try:
            resolve_reward(name, rewards.args_for(name))
        except ValueError as exc:
            # only the training's rewards take arguments (their entries'); an evaluation-only one is bound with none
            where = (
                f"train.rewards[{rewards.names.index(name)}].args ({name})"
                if name in rewards.names
                else f"{field} (not in train.rewards, so bound with no arguments)"
            )
            raise ConfigError(f"{where}: {exc}") from None


def check_store(train: TrainConfig) -> None:
    """A configured checkpoint store is reachable and writable (the local default always is)."""
    if train.checkpoint_uri:
        open_store(train.checkpoint_uri, train.s3_endpoint_url).check()


def _log_dict(line: str) -> dict | None:
    """The HF log dict in a line of trainer output (SkyPilot may prefix lines), or None."""
    start = line.find("{'")
    if start < 0:
        return None
    try:
        logs = ast.literal_eval(line[start:].strip())
    except (ValueError, SyntaxError):
        return None
    return logs if isinstance(logs, dict) else None


def _is_step_log(logs: dict) -> bool:
    """A training step's log (not an evaluation's, nor the end-of-training summary)."""
    return (
        ("loss" in logs or "reward" in logs)
        and "train_runtime" not in logs
        and not any(k.startswith("eval_") for k in logs)
    )


def summarize_log_line(line: str) -> str | None:
    """A short summary of one of HF's per-step log dicts; None for any other trainer output.

    >>> summarize_log_line("{'loss': 0.5, 'reward': 0.25, 'step_time': 9.87, 'epoch': 0.01}")
    'reward=0.25 loss=0.5 step_time=9.87'
    >>> summarize_log_line("{'train_runtime': 12.0, 'train_loss': 0.1}") is None
    True
    """
    logs = _log_dict(line)
    if logs is None or not _is_step_log(logs):
        return None
    return " ".join(f"{k}={logs[k]:.4g}" for k in SHOWN_METRICS if isinstance(logs.get(k), int | float))


def format_duration(seconds: float) -> str:
    """A time span as progress lines show it (elapsed, ETA): seconds, minutes, or hours, two units at most.

    >>> format_duration(59.4), format_duration(252), format_duration(7384)
    ('59s', '4m 12s', '2h 3m')
    """
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60}m"


class TrainProgress:
    """Step x/N, steps per second and time left, from the trainer's per-step log lines.

    Each line names its global step and max_steps (`grpo_pipeline.trainer.callbacks.StepLog`), so progress is right after
    a resume and with any `logging_steps`. The rate is measured from the first step seen since the trainer
    last (re)started, so model loading and the steps a relaunch recomputes do not count against it.

    >>> clock = iter([100.0, 110.0, 300.0, 310.0]).__next__
    >>> p = TrainProgress(clock=clock)
    >>> p.update("{'loss': 0.1, 'reward': 0.5, 'step': 1, 'max_steps': 4}")
    'step 1/4 (25%), ETA --  reward=0.5 loss=0.1'
    >>> p.update("{'loss': 0.1, 'reward': 0.75, 'step': 2, 'max_steps': 4}")
    'step 2/4 (50%), 0.10 steps/s, ETA 20s  reward=0.75 loss=0.1'
    >>> p.update("loading weights") is None
    True

    Killed after step 2, relaunched from checkpoint 1: step 2 again, with a fresh rate.

    >>> p.update("{'loss': 0.1, 'reward': 0.5, 'step': 2, 'max_steps': 4}")
    'step 2/4 (50%), ETA --  reward=0.5 loss=0.1'
    >>> p.update("{'loss': 0.1, 'reward': 0.5, 'step': 3, 'max_steps': 4}")
    'step 3/4 (75%), 0.10 steps/s, ETA 10s  reward=0.5 loss=0.1'
    """

    def __init__(self, clock=None):
        self.clock = clock or time.monotonic
        self.step = 0
        self.first: tuple[int, float] | None = None

    def update(self, line: str) -> str | None:
        """The progress line for a step's log line; None for any other output."""
        logs = _log_dict(line)
        if logs is None or not _is_step_log(logs) or not isinstance(logs.get("step"), int):
            return None
        now = self.clock()
        if self.first is None or logs["step"] <= self.step:  # the first step seen, or a relaunch resumed earlier
            self.first = (logs["step"], now)
        self.step = logs["step"]
        return f"{self._position(logs.get('max_steps'), now)}  {summarize_log_line(line)}"

    def _position(self, max_steps: Any, now: float) -> str:  # the log line's value: an int once it is known
        known = isinstance(max_steps, int) and max_steps > 0
        total = f"/{max_steps} ({self.step / max_steps:.0%})" if known else ""
        assert self.first is not None  # `update` records the first step before it asks
        first_step, first_time = self.first
        if self.step <= first_step or now <= first_time:
            return f"step {self.step}{total}, ETA --"
        rate = (self.step - first_step) / (now - first_time)
        eta = f", ETA {format_duration((max_steps - self.step) / rate)}" if known else ""
        return f"step {self.step}{total}, {rate:.2f} steps/s{eta}"
