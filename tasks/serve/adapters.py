"""What the router serves: the registry's aliases resolved to adapter folders on this machine, and the check
that an adapter fits the engine's base.

A registered version is the MLflow model `grpo_pipeline.tasks.promote.serving.log_adapter_model` logged: its `MLmodel`
names the base (`config.base`, a hub id or `runs:/<id>/model`, and `config.base_sha256`) and its
`artifacts/adapter` folder is the PEFT adapter. `resolve` downloads a version once into
`<cache>/<name>/<version>` (a version's files never change) and reads both; `local_base` fetches the base once
per content hash into `$GRPO_MODEL_CACHE`, the folder the MLflow model itself uses.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_pipeline.tasks.promote.download import download

if TYPE_CHECKING:
    from grpo_pipeline.tasks.promote.registry import Registry


class AdapterError(RuntimeError):
    """A version that cannot be served: not an adapter, unreadable, or not fitting the engine."""


@dataclass(frozen=True)
class Adapter:
    alias: str  # champion | challenger
    version: str  # the registry version
    path: Path  # the PEFT adapter folder (adapter_config.json, weights)
    base: str  # the base it was trained on, as the registry names it
    base_sha256: str | None
    rank: int

    @property
    def engine_name(self) -> str:
        """The adapter's name in the engine and in each response's `model`: alias and version, so the old and
        the new version of one alias are both loaded while requests move over."""
        return f"{self.alias}-v{self.version}"


def same_base(a: Adapter, base: str, base_sha256: str | None) -> bool:
    """Trained on the engine's base: the same content hash when both have one, else the same reference."""
    if a.base_sha256 and base_sha256:
        return a.base_sha256 == base_sha256
    return a.base == base


def refusal(a: Adapter, base: str, base_sha256: str | None, max_rank: int) -> str | None:
    """Why the engine cannot serve `a` (None: it can).

    >>> a = Adapter("challenger", "7", Path("x"), "runs:/r2/model", "bbb", 8)
    >>> refusal(a, "runs:/r1/model", "aaa", 16)
    'challenger v7 was trained on base runs:/r2/model (sha256 bbb), the engine serves runs:/r1/model (sha256 aaa); not loaded: serve it from a router started on that base'
    >>> refusal(Adapter("challenger", "7", Path("x"), "hub/base", None, 32), "hub/base", None, 16)
    'challenger v7 has LoRA rank 32, above ab.serve.max_lora_rank=16; not loaded: raise ab.serve.max_lora_rank and restart the router'
    """
    if not same_base(a, base, base_sha256):
        return (
            f"{a.alias} v{a.version} was trained on base {a.base} (sha256 {a.base_sha256}), the engine serves "
            f"{base} (sha256 {base_sha256}); not loaded: serve it from a router started on that base"
        )
    if a.rank > max_rank:
        return (
            f"{a.alias} v{a.version} has LoRA rank {a.rank}, above ab.serve.max_lora_rank={max_rank}; not "
            "loaded: raise ab.serve.max_lora_rank and restart the router"
        )
    return None


def read_version(alias: str, version: str, model_dir: Path) -> Adapter:
    """The adapter inside a downloaded MLflow model folder."""
    import yaml

    try:
        meta = yaml.safe_load((model_dir / "MLmodel").read_text())
        config = meta["flavors"]["python_function"].get("config") or {}
    except (OSError, KeyError, TypeError, yaml.YAMLError) as e:
        raise AdapterError(f"{alias} v{version}: {model_dir} is not an MLflow model ({type(e).__name__}: {e})") from e
    adapter = model_dir / "artifacts" / "adapter"
    if not (adapter / "adapter_config.json").is_file() or "base" not in config:
        raise AdapterError(
            f"{alias} v{version} is not a LoRA adapter model (a merged model, or another kind): the "
            "router serves adapters on one base; register the adapter model"
        )
    peft = json.loads((adapter / "adapter_config.json").read_text())
    return Adapter(alias, str(version), adapter, str(config["base"]), config.get("base_sha256"), int(peft.get("r", 0)))


def resolve(registry: Registry, alias: str, tracking_uri: str, cache: Path) -> Adapter | None:
    """The adapter `models:/<name>@<alias>` names now in the registry at `tracking_uri`, downloaded once per
    version (None: no such alias)."""
    version = registry.version_of(alias)
    if version is None:
        return None
    target = Path(cache) / registry.name / str(version)
    if not (target / "MLmodel").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".download-"))
        try:
            # through the registry at tracking_uri: MLflow's own models:/ lookup would ask its default one
            local = download(f"models:/{registry.name}/{version}", staging, tracking_uri)
            Path(local).rename(target)  # whole or not at all
        except OSError:
            if not (target / "MLmodel").is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return read_version(alias, str(version), target)


def local_base(reference: str, sha256: str | None, tracking_uri: str) -> str:
    """A folder (or hub id) the engine loads: a `runs:/` or other URI downloaded once per content hash, by the
    portable champion's own function, into the cache a loaded MLflow model uses too (`$GRPO_MODEL_CACHE`)."""
    # Imported here, in the router only: it is MLflow's models-from-code file, which registers its model with
    # MLflow (`set_model`) as it is imported.
    from grpo_pipeline.tasks.promote.serving_model import local_base as download_once

    return download_once(reference, sha256, tracking_uri)
