"""Load a base model at the configured precision (optionally 4-/8-bit through bitsandbytes), plus an adapter."""

from __future__ import annotations

import logging

from trainer.spec import ModelLoad


def quantization_config(cfg: ModelLoad):
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


def load_model(path: str, cfg: ModelLoad, adapter: str | None = None):
    """Return (model, tokenizer); the tokenizer gets a pad token when the model has none."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Explicit, so the configuration is the one place that can allow a repository's own code to run.
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, cfg.compute_dtype), quantization_config=quantization_config(cfg),
        trust_remote_code=cfg.trust_remote_code,
    )
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model, tokenizer
