"""How every command loads its configuration: the file (a shipped recipe by name, or the CPU demo) or the
defaults alone, then the --set overrides; and on a refusal, the failure that names what to blame, the file or the
--set (exit 2, and with --json the failure object). A module of its own so that the sub-apps (`ab`) that `cli`
imports blame the same way without an import cycle."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from grpo_pipeline.configs.files import packaged, recipe
from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.failure import EXIT_CONFIG, fail

if TYPE_CHECKING:
    from grpo_pipeline.configs.schema import PipelineConfig

DEFAULT_CONFIG = packaged("demo-cpu.yaml")  # the CPU demo, from the installed package
# The options every command that loads a configuration takes
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="pipeline YAML; default: configs/demo-cpu.yaml")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="override, e.g. --set train.grpo.max_steps=20 (repeatable)")
]


def config_path(config: Path | None) -> Path:
    # a shipped recipe's path (configs/demo-cpu.yaml) is found in the installed package when it is not here
    return DEFAULT_CONFIG if config is None else recipe(config)


def load(config: Path | None, overrides: list[str] | None, as_json: bool = False) -> tuple[Path, PipelineConfig]:
    path = config_path(config)
    return path, load_path(path, overrides, as_json)


def load_path(path: Path | None, overrides: list[str] | None, as_json: bool) -> PipelineConfig:
    """The configuration at `path` (None: the defaults alone) with the --set overrides, or the failure naming
    the file or the --set to blame."""
    overrides = list(overrides or [])
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        fail(as_json, blame(path, overrides, exc), EXIT_CONFIG)


def blame(path: Path | None, overrides: list[str], exc: Exception) -> str:
    """A configuration error told against its cause: the file, or the --set that made it (the loader reports
    every field as being "in" the file). A --set is to blame when the file alone loads and the file with that
    --set does not; when only several together fail (two shares adding up past 1), all are named."""
    if not overrides:
        return str(exc)
    try:
        load_config(path, [])
    except ConfigError:
        return str(exc)  # the file is wrong on its own: the message names it
    culprits = []
    for assignment in overrides:
        try:
            load_config(path, [assignment])
        except ConfigError as alone:
            culprits.append((assignment, alone))
    if not culprits:
        return f"--set {' --set '.join(shown(o, exc) for o in overrides)} (together): {what(exc)}"
    return "\n".join(f"--set {shown(assignment, alone)}: {what(alone, assignment)}" for assignment, alone in culprits)


def shown(assignment: str, error: Exception) -> str:
    """A --set as a failure names it: without its value when the loader found a credential there, so the refusal
    does not print the secret into a terminal or a CI log.

    >>> shown("train.grpo.hub_token=hf_x", ConfigError("train.grpo.hub_token holds a credential (...)"))
    'train.grpo.hub_token=...'
    """
    return f"{assignment.partition('=')[0]}=..." if "holds a credential" in str(error) else assignment


def what(exc: Exception, assignment: str | None = None) -> str:
    """The field lines of a configuration error, without the loader's "invalid configuration in <file>:" or
    its own "--set '<assignment>':" (the caller names the --set)."""
    text = str(exc)
    head, sep, fields = text.partition(":\n")
    if sep and head.startswith("invalid configuration"):
        lines = [line.strip() for line in fields.splitlines() if line.strip()]
        return lines[0] if len(lines) == 1 else "\n  " + "\n  ".join(lines)
    return text.removeprefix(f"--set {assignment!r}: ") if assignment else text
