"""Two cuts in a GRPO step's sampling pass, each computing what the path it replaces computes.

**Generation from merged LoRA weights** (`train.merged_generation`): the sampling pass runs `W + s·BA` in one matmul
per layer instead of the base layer plus the adapter's three extra ops (dropout, A, B, scaled add) in each of the
LoRA-wrapped linears.

Why: a GRPO step samples its completions token by token. At a CPU batch of 16 sequences x 1 new token, each
decode forward is ~2,700 tiny torch ops, and an all-linear adapter adds three to each of the base's linears (210
on SmolLM2-135M), whose cost is Python and dispatch, not arithmetic (bench.step_profile). The loss's own forward
and backward keep the unmerged adapter: its gradients flow through A and B.

How: for the generation call only, each LoRA linear's base weight is swapped for a fresh `W + delta` tensor and
the adapter layers are disabled (PEFT's `disable_adapter`); afterwards the original weight tensor is put back
(the same storage: bit for bit, no `W + d - d` rounding that PEFT's merge/unmerge would add every step). The
merged copy costs one more set of the adapted weights in memory while generating. Under bf16 (fp16) mixed
precision the sampling pass autocasts as the loss's forward does, from a merged copy made in bf16 once per call.

Only where it can run exactly: vanilla LoRA on full-precision `torch.nn.Linear` layers. A quantized base (merging
into NF4/int8 weights would requantize them), DoRA or another variant, a LoRA bias, or a model without an adapter
falls back to the unmerged generation; so do a LoRA dropout above 0 (TRL samples in train mode, where the
unmerged adapter drops part of its input) and weights FSDP or DeepSpeed shard. With vLLM generating, there is
nothing to merge here. The fallback warns once, naming the setting and why, where the setting asked for the cut
(`true`); unset, it is silent (`grpo_pipeline.trainer.cuts.Switch`).

**Prefill once** (`train.prefill_once`): TRL repeats each prompt `num_generations` times before it calls HF
`generate`, whose prefill then runs the same prompt through the model once per row (16 rows for 2 distinct prompts
in the demo). Here `generate` is wrapped for the sampling call: each distinct (left-padded) prompt row runs once,
all but its last token, into a `DynamicCache`; the cache's rows are then repeated to every row that shares the
prompt (an index map, so the batch need not be grouped), and HF `generate` continues from that cache with the full
repeated batch, feeding only each row's last prompt token. The decode batch, its positions (from the same
attention mask) and its sampling draws are those of the plain call, so the completions are the same and the
log-probs equal to float rounding (the prompt's keys and values come from a smaller batch, the first new token's
logits from a one-token step).

It falls back to the plain `generate` (one warning naming the setting where it was asked for, as above) where it
cannot be exact or is not understood: an encoder-decoder, a model whose cache is not plain full-attention
`DynamicCache` layers (sliding window, linear attention), `cache_implementation` set (static, offloaded, quantized), beam search, assisted
generation, several sequences per prompt, inputs other than `input_ids`/`attention_mask` (multimodal), prompts not
left-padded, dropout active while sampling (it would draw different masks), prompt learning adapters, vLLM or
transformers' continuous batching, FSDP / DeepSpeed sharding. A batch without a repeated prompt runs the plain call
silently: there is nothing to share.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.configuration_utils import GenerationMode

from grpo_pipeline.trainer.cuts import Switch

log = logging.getLogger(__name__)
SETTING = "train.merged_generation"
PREFILL_SETTING = "train.prefill_once"


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
            dropout = layer.lora_dropout[name]
            if isinstance(dropout, torch.nn.Dropout) and dropout.training and dropout.p > 0:
                # the unmerged adapter drops a random part of its input while TRL samples (train mode); W + s·BA
                # cannot, so the merged pass would sample from another distribution than the policy
                return f"LoRA dropout is active while sampling (lora_dropout={dropout.p})"
        if layer.merged:
            return "the adapter is already merged into the base"
        if not layer.get_base_layer().weight.dtype.is_floating_point:
            return "the base weights are not floating point"
    return None


def lora_dropout(model: Any) -> float:
    """The largest LoRA dropout probability among `model`'s active adapters, train mode or not (0.0: none).

    >>> lora_dropout(torch.nn.Linear(2, 2))
    0.0
    """
    return max(
        (
            layer.lora_dropout[name].p
            for layer in model.modules()
            if isinstance(layer, LoraLayer)
            for name in layer.active_adapters
            if isinstance(layer.lora_dropout[name], torch.nn.Dropout)
        ),
        default=0.0,
    )


@contextmanager
def merged_adapter(model: Any, cast_to: Any = None) -> Iterator[None]:
    """Inside: `model` (a PeftModel whose `merge_blocker` is None) computes with `W + s·BA` in its base linears and
    its adapter layers disabled; after: its base weights are the same tensors as before, its adapter enabled.

    `cast_to`: the dtype the calls inside autocast their matmuls to (bf16 mixed precision), or None. Autocast
    casts a frozen float32 weight again at every forward (it caches only the casts of weights that train), so a
    generation call cast all of them once per new token; with `cast_to` the merged weights, and the other frozen
    linears' (the LM head), are made in that dtype once for the call: the values autocast would have made."""
    swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    rebound: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
    try:
        with torch.no_grad():
            adapted = set()
            for layer in (m for m in model.modules() if isinstance(m, LoraLayer)):
                base = layer.get_base_layer()
                adapted.add(id(base))
                merged = base.weight.data
                for name in layer.active_adapters:
                    merged = merged + layer.get_delta_weight(name).to(merged.dtype)
                swapped.append((base.weight, base.weight.data))
                base.weight.data = merged if cast_to is None else merged.to(cast_to)
            for module in model.modules() if cast_to is not None else ():
                if (
                    isinstance(module, torch.nn.Linear)
                    and id(module) not in adapted
                    and not module.weight.requires_grad
                    and module.weight.dtype == torch.float32
                ):
                    # rebound, not cast in place: a tied LM head shares its tensor with the embedding, whose
                    # lookup autocast leaves in float32
                    rebound.append((module, module.weight))
                    module.weight = torch.nn.Parameter(module.weight.to(cast_to), requires_grad=False)
        with model.disable_adapter():
            yield
    finally:
        for weight, original in swapped:
            weight.data = original
        for module, weight in rebound:
            module.weight = weight


AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # accelerate's mixed_precision -> the autocast dtype


class MergedGeneration:
    """The cut `train.merged_generation` (`Switch`), around each sampling call of a trainer (TRL's GRPOTrainer): it
    decides once, at the first call, whether `merge_blocker` and the trainer allow it; where they do not, TRL's
    generation runs from the unmerged adapter. Unset, it is on where the node has no GPU (`wanted`)."""

    def __init__(self, value: bool | None, cuda: bool) -> None:
        self.switch = Switch(SETTING, value, log)
        self.on = wanted(value, cuda)
        self._ok: bool | None = None

    def _blocker(self, trainer: Any) -> str | None:
        if trainer.use_vllm:
            return "vLLM generates from its own copy of the weights"
        if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
            return "FSDP / DeepSpeed shard the weights"
        if p := lora_dropout(trainer.model):
            # decided once for the run, whatever mode the model is in at the first call (an evaluation on start
            # samples in eval mode): every training call samples in train mode, where the dropout draws masks
            return f"LoRA dropout samples in train mode (lora_dropout={p:g}): merged weights cannot drop the adapter's input"
        return merge_blocker(trainer.model)

    def around(self, trainer: Any) -> AbstractContextManager[None]:
        """The context TRL's `_generate_single_turn` runs in: merged weights (autocast as the loss's forward under
        mixed precision), or nothing."""
        if not self.on:
            return nullcontext()
        if self._ok is None:
            reason = self._blocker(trainer)
            self._ok = reason is None
            if reason and not trainer.use_vllm:  # with vLLM there is nothing to merge here: no fallback to tell
                self.switch.fall_back("generating from the unmerged adapter", reason)
        return self._merged(trainer) if self._ok else nullcontext()

    @contextmanager
    def _merged(self, trainer: Any) -> Iterator[None]:
        dtype = AUTOCAST_DTYPES.get(str(trainer.accelerator.mixed_precision))
        cast_to = getattr(torch, dtype) if dtype else None
        # Under mixed precision the loss's forward autocasts (accelerate wraps the model's forward), but PEFT's
        # generate calls the base model's own forward, outside that wrapper: the sampling pass ran in float32, from
        # a policy a rounding away from the one the loss scores. It autocasts as the loss does here.
        with (
            merged_adapter(trainer.model, cast_to),
            torch.autocast(trainer.accelerator.device.type, dtype=cast_to, enabled=cast_to is not None),
        ):
            yield


# what `prefilled_generate` passes on to `generate` untouched; anything else it does not claim to understand
_UNDERSTOOD = {"input_ids", "attention_mask", "generation_config"}


def _forward_params(model: Any) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def cache_kwarg(model: Any) -> str | None:
    """The name `model.forward` takes its KV cache under (`cache` in transformers 5.x, `past_key_values` before)."""
    params = _forward_params(model)
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def active_dropout(model: Any) -> str | None:
    """A dropout that would draw random masks in `model`'s forward now (TRL samples in train mode), or None."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.training and module.p > 0:
            return f"{type(module).__name__}(p={module.p})"
    if any(m.training for m in model.modules()):
        config = model.config.get_text_config(decoder=True).to_dict()
        for key, value in config.items():
            if (
                ("dropout" in key or "pdrop" in key)
                and isinstance(value, int | float)
                and not isinstance(value, bool)
                and value > 0
            ):
                return f"{key}={value}"
    return None


def cache_blocker(model: Any) -> str | None:
    """Why `model` (a transformers model, no PEFT wrapper) cannot continue exactly from a plain full-attention
    `DynamicCache` that an earlier call filled, or None.

    >>> import torch
    >>> cache_blocker(torch.nn.Linear(2, 2))
    'Linear is not a transformers generative model'
    """
    if not isinstance(model, GenerationMixin) or not hasattr(model, "config"):
        return f"{type(model).__name__} is not a transformers generative model"
    if model.config.is_encoder_decoder:
        return "the model is an encoder-decoder"
    if not model._supports_default_dynamic_cache() or cache_kwarg(model) is None:
        return f"{type(model).__name__} does not take a DynamicCache"
    layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        odd = next(type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer)
        return f"the model's cache has {odd} layers (only full-attention DynamicLayer is shared)"
    return None


def prefill_blocker(model: Any, kwargs: dict[str, Any]) -> str | None:
    """Why `model.generate(**kwargs)` (a transformers model, no PEFT wrapper) cannot continue exactly from a cache
    that `prefilled_generate` filled, or None.

    >>> import torch
    >>> prefill_blocker(torch.nn.Linear(2, 2), {})
    'Linear is not a transformers generative model'
    """
    if reason := cache_blocker(model):
        return reason
    if "assistant_model" in kwargs:
        return "assisted generation"
    rest = {k: v for k, v in kwargs.items() if k not in _UNDERSTOOD}
    try:  # the config generate will run with: the call's, over the model's, over transformers' defaults
        config, model_kwargs = model._prepare_generation_config(kwargs.get("generation_config"), **rest)
    except Exception as exc:  # whatever it is, the plain call raises it or copes
        return f"the generation config could not be read ({type(exc).__name__})"
    if model_kwargs:
        return f"generate got {', '.join(sorted(model_kwargs))} (only input_ids and attention_mask are understood)"
    mode = config.get_generation_mode()
    if mode == GenerationMode.ASSISTED_GENERATION:
        return "assisted generation"
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"{mode.value} decoding"
    if (config.num_return_sequences or 1) != 1:
        return f"num_return_sequences={config.num_return_sequences}"
    if config.cache_implementation is not None:
        return f"cache_implementation={config.cache_implementation!r}"
    if config.use_cache is False:
        return "use_cache=False"
    if config.prefill_chunk_size is not None or config.token_healing:
        return "chunked prefill or token healing"
    ids: Any = kwargs.get("input_ids")
    mask: Any = kwargs.get("attention_mask")
    if not _token_batch(ids, mask):
        return "generate needs input_ids and an attention_mask of the same 2-D shape here"
    if not bool(((mask == 0) | (mask == 1)).all()) or not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        return "the prompts are not left-padded"
    if ids.shape[1] > 1 and not bool(mask[:, -1].all()):
        return "the prompts are not left-padded"
    if reason := active_dropout(model):
        return f"dropout is active while sampling ({reason}): the rows would draw different masks"
    return None


def _token_batch(ids: Any, mask: Any) -> bool:
    """Whether `ids` and `mask` are token ids and an attention mask of one 2-D shape."""
    return (
        isinstance(ids, torch.Tensor)
        and isinstance(mask, torch.Tensor)
        and ids.ndim == 2
        and mask.shape == ids.shape
        and not ids.dtype.is_floating_point
    )


def distinct_rows(input_ids: Any, attention_mask: Any) -> tuple[list[int], list[int]]:
    """The first row of each distinct (input_ids, attention_mask) pair, in order of first appearance, and for each
    row the index of its pair among them.

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9]])
    >>> distinct_rows(ids, (ids != 0).long())
    ([0, 1], [0, 1, 0, 1])
    """
    firsts: list[int] = []
    index: dict[tuple[int, ...], int] = {}
    inverse = []
    for row, key in enumerate(torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1).tolist()):
        if tuple(key) not in index:
            index[tuple(key)] = len(firsts)
            firsts.append(row)
        inverse.append(index[tuple(key)])
    return firsts, inverse


def prefilled_generate(model: Any, generate: Callable[..., Any], warn: Callable[[str], None], **kwargs: Any) -> Any:
    """`generate(**kwargs)` (`model`'s own, bound), with each distinct prompt prefilled once where
    `prefill_blocker` allows; elsewhere the plain call, after `warn(reason)`. A batch without repeats, or prompts
    of one token, run the plain call silently."""
    ids: Any = kwargs.get("input_ids")
    mask: Any = kwargs.get("attention_mask")
    shared = distinct_rows(ids, mask) if _token_batch(ids, mask) else None
    if shared and (len(shared[0]) == ids.shape[0] or ids.shape[1] < 2):  # nothing shared or before the last token
        return generate(**kwargs)
    if reason := prefill_blocker(model, kwargs):
        warn(reason)
        return generate(**kwargs)
    cache_name = cache_kwarg(model)
    assert shared is not None and cache_name is not None  # prefill_blocker checked both
    firsts, inverse = shared
    rows = torch.tensor(firsts, device=ids.device)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    # what generate's own prefill passes, on the distinct rows and all but their last token: positions from the
    # attention mask (left padding counts none), the 2-D mask unless it is all ones (generate drops it then), one
    # position's logits
    inputs: dict[str, Any] = {"input_ids": ids[rows, :-1], cache_name: cache, "use_cache": True, "return_dict": True}
    if "position_ids" in _forward_params(model):
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        inputs["position_ids"] = positions[rows, :-1]
    if not bool((mask == 1).all()):
        inputs["attention_mask"] = mask[rows, :-1]
    if model._supports_logits_to_keep():
        inputs["logits_to_keep"] = 1
    with torch.no_grad():
        model(**inputs)
    cache.batch_select_indices(torch.tensor(inverse, device=ids.device))  # each row gets its prompt's keys/values
    # generate sees a cache of length-1 tokens beside the full ids and mask: it feeds each row's last token only
    return generate(**kwargs, **{cache_name: cache})


def transformers_model(model: Any) -> Any:
    """The transformers model whose `generate` runs the decode loop: a PeftModel's base model, else `model`."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@contextmanager
def prefill_once(model: Any, warn: Callable[[str], None]) -> Iterator[None]:
    """Inside: `model.generate` (a transformers model, or a PeftModel over one) prefills each distinct prompt once
    (`prefilled_generate`), calling `warn(reason)` where it cannot; after: `generate` is the model's own again."""
    config = getattr(model, "active_peft_config", None)
    if config is not None and config.is_prompt_learning:  # its virtual tokens go in front of the prompt's
        warn(f"the adapter is prompt learning ({config.peft_type})")
        yield
        return
    target = transformers_model(model)
    had = "generate" in vars(target)
    shadowed = vars(target).get("generate")
    plain = target.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        if args:  # TRL passes everything by name; positional inputs are not read here
            warn("generate got positional arguments")
            return plain(*args, **kwargs)
        return prefilled_generate(target, plain, warn, **kwargs)

    target.generate = generate
    try:
        yield
    finally:
        if had:
            target.generate = shadowed
        else:
            del target.generate


class PrefillOnce:
    """The cut `train.prefill_once` (`Switch`), around each sampling call of a trainer (TRL's GRPOTrainer): its
    transformers generation prefills each distinct prompt once (`prefill_once`); where it cannot, TRL's generation
    runs as it ships."""

    def __init__(self, value: bool | None) -> None:
        self.switch = Switch(PREFILL_SETTING, value, log)

    def fall_back(self, reason: str) -> None:
        self.switch.fall_back("prefilling every row as generate does", reason)

    def around(self, trainer: Any) -> AbstractContextManager[None]:
        if self.switch.off:
            return nullcontext()
        if trainer.use_vllm:
            reason = "vLLM generates (use_vllm; it shares prompt prefixes itself)"
        elif getattr(trainer, "use_transformers_continuous_batching", False):
            reason = "transformers' continuous batching generates"
        elif getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
            reason = "FSDP / DeepSpeed shard the weights (the ranks' forward counts must agree)"
        else:
            return prefill_once(trainer.accelerator.unwrap_model(trainer.model_wrapped), self.fall_back)
        self.fall_back(reason)
        return nullcontext()
