"""Load a base model at the configured precision (optionally 4-/8-bit through bitsandbytes), plus an adapter;
and the check that an adapter to train from fits the configured base and LoRA shape (`adapter_mismatch`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_pipeline.trainer.spec import ModelLoad

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase


def quantization_config(cfg: ModelLoad) -> BitsAndBytesConfig | None:
    """The `BitsAndBytesConfig` for a quantization mode, or None for a full-precision base."""
    if cfg.quantization == "none":
        return None
    # bitsandbytes warns on CPUs with AVX512-BF16 that an optional hub kernel is missing; it falls back
    # to its own CPU kernel, and the hub is not reachable from our machines anyway.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import torch
    from transformers import BitsAndBytesConfig

    if cfg.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quantization,
        bnb_4bit_use_double_quant=cfg.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, cfg.compute_dtype),
    )


PEFT_DEFAULT_R = 8  # peft.LoraConfig's r when train.lora sets none (configs/library_fields.json agrees)


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """The adapter's `adapter_config.json`; a ValueError naming the directory when there is none."""
    path = Path(adapter_dir) / "adapter_config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{adapter_dir} holds no adapter_config.json: not a PEFT adapter") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None


def _modules(value: Any) -> str | frozenset[str] | None:
    """target_modules as compared: a list in any order is a set; a string (a regex, 'all-linear') stays one."""
    if value is None or isinstance(value, str):
        return value
    return frozenset(value)


def adapter_mismatch(adapter: Mapping[str, Any], bases: Collection[str] | None, lora: Mapping[str, Any]) -> str | None:
    """Why an adapter (its adapter_config.json) cannot be trained on: another base than any of `bases` (the
    names the configured base goes by; None: not checked here), or another LoRA rank or target_modules than `lora` (train.lora) asks
    for; None when it fits. Training continues the adapter's own weights, so its shape is what trains: a
    silently different rank or module set would make the run something else than its configuration says.

    `all-linear` in train.lora is PEFT's shorthand for every linear layer but the output; an adapter trained
    with it lists the modules by name, which matches (the trainer loads the adapter's own list).

    >>> cfg = {"base_model_name_or_path": "org/base", "r": 16, "target_modules": ["v_proj", "q_proj"]}
    >>> adapter_mismatch(cfg, {"org/base"}, {"r": 16, "target_modules": ["q_proj", "v_proj"]}) is None
    True
    >>> adapter_mismatch(cfg, {"org/other"}, {"r": 16})
    "the adapter was trained on base 'org/base', not on model.base 'org/other'; set model.base to it, or model.init_adapter=none"
    >>> adapter_mismatch(cfg, {"org/base"}, {"r": 8})
    'the adapter has LoRA rank r=16, train.lora.r is 8; set train.lora.r=16, or model.init_adapter=none'
    """
    base = adapter.get("base_model_name_or_path")
    if bases is not None and base is not None and base not in bases:
        configured = next(iter(bases), "?")
        return (
            f"the adapter was trained on base {base!r}, not on model.base {configured!r}; set model.base to it, "
            "or model.init_adapter=none"
        )
    r = lora.get("r", PEFT_DEFAULT_R)
    if adapter.get("r") != r:
        return (
            f"the adapter has LoRA rank r={adapter.get('r')}, train.lora.r is {r}; set train.lora.r={adapter.get('r')}, "
            "or model.init_adapter=none"
        )
    want, have = _modules(lora.get("target_modules")), _modules(adapter.get("target_modules"))
    if want is not None and want != have and not (want == "all-linear" and isinstance(have, frozenset)):
        shown = sorted(have) if isinstance(have, frozenset) else have
        return (
            f"the adapter's LoRA target_modules are {shown}, train.lora.target_modules is "
            f"{sorted(want) if isinstance(want, frozenset) else want!r}; set train.lora.target_modules to the "
            "adapter's, or model.init_adapter=none"
        )
    return None


def load_model(
    path: str, cfg: ModelLoad, adapter: str | None = None, trainable: bool = False
) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]:
    """Return (model, tokenizer); the tokenizer gets a pad token when the model has none. With `adapter`, the
    model is a PeftModel with it loaded: frozen for evaluation, or `trainable` to continue training it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Explicit, so the configuration is the one place that can allow a repository's own code to run.
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=getattr(torch, cfg.compute_dtype),
        quantization_config=quantization_config(cfg),
        trust_remote_code=cfg.trust_remote_code,
    )
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable)
    return model, tokenizer
