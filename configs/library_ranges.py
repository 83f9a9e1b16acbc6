"""The ranges of the TRL and PEFT fields users set most (`train.grpo`, `train.lora`), checked when the configuration
loads, so `--set train.lora.r=-4` is refused by `config` and every other command, by its dotted key, rather than by
the planner under a name of its own or by TRL or PEFT minutes into a run. `library_fields` checks that a field
exists and has the library's type; this table checks that its value makes sense. A bound is one entry: the
interval (pydantic's own constraints, so the messages read as the rest of the configuration's), the values
outside it the library gives a meaning, and what the field does, which is the fix.

    >>> problem("LoraConfig", "r", -4)
    'Input should be greater than or equal to 1 (got -4); the LoRA rank: 8-64 is usual, more = closer to full fine-tuning, more memory'
    >>> problem("GRPOConfig", "max_steps", -5)
    'Input should be greater than or equal to 1, or -1 (got -5); optimizer steps to train (-1: num_train_epochs decides)'
    >>> problem("GRPOConfig", "max_steps", -1) is None, problem("GRPOConfig", "seed", -1) is None
    (True, True)
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, NamedTuple

from pydantic import Field, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

ERROR_TYPE = "library_range"  # the error's type: the loader names it by the section and the error's `field`


class Bound(NamedTuple):
    constraint: Any  # a pydantic Field(...) holding the interval (ge, gt, le, lt)
    what: str  # what the field does and its usual values: the fix, told with the refusal
    also: tuple[float, ...] = ()  # values outside the interval that the library gives a meaning


RANGES: dict[str, dict[str, Bound]] = {
    "LoraConfig": {
        "r": Bound(Field(ge=1), "the LoRA rank: 8-64 is usual, more = closer to full fine-tuning, more memory"),
        "lora_alpha": Bound(Field(gt=0), "the adapter's scale is lora_alpha / r: r or 2r is usual"),
        "lora_dropout": Bound(Field(ge=0, lt=1), "a probability: 0 to 0.1 is usual"),
    },
    "GRPOConfig": {
        "learning_rate": Bound(Field(gt=0), "1e-6 (TRL's default) to 1e-4 is usual for a LoRA adapter"),
        "max_steps": Bound(Field(ge=1), "optimizer steps to train (-1: num_train_epochs decides)", also=(-1,)),
        "per_device_train_batch_size": Bound(Field(ge=1), "completions per device per micro-step"),
        "gradient_accumulation_steps": Bound(Field(ge=1), "micro-steps per optimizer step"),
        "generation_batch_size": Bound(Field(ge=1), "completions generated at once; unset: TRL derives it"),
        "steps_per_generation": Bound(Field(ge=1), "optimizer steps per generation round; unset: TRL derives it"),
        "num_generations": Bound(
            Field(ge=2), "completions per prompt: GRPO compares them within the group, so 2 or more (8 is usual)"
        ),
        "max_completion_length": Bound(Field(ge=1), "the most tokens a completion may take"),
        "temperature": Bound(Field(gt=0), "the sampling temperature: 0.7-1.0 is usual"),
        "beta": Bound(Field(ge=0), "the KL penalty's weight: 0 (TRL's default) turns it off"),
    },
}


@functools.cache
def _adapter(cls_name: str, name: str) -> TypeAdapter[float]:
    return TypeAdapter(Annotated[float, RANGES[cls_name][name].constraint])


def problem(cls_name: str, name: str, value: Any) -> str | None:
    """What is wrong with `value` for the field `name` of a library class, or None when it is in range, unset
    (None), or has no bound here. The value's type is `library_fields`' check, made before this one."""
    bound = RANGES.get(cls_name, {}).get(name)
    if bound is None or value is None or value in bound.also:
        return None
    try:
        _adapter(cls_name, name).validate_python(value)
    except ValidationError as exc:
        also = f", or {' or '.join(f'{v:g}' for v in bound.also)}" if bound.also else ""
        return f"{exc.errors()[0]['msg']}{also} (got {value!r}); {bound.what}"
    return None


def check(cls_name: str, name: str, value: Any) -> None:
    """Raise the refusal of an out-of-range value inside the section's validator: pydantic reports it at the
    section (train.lora), and the error's context carries the field, so the loader names `train.lora.r`."""
    if (found := problem(cls_name, name, value)) is not None:
        raise PydanticCustomError(ERROR_TYPE, "{problem}", {"field": name, "problem": found})
