"""Load a base model at the configured precision (optionally 4-/8-bit through bitsandbytes), plus an adapter;
the check that an adapter to train from fits the configured base and LoRA shape (`adapter_mismatch`); and
`keep_adapter_fp32`, which keeps a QLoRA adapter's weights in float32 for training."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_pipeline.trainer.spec import ModelLoad

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback


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


def upcast_trainable(model: torch.nn.Module, originals: Mapping[torch.nn.Parameter, torch.Tensor]) -> list[str]:
    """Put every trainable parameter held in half precision back to float32: the tensor it had in `originals`
    (keyed by the parameter itself) where there is one, else its own values upcast. The names changed.

    >>> import torch
    >>> layer = torch.nn.Linear(2, 2)
    >>> kept, exact = {layer.weight: layer.weight.data}, layer.weight.data.clone()
    >>> layer.weight.data, layer.bias.data = layer.weight.data.bfloat16(), layer.bias.data.bfloat16()
    >>> upcast_trainable(layer, kept), torch.equal(layer.weight.data, exact), layer.bias.dtype
    (['weight', 'bias'], True, torch.float32)
    """
    import torch

    changed = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
            original = originals.get(param)
            param.data = original if original is not None and original.dtype == torch.float32 else param.data.float()
            changed.append(name)
    return changed


def keep_adapter_fp32(model: PreTrainedModel | PeftModel) -> TrainerCallback:
    """A trainer callback that keeps the trainable (adapter) weights of a quantized base in float32.

    TRL's trainers cast every trainable parameter of a PEFT model on a 4-/8-bit base to bfloat16 in their
    constructor (GRPOTrainer.__init__, after the QLoRA paper's recipe). An AdamW step changes a bfloat16
    weight only when it is more than half a unit in its last place (8 significant bits): LoRA's A matrices
    start at up to 1/sqrt(fan_in) (0.04 on SmolLM2-135M, where one unit is 2.4e-4), so the small steps, late
    in a decaying schedule or where noisy gradients make Adam's ratio small, are rounded away: three GRPO
    steps at 3e-4 on a tiny model moved as few as 43 % of a LoRA A tensor's entries (docs/training.md#qlora).
    PEFT itself keeps adapters in float32 (`autocast_adapter_dtype`), and so does this: they are a small
    fraction of the model, and under bf16 mixed precision the matmuls still run in bf16.

    Made before the trainer (it records a warm start's float32 adapter, so the cast loses none of its
    bits) and passed in its callbacks: at the end of the trainer's construction, after TRL's cast and
    before the optimizer exists, it puts them back. A model on a full-precision base is left alone.
    """
    from peft import PeftModel
    from transformers import TrainerCallback

    # a warm start's adapter (a fresh one is made inside the trainer, from its peft_config)
    originals = {p: p.data for p in model.parameters() if p.requires_grad} if isinstance(model, PeftModel) else {}

    class KeepAdapterFP32(TrainerCallback):
        def on_init_end(self, args, state, control, model=None, **kwargs):
            quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
            if model is not None and quantized:
                upcast_trainable(model, originals)

    return KeepAdapterFP32()
