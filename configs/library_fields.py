"""The fields, types and defaults of the library dataclasses the configuration passes through (TRL's
`GRPOConfig`, PEFT's `LoraConfig`), read from a snapshot of those very classes, so that validating or
planning a configuration never imports TRL or PEFT: both load torch (seconds; on a node, a GPU runtime).

The snapshot, `library_fields.json` beside this file, is taken from the installed classes with

    python -m grpo_pipeline.configs.library_fields      # after upgrading TRL or PEFT

and a test takes it afresh and compares, so a TRL or PEFT release that changes a field fails there first.

    >>> default("GRPOConfig", "num_generations"), default("LoraConfig", "r")
    (8, 8)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional, Union  # names the snapshot's types use

SNAPSHOT = Path(__file__).with_name("library_fields.json")
CLASSES = {"GRPOConfig": ("trl", "GRPOConfig"), "LoraConfig": ("peft", "LoraConfig")}
_TYPE_NAMES = {
    "Any": Any,
    "Literal": Literal,
    "Optional": Optional,
    "Union": Union,
    "list": list,
    "dict": dict,
    "tuple": tuple,
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "None": None,
}


class LibraryField(NamedTuple):
    type: Any  # a typing expression pydantic can validate against; Any where the library's type is its own class
    default: Any  # the declared default (a default_factory's value); None where there is none


@functools.cache
def fields(cls_name: str) -> dict[str, LibraryField]:
    """Every `__init__` field of a snapshotted class, by name."""
    entries = json.loads(SNAPSHOT.read_text())[cls_name]
    return {name: LibraryField(eval(e["type"], {}, _TYPE_NAMES), e["default"]) for name, e in entries.items()}


def default(cls_name: str, name: str) -> Any:
    return fields(cls_name)[name].default


def grpo_value(grpo: dict[str, Any], name: str) -> Any:
    """What GRPOConfig(**grpo) would hold for `name`: the value set (None counts as unset), else TRL's default.

    >>> grpo_value({"per_device_train_batch_size": 4}, "per_device_train_batch_size"), grpo_value({}, "num_generations")
    (4, 8)
    """
    return grpo[name] if grpo.get(name) is not None else default("GRPOConfig", name)


# ------------------------------------------------------------------------- taking the snapshot (imports torch)


def portable(hint: Any) -> str:
    """A type annotation written with the names above only: a library's enum becomes the Literal of its
    values (or a plain str), any other class of its own becomes Any.

    >>> portable(typing.Optional[list[str]]), portable(dict[str, Any]), portable(None | str | list[str])
    ('Optional[list[str]]', 'dict[str, Any]', 'Optional[Union[list[str], str]]')
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin in (Union, types.UnionType):  # Optional[X] and X | None (transformers 5 writes the latter)
        # sorted: typing caches equal unions, so the order of X | Y depends on what was imported first
        parts = sorted(portable(a) for a in args if a is not type(None))
        inner = parts[0] if len(parts) == 1 else f"Union[{', '.join(parts)}]"
        return f"Optional[{inner}]" if type(None) in args else inner
    if origin is Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(portable(a) for a in args)}]" if args else origin.__name__
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f"Literal[{', '.join(repr(m.value) for m in hint)}]"
    if hint in (int, float, str, bool):
        return hint.__name__
    return "Any"


def _jsonable(value: Any) -> Any:
    value = value.value if isinstance(value, enum.Enum) else value
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value


def take_snapshot() -> dict[str, dict[str, dict[str, Any]]]:
    snapshot = {}
    for cls_name, (module, attr) in CLASSES.items():
        cls = getattr(importlib.import_module(module), attr)
        hints = typing.get_type_hints(cls)
        entries = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            entries[f.name] = {
                "type": portable(hints.get(f.name, Any)),
                "default": None if value is dataclasses.MISSING else _jsonable(value),
            }
        snapshot[cls_name] = entries
    return snapshot


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(take_snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
