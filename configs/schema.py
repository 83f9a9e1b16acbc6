"""Typed pipeline configuration: one pydantic model per stage, composed into `PipelineConfig`.

Each section is a module of its own (`configs/data.py`, `model.py`, `plan.py`, `train.py`, `check.py`, `hpo.py`,
`evaluate.py`, `merge.py`, `promote.py`, `tracking.py`, `deploy.py`, `ab.py`, on `configs/base.py`); this module composes
them, reads YAML and `--set` overrides, and names what is wrong, and every section's names are importable from here
as before. A YAML file holds only what differs from the defaults; `--set stage.key=value` overrides it. TRL's
`GRPOConfig` and PEFT's `LoraConfig` fields pass through `train.grpo` and `train.lora` and are checked
against those classes' own fields and types, so nothing here re-declares them.

    >>> cfg = load_config(None, ["train.grpo.max_steps=3"])
    >>> cfg.train.grpo["max_steps"]
    3
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from grpo_pipeline.configs import library_fields, library_ranges
from grpo_pipeline.configs.ab import ABConfig
from grpo_pipeline.configs.base import StrictModel, close_match
from grpo_pipeline.configs.check import CheckConfig
from grpo_pipeline.configs.data import DataConfig, DemoTaskConfig
from grpo_pipeline.configs.deploy import DeployConfig
from grpo_pipeline.configs.evaluate import EvalConfig
from grpo_pipeline.configs.hpo import SEARCHABLE, HPOConfig, SearchDim, SearchSpace
from grpo_pipeline.configs.merge import MergeConfig
from grpo_pipeline.configs.model import (
    CHAMPION_OR_BASE,
    DEMO_MODEL,
    ModelConfig,
    QuantizationBound,
    init_adapter_uri_problem,
)
from grpo_pipeline.configs.plan import PlanConfig
from grpo_pipeline.configs.policy import ENV_NAME, ENV_NAME_SUFFIXES, credential_key, secret_shape
from grpo_pipeline.configs.promote import PromotionPolicy
from grpo_pipeline.configs.rewards import AUTO, RewardEntry
from grpo_pipeline.configs.tracking import TrackingConfig
from grpo_pipeline.configs.train import GRPO_OWNED, SkyConfig, TrainConfig, dynamic_sampling_problem

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

# Every section's names, importable from here as before the sections had modules of their own.
__all__ = [
    "CHAMPION_OR_BASE",
    "DEMO_MODEL",
    "GRPO_OWNED",
    "PASSTHROUGH",
    "SEARCHABLE",
    "ABConfig",
    "CheckConfig",
    "ConfigError",
    "DataConfig",
    "DemoTaskConfig",
    "DeployConfig",
    "EvalConfig",
    "HPOConfig",
    "MergeConfig",
    "ModelConfig",
    "PipelineConfig",
    "PlanConfig",
    "PromotionPolicy",
    "QuantizationBound",
    "SearchDim",
    "SearchSpace",
    "SkyConfig",
    "StrictModel",
    "TrackingConfig",
    "TrainConfig",
    "apply_override",
    "credential_refusal",
    "credentials_in",
    "dynamic_sampling_problem",
    "init_adapter_uri_problem",
    "load_config",
    "set_path",
    "unknown_field",
]


class ConfigError(ValueError):
    """A configuration problem, with a message that names the field and the fix."""


def credentials_in(
    node: Any, path: str = "", key: str = "", env_names: bool = False
) -> typing.Iterator[tuple[str, str]]:
    """(dotted path, what) for each string in a config tree that is or holds a credential: under a key that names
    one (token, secret, password, Authorization, api_key, ...), shaped like one (a bearer string, a known token
    format, user:password@host), or a URL with a password or a token-like query parameter. Keys ending in
    `_from_env` / `_env` hold environment variable names, which are the fix, not a secret.

    >>> list(credentials_in({"train": {"grpo": {"hub_token": "x"}}}))
    [('train.grpo.hub_token', "its key 'hub_token' names a credential")]
    >>> list(credentials_in({"headers_from_env": {"Authorization": "VERIFIER_TOKEN"}, "min_prompt_tokens": 1}))
    []
    """
    if isinstance(node, dict):
        for k, value in node.items():
            name = str(k)
            yield from credentials_in(
                value, f"{path}.{name}" if path else name, name, env_names or name.lower().endswith(ENV_NAME_SUFFIXES)
            )
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from credentials_in(value, f"{path}[{i}]", key, env_names)
    elif isinstance(node, str) and node:
        if env_names and not ENV_NAME.fullmatch(node):  # else a secret could hide where a name belongs
            yield path, "a value where the name of an environment variable belongs"
        elif not env_names and credential_key(key):
            yield path, f"its key '{key}' names a credential"
        elif found := secret_shape(node):
            yield path, found


def credential_refusal(path: str, found: str) -> str:
    """The refusal of a credential in the configuration: the field and the fix, never the value."""
    return (
        f"{path} holds a credential ({found}), and the pipeline logs its configuration (MLflow, model-version "
        "tags, Prefect parameters, the job spec a node receives); put the secret in an environment variable on "
        "the worker and name the variable instead: for the verifier's header "
        "{name: remote_verifier, args: {headers_from_env: {Authorization: VERIFIER_TOKEN}}} in train.rewards; HF_TOKEN for the "
        "hub, MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD for MLflow, AWS_* for S3"
    )


class PipelineConfig(StrictModel):
    data_dir: Path = Field(Path(".grpo"), description="runs, the MLflow database and the model cache")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    plan: PlanConfig = PlanConfig()
    train: TrainConfig = TrainConfig()
    check: CheckConfig = CheckConfig()
    hpo: HPOConfig = HPOConfig()
    evaluate: EvalConfig = EvalConfig()
    merge: MergeConfig = MergeConfig()
    promote: PromotionPolicy = PromotionPolicy()
    tracking: TrackingConfig = TrackingConfig()
    deploy: DeployConfig = DeployConfig()
    ab: ABConfig = ABConfig()

    @model_validator(mode="after")
    def _no_credentials(self) -> PipelineConfig:
        # The configuration is logged (MLflow config.json and params, model-version tags, Prefect parameters, the
        # job spec a node receives): a secret must never be in it. The message names the field, never the value.
        tree: dict[str, Any] = self.model_dump(mode="json")
        if not self.tracking.mlflow_tracking_uri:  # then the environment's URI is used, and logged
            tree["MLFLOW_TRACKING_URI"] = os.environ.get("MLFLOW_TRACKING_URI", "")
        for path, found in credentials_in(tree):
            raise ValueError(credential_refusal(path, found))
        return self

    @model_validator(mode="after")
    def _trigger_fields_exist(self) -> PipelineConfig:
        for field in self.deploy.trigger.allow:
            if problem := unknown_field(field):
                raise ValueError(f"deploy.trigger.allow: '{field}': {problem}; `grpo-pipeline config` prints every key")
        return self

    @field_validator("hpo")
    @classmethod
    def _hpo_fits_train(cls, v: HPOConfig, info: ValidationInfo) -> HPOConfig:
        if "train" in info.data:  # absent when train itself failed validation (reported on its own)
            v.check_against(info.data["train"])
        return v

    @model_validator(mode="after")
    def _demo_skill(self) -> PipelineConfig:
        """`auto` on the demo task (no source): its answers are integers, judged by correct_answer. A source's
        answers choose it at the run's start (`grpo_pipeline.tasks.data.shape.task_rewards`), not here: the
        configuration reads no data."""
        if self.data.source is None and any(e.name == AUTO for e in self.train.rewards):
            chosen = RewardEntry(name="correct_answer", role="skill", chosen_by="the demo task's answers are integers")
            self.train.rewards = [
                chosen.model_copy(update={"weight": e.weight, "args": e.args}) if e.name == AUTO else e
                for e in self.train.rewards
            ]
        return self

    @model_validator(mode="after")
    def _warm_start_fits(self) -> PipelineConfig:
        # Training from the base on only the new rows would forget the rest: incremental continues an adapter.
        if self.data.incremental and self.model.init_adapter == "none":
            raise ValueError(
                "data.incremental trains on the rows the parent adapter has not seen, so it needs one: set "
                "model.init_adapter=champion_or_base (or champion, or a models:/ version), or data.incremental=false"
            )
        # A warm start trains its adapter's own shape (rank and scale, in the trials too): a searched one would not
        # be what trains.
        if self.model.init_adapter != "none" and self.hpo.enabled:
            for dim in ("lora_r", "lora_alpha_ratio"):
                if getattr(self.hpo.space, dim) is not None:
                    raise ValueError(
                        f"hpo.space.{dim}: a warm start (model.init_adapter) keeps its adapter's LoRA rank and "
                        f"alpha; set hpo.space.{dim}=null, or model.init_adapter=none"
                    )
        return self

    @property
    def mlflow_uri(self) -> str:
        return (
            self.tracking.mlflow_tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(self.data_dir / 'mlflow.db').resolve()}"
        )


# train.grpo / train.lora hold the fields of these library classes, by name
PASSTHROUGH: dict[tuple[str, ...], str] = {("train", "grpo"): "GRPOConfig", ("train", "lora"): "LoraConfig"}


def unknown_field(path: str) -> str | None:
    """What is wrong with a dotted field name, or None when the configuration has it (a section counts).

    >>> unknown_field("train.lora.r"), unknown_field("train.grpo.max_step")
    (None, "'max_step' is not a GRPOConfig field; did you mean 'max_steps'?")
    """
    model: type[BaseModel] = PipelineConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            return f"no field '{part}' in {'.'.join(parts[:i]) or 'the configuration'}{close_match(part, fields)}"
        if (cls_name := PASSTHROUGH.get(tuple(parts[: i + 1]))) and i + 1 < len(parts):
            names = library_fields.fields(cls_name)
            if len(parts) > i + 2 or parts[i + 1] not in names:
                return f"'{'.'.join(parts[i + 1 :])}' is not a {cls_name} field{close_match(parts[i + 1], names)}"
            return None
        annotation = fields[part].annotation
        section = next(
            (a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)),
            None,
        )
        if section is None:
            return None if i == len(parts) - 1 else f"'{'.'.join(parts[: i + 1])}' is a value, not a section"
        model = section
    return None


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, booleans).

    >>> t = {}; apply_override(t, "train.grpo.learning_rate=3e-4"); t
    {'train': {'grpo': {'learning_rate': 0.0003}}}
    """
    path, sep, raw = assignment.partition("=")
    if not sep or not path.strip():
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set train.grpo.max_steps=10")
    *parents, leaf = path.strip().split(".")
    if not all(p.strip() for p in [*parents, leaf]):
        raise ConfigError(
            f"--set {assignment!r}: '{path.strip()}' has an empty part; write dotted keys such as train.grpo.max_steps"
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at character {mark.column + 1} of the value" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"--set {assignment!r}: the value is not valid YAML ({problem}{where}); quote it as a "
            f"string, e.g. --set '{path.strip()}=\"{raw}\"'"
        ) from None
    # YAML reads '3e-4' as a string (its floats need a dot); users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in ".e") else int(value)
        except ValueError:
            pass
    set_path(tree, [*parents, leaf], value, f"--set {assignment!r}: ")


def set_path(tree: dict[str, Any], path: list[str], value: Any, blame: str = "") -> None:
    """Set the value at a dotted path's parts in a nested dict, making the sections on the way (what
    `apply_override` does after parsing the value; `grpo_pipeline.tasks.hpo.apply_best` with typed values).

    >>> t = {"train": {"grpo": {"beta": 0.0}}}; set_path(t, ["train", "grpo", "learning_rate"], 3e-4); t
    {'train': {'grpo': {'beta': 0.0, 'learning_rate': 0.0003}}}
    """
    *parents, leaf = path
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{blame}'{part}' holds a value, not a section")
        node = child
    node[leaf] = value


def _describe(error: ErrorDetails, model: type[BaseModel]) -> str:
    loc = ".".join(str(p) for p in error["loc"])
    if error["type"] == library_ranges.ERROR_TYPE:  # a passthrough field's range: named by its dotted key
        loc = f"{loc}.{error['ctx']['field']}"
    if error["type"] == "extra_forbidden":
        section: Any = model
        for part in error["loc"][:-1]:
            section = section.model_fields[part].annotation
        allowed = list(section.model_fields)
        return f"{loc}: unknown key{close_match(str(error['loc'][-1]), allowed)} (allowed here: {', '.join(allowed)})"
    msg = error["msg"].removeprefix("Value error, ")
    got = error.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{loc}: {msg}{shown}" if loc else msg  # a check across fields names them itself


def _tab_hint(text: str) -> str:
    r"""The fix for YAML's refusal of a tab in indentation (its message says only that a tab "cannot start any
    token"), naming the first such line; empty when no line is indented with one.

    >>> _tab_hint("train:\n\tgrpo: {}\n")
    '\nline 2 is indented with a tab: indent with spaces (YAML allows no tabs there)'
    """
    for number, line in enumerate(text.splitlines(), 1):
        if "\t" in line[: len(line) - len(line.lstrip())]:
            return f"\nline {number} is indented with a tab: indent with spaces (YAML allows no tabs there)"
    return ""


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> PipelineConfig:
    """Read YAML (or nothing: the demo defaults), apply `--set` overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            example = min(path.glob("*.yaml"), default="configs/demo-cpu.yaml")
            raise ConfigError(f"config {path} is a directory, not a YAML file; pass a file, e.g. {example}")
        if not path.is_file():
            raise ConfigError(f"config file {path} not found; pass an existing YAML, e.g. configs/demo-cpu.yaml")
        text = path.read_text()
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}{_tab_hint(text)}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of stage sections")
    for assignment in overrides:
        apply_override(tree, assignment)
    where = f" in {path}" if path else ""
    # Before the fields are validated: a field's own error would show its value (a token typed into a number).
    if found := next(credentials_in(tree), None):
        raise ConfigError(f"invalid configuration{where}:\n  {credential_refusal(*found)}")
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        lines = [_describe(e, PipelineConfig) for e in exc.errors()]
        raise ConfigError(f"invalid configuration{where}:\n  " + "\n  ".join(lines)) from None
