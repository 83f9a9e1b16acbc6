"""Which adapter a run continues (`model.init_adapter`): resolved in the registry, downloaded and checked
before any work, by the pipeline (for training, and its search's trials) and by the `grpo-hpo` flow alike."""

from __future__ import annotations

from pathlib import Path

from grpo_pipeline.configs.schema import CHAMPION_OR_BASE, ConfigError, PipelineConfig
from grpo_pipeline.tasks.job import RunAdapter, WarmStart, base_names, check_init_adapter, parse_init_adapter
from grpo_pipeline.tasks.promote.download import download
from grpo_pipeline.tasks.promote.registry import MISSING, Registry
from grpo_pipeline.trainer.loading import read_adapter_config


def warm_start_stage(cfg: PipelineConfig, registry: Registry, run_dir: Path) -> WarmStart | None:
    """The adapter `model.init_adapter` names, downloaded into the run directory and checked against the base
    and train.lora; None for 'none', and for 'champion_or_base' while the registry has no champion (a cold run:
    `cold_start_note` says so). Raises ConfigError (exit 2), before any work, for a champion that does not exist yet
    ('champion'), a version, alias or run the registry does not know, and an adapter of another base or shape."""
    ref = parse_init_adapter(cfg.model.init_adapter, registry.name)
    if ref is None:
        return None
    field = f"model.init_adapter={cfg.model.init_adapter}"
    model = version = None
    tags: dict[str, str] = {}
    if isinstance(ref, RunAdapter):
        uri = source = ref.ref
    else:
        model = ref.model
        version = registry.version_of(ref.ref, model) if ref.kind == "alias" else ref.ref
        if version is None and cfg.model.init_adapter == CHAMPION_OR_BASE:
            return None
        if version is None:
            raise ConfigError(
                f"{field}: registered model {model!r} has no {ref.ref!r} alias yet (no run was promoted); train from the "
                f"base (model.init_adapter=none) or name a version (model.init_adapter=models:/{model}/<version>)"
            )
        try:
            mv = registry.client.get_model_version(model, version)
        except registry.errors as exc:
            if getattr(exc, "error_code", None) not in MISSING:
                raise
            raise ConfigError(
                f"{field}: registered model {model!r} has no version {version}; "
                f"`grpo-pipeline registry` lists the versions, or use model.init_adapter=none"
            ) from None
        if not mv.source:
            raise ConfigError(f"{field}: version {version} of registered model {model!r} names no artifacts (source)")
        uri, source, tags = f"models:/{model}/{version}", mv.source, dict(mv.tags)
    adapter = fetch_adapter(source, run_dir / "init-adapter", field, cfg.mlflow_uri)
    try:
        adapter_config = read_adapter_config(adapter)
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc}") from None
    bases = base_names(cfg.model, cfg.data_dir)
    # registered on this base: its adapter names a portable copy
    if tags.get("base_config") == cfg.model.base and (portable := adapter_config.get("base_model_name_or_path")):
        bases.add(portable)
    check_init_adapter(adapter_config, bases, cfg.train.lora, uri)
    return WarmStart(requested=cfg.model.init_adapter, uri=uri, model=model, version=version, adapter_dir=adapter)


def cold_start_note(cfg: PipelineConfig, warm_start: WarmStart | None) -> str | None:
    """Why a run that would continue the champion trains from the base instead (`champion_or_base` on a registry
    with no champion: a schedule's first day), in words for the summary, the log and the report; None otherwise.

    >>> from grpo_pipeline.configs.schema import load_config
    >>> cold_start_note(load_config(None, ["model.init_adapter=champion_or_base"]), None)
    "no champion in registered model 'grpo-adapter' yet: a cold run, a fresh adapter on the base model; the next run continues the champion this one may become"
    >>> cold_start_note(load_config(None), None) is None
    True
    """
    if warm_start is not None or cfg.model.init_adapter != CHAMPION_OR_BASE:
        return None
    return (
        f"no champion in registered model {cfg.tracking.registered_model!r} yet: a cold run, a fresh adapter on the "
        "base model; the next run continues the champion this one may become"
    )


def fetch_adapter(source: str, dst: Path, field: str, tracking_uri: str) -> str:
    """The adapter at an MLflow URI on local disk: a registered adapter model's `artifacts/adapter`, or the
    directory itself (a run's `adapter` artifact, a version registered before adapters were MLflow models). The
    URI (a logged model's models:/m-<id>, a runs:/) is resolved in the store at `tracking_uri`."""
    from mlflow.exceptions import MlflowException

    dst.mkdir(parents=True, exist_ok=True)
    try:
        local = Path(download(source, dst, tracking_uri))
    except (MlflowException, OSError) as exc:
        if isinstance(exc, MlflowException) and exc.error_code not in MISSING:
            raise  # the server, not the URI: a service fault
        raise ConfigError(
            f"{field}: nothing to download at {source} ({str(exc).splitlines()[0][:300]}); name an "
            "existing models:/ version or runs:/<run_id>/adapter, or use model.init_adapter=none"
        ) from None
    inner = local / "artifacts" / "adapter"
    return str(inner if inner.is_dir() else local)


def lineage_tags(warm_start: WarmStart | None) -> dict[str, str]:
    """Tags linking a run and its registered version to the adapter it continued (none for a run from the base)."""
    if warm_start is None:
        return {}
    tags = {"init_adapter": warm_start.uri}
    if warm_start.version:
        tags |= {"parent_version": warm_start.version, "parent_model": warm_start.model or ""}
    return tags
