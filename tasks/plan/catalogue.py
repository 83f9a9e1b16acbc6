"""The GPU catalogue: memory, bf16 peak, bandwidth and prices per GPU type, shipped in configs/gpus.yaml
and merged with the user's own file (`--catalog`, `plan.gpu_catalog`)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from grpo_pipeline.configs.files import packaged
from grpo_pipeline.tasks.plan.base import Frozen, PlanError

CATALOG_FILE = packaged("gpus.yaml")


class GPU(Frozen):
    name: str
    memory_gib: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    bandwidth_tbs: float = Field(gt=0)
    on_demand_usd_h: float = Field(ge=0)
    spot_usd_h: float = Field(ge=0)
    source: str = ""


class Catalog(Frozen):
    as_of: str
    source: str
    gpus: dict[str, GPU]

    def get(self, name: str) -> GPU:
        """A GPU by name, case-insensitive; SkyPilot's 'A100' is the 40 GB part; a ':count' suffix is ignored.

        >>> load_catalog().get("a100:1").name
        'A100-40GB'
        """
        key = name.split(":")[0].strip().upper()
        key = {"A100": "A100-40GB", "H100-SXM": "H100", "H100-80GB": "H100"}.get(key, key)
        for gpu_name, gpu in self.gpus.items():
            if gpu_name.upper() == key:
                return gpu
        raise PlanError(
            f"GPU {name!r} is not in the catalog; known: {', '.join(self.gpus)} (add it with plan.gpu_catalog)"
        )


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"GPU catalog {path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"GPU catalog {path}: the top level must be a mapping with 'gpus'")
    return data


def load_catalog(override: str | Path | None = None) -> Catalog:
    """The shipped catalog, with a user file merged over it GPU by GPU and field by field.

    >>> load_catalog().gpus["H100"].memory_gib
    79.6
    """
    data = _read_yaml(CATALOG_FILE)
    if override is not None:
        path = Path(override).expanduser()
        if not path.is_file():
            raise PlanError(f"plan.gpu_catalog: {path} not found; give a YAML file shaped like configs/gpus.yaml")
        user = _read_yaml(path)
        for key in ("as_of", "source"):
            if key in user:
                data[key] = user[key]
        for name, fields in (user.get("gpus") or {}).items():
            data["gpus"][name] = {**data["gpus"].get(name, {}), **(fields or {})}
    try:
        return Catalog(
            as_of=str(data.get("as_of", "")),
            source=str(data.get("source", "")).strip(),
            gpus={n: GPU(name=n, **f) for n, f in data["gpus"].items()},
        )
    except (ValidationError, TypeError) as exc:
        raise PlanError(f"GPU catalog {override or CATALOG_FILE} is invalid: {exc}") from None
