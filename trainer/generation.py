"""Generation from merged LoRA weights: the sampling pass runs `W + s·BA` in one matmul per layer instead of the
base layer plus the adapter's three extra ops (dropout, A, B, scaled add) in each of the LoRA-wrapped linears.

Why: a GRPO step samples its completions token by token. At a CPU batch of 16 sequences x 1 new token, each
decode forward is ~2,700 tiny torch ops, and an all-linear adapter adds three to each of the base's linears (210
on SmolLM2-135M), whose cost is Python and dispatch, not arithmetic (bench.step_profile). The loss's own forward
and backward keep the unmerged adapter: its gradients flow through A and B.

How: for the generation call only, each LoRA linear's base weight is swapped for a fresh `W + delta` tensor and
the adapter layers are disabled (PEFT's `disable_adapter`); afterwards the original weight tensor is put back
(the same storage: bit for bit, no `W + d - d` rounding that PEFT's merge/unmerge would add every step). The
merged copy costs one more set of the adapted weights in memory while generating.

Only where it can run exactly: vanilla LoRA on full-precision `torch.nn.Linear` layers. A quantized base (merging
into NF4/int8 weights would requantize them), DoRA or another variant, a LoRA bias, or a model without an adapter
falls back to the unmerged generation with one warning naming the setting; so do weights FSDP or DeepSpeed shard.
With vLLM generating, there is nothing to merge here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)
SETTING = "train.merged_generation"


def wanted(setting: bool | None, cuda: bool) -> bool:
    """Whether a job generates from merged weights: as `train.merged_generation` says, else where there is no GPU.

    >>> wanted(None, cuda=False), wanted(None, cuda=True), wanted(False, cuda=False), wanted(True, cuda=True)
    (True, False, False, True)
    """
    return (not cuda) if setting is None else setting


def merge_blocker(model: Any) -> str | None:
    """Why `model`'s adapter cannot be generated from merged weights (exactly, as this module does it), or None.

    >>> import torch
    >>> merge_blocker(torch.nn.Linear(2, 2))
    'the model has no PEFT adapter'
    """
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear as LoraLinear

    if not isinstance(model, PeftModel):
        return "the model has no PEFT adapter"
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        return "the base is quantized (merging would requantize its weights)"
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not layers:
        return "the adapter is not LoRA"
    for layer in layers:
        if type(layer) is not LoraLinear or type(layer.get_base_layer()) is not torch.nn.Linear:
            return f"{type(layer).__name__} over {type(layer.get_base_layer()).__name__} is not a plain LoRA linear"
        for name in layer.active_adapters:
            if name in layer.lora_variant:
                return f"the adapter uses a LoRA variant ({type(layer.lora_variant[name]).__name__})"
            if layer.lora_bias.get(name):
                return "the adapter has a LoRA bias (lora_bias=True)"
        if layer.merged:
            return "the adapter is already merged into the base"
        if not layer.get_base_layer().weight.dtype.is_floating_point:
            return "the base weights are not floating point"
    return None


@contextmanager
def merged_adapter(model: Any) -> Iterator[None]:
    """Inside: `model` (a PeftModel whose `merge_blocker` is None) computes with `W + s·BA` in its base linears and
    its adapter layers disabled; after: its base weights are the same tensors as before, its adapter enabled."""
    import torch
    from peft.tuners.lora import LoraLayer

    swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for layer in (m for m in model.modules() if isinstance(m, LoraLayer)):
                weight = layer.get_base_layer().weight
                merged = weight.data
                for name in layer.active_adapters:
                    merged = merged + layer.get_delta_weight(name).to(merged.dtype)
                swapped.append((weight, weight.data))
                weight.data = merged
        with model.disable_adapter():
            yield
    finally:
        for weight, original in swapped:
            weight.data = original


def trainer_class(base: type) -> type:
    """`base` (TRL's GRPOTrainer or one of the project's subclasses) generating from merged LoRA weights where
    `merge_blocker` allows; elsewhere it generates as `base` does, after one warning naming `SETTING`."""

    class MergedGenerationTrainer(base):
        _merge_checked = False
        _merge_ok = False

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            if not self._merge_checked:
                self._merge_checked = True
                if self.use_vllm:  # vLLM holds its own copy of the weights: nothing to merge here
                    reason = None
                elif getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
                    reason = "FSDP / DeepSpeed shard the weights"
                else:
                    reason = merge_blocker(self.model)
                self._merge_ok = not self.use_vllm and reason is None
                if reason:
                    log.warning("%s: generating from the unmerged adapter: %s", SETTING, reason)
            if not self._merge_ok:
                return super()._generate_single_turn(*args, **kwargs)
            with merged_adapter(self.model):
                return super()._generate_single_turn(*args, **kwargs)

    return MergedGenerationTrainer
