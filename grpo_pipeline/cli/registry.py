"""`grpo-pipeline registry | rollback | promote`: the registry's aliases read, and moved by an operator (under the
registry lock, each move printed with what the alias pointed at before). A read never creates the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from grpo_pipeline.failure import EXIT_CONFIG, err
from grpo_pipeline.failure import fail as _fail
from grpo_pipeline.loading import ConfigOpt, SetOpt, load
from grpo_pipeline.registry_store import missing, mlflow_warnings_only

if TYPE_CHECKING:
    from collections.abc import Callable

    from grpo_pipeline.configs.schema import PipelineConfig
    from grpo_pipeline.tasks.promote.registry import AliasMove, Registry


def _registry(cfg: PipelineConfig) -> Registry:
    """The registry the configuration names; against an MLflow server, through plain REST calls (a lookup
    answers without importing MLflow or the training stack)."""
    from grpo_pipeline.tasks.promote.registry import Registry
    from grpo_pipeline.tasks.promote.registry_client import open_client

    mlflow_warnings_only()
    return Registry(open_client(cfg.mlflow_uri), cfg.tracking.registered_model)


def _existing_registry(config: Path | None, overrides: list[str] | None) -> Registry:
    """The registry for a command that moves aliases: refused (exit 2) where none exists yet, not created."""
    _, cfg = load(config, overrides)
    if nothing := missing(cfg.mlflow_uri):
        _fail(False, nothing, EXIT_CONFIG)
    return _registry(cfg)


def _registry_call(registry: Registry, action: Callable[[], list[AliasMove]]) -> None:
    """Run an alias-moving command; print every alias it moved (on both registered models), with what each
    pointed at before."""
    from grpo_pipeline.tasks.promote.registry import RegistryError, RegistryServiceError

    refused: tuple[type[BaseException], ...] = (RegistryError, RegistryServiceError, *registry.errors)
    try:
        moves = action()
    except refused as exc:  # an unreachable server: at once, by URL
        _fail(False, str(exc), EXIT_CONFIG)
    for move in moves:
        print(move.describe())
    if not moves:
        print("no alias moved")


ReasonOpt = Annotated[str, typer.Option("--reason", help="why: recorded on the model version")]


def rollback(reason: ReasonOpt, config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Make the previous champion the champion again (a second rollback undoes the first)."""
    registry = _existing_registry(config, overrides)
    _registry_call(registry, lambda: registry.rollback(reason))


def promote(
    version: Annotated[str, typer.Option("--version", help="model version to make champion")],
    reason: ReasonOpt,
    force: Annotated[bool, typer.Option("--force", help="required: this skips the A/B decision")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
) -> None:
    """An operator's promotion without an A/B decision: the version becomes champion, the champion it replaces
    previous-champion; nothing else moves. Records who and why (forced_by, forced_reason) beside the version's
    own decision tag."""
    if not force:
        _fail(False, "promote skips the A/B decision; pass --force to confirm", EXIT_CONFIG)
    registry = _existing_registry(config, overrides)
    _registry_call(registry, lambda: registry.force(version, reason))


def registry(config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Print which model versions the aliases point at, as JSON. Where no registry exists yet (the embedded
    default before the first run), every alias is null, stderr says so, and nothing is created: exit 0."""
    _, cfg = load(config, overrides)
    if nothing := missing(cfg.mlflow_uri):
        from grpo_pipeline.tasks.promote.registry import ALIASES

        err.print(nothing, markup=False, highlight=False)
        print(json.dumps(dict.fromkeys(ALIASES)))
        return
    registry = _registry(cfg)
    try:
        print(json.dumps(registry.aliases()))
    except registry.errors as exc:  # e.g. the server does not answer
        _fail(False, str(exc), EXIT_CONFIG)
