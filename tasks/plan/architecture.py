"""The model catalogue: the architecture numbers memory depends on, read from a Hugging Face config.json
(shipped for common bases in configs/models/, or the model's own), and the LoRA adapter they imply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_pipeline.configs.files import packaged
from grpo_pipeline.tasks.plan.base import Frozen, PlanError

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's targets when `target_modules` is unset (its LoraConfig default, None): a per-architecture table
# (peft.utils.constants), the same two for the llama, qwen2 and mistral families; tests/unit/test_plan.py
# compares it with PEFT's for every shipped model.
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")

KNOWN_MODELS: dict[str, tuple[str, ...]] = {
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B-Instruct"),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-3B-Instruct"),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-14b": ("Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-14B-Instruct"),
    "qwen2.5-32b": ("Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-32B-Instruct"),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct"),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"),
    "llama-3.1-8b": (
        "meta-llama/Llama-3.1-8B",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Meta-Llama-3.1-8B",
        "meta-llama/Meta-Llama-3.1-8B-Instruct",
    ),
    "llama-3.1-70b": (
        "meta-llama/Llama-3.1-70B",
        "meta-llama/Llama-3.1-70B-Instruct",
        "meta-llama/Meta-Llama-3.1-70B",
        "meta-llama/Meta-Llama-3.1-70B-Instruct",
    ),
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
}


def _alias_index() -> dict[str, str]:
    index = {}
    for stem, ids in KNOWN_MODELS.items():
        for name in (stem, *ids):
            index[name.lower()] = stem
    return index


def load_model_config(ref: str) -> tuple[str, dict[str, Any]]:
    """(display name, config dict) for a known model id, a config.json path, or a model directory.

    >>> name, cfg = load_model_config("Qwen/Qwen2.5-7B-Instruct")
    >>> name, cfg["hidden_size"], cfg["num_key_value_heads"]
    ('qwen2.5-7b', 3584, 4)
    """
    stem = _alias_index().get(ref.lower())
    if stem:
        return stem, json.loads(packaged(f"models/{stem}.json").read_text())
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return path.parent.name if path.name == "config.json" else path.stem, json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path} is not valid JSON ({exc}); give a model's config.json") from None
    known = ", ".join(KNOWN_MODELS)
    raise PlanError(
        f"no model config for {ref!r}: give a config.json path, a model directory that holds one, "
        f"or a known id ({known}, or their hub ids such as Qwen/Qwen2.5-7B-Instruct)"
    )


def model_config_for(base: str, model_path: str | None = None) -> tuple[str, dict[str, Any]]:
    """The config.json of the resolved model directory when there is one, else a known id's shipped config.

    >>> model_config_for("smollm2-135m-instruct")[0]
    'smollm2-135m'
    """
    if model_path and (Path(model_path) / "config.json").is_file():
        name = base if not Path(base).expanduser().exists() else Path(base).name
        return name, json.loads((Path(model_path) / "config.json").read_text())
    return load_model_config(base)


class Architecture(Frozen):
    """The numbers of a decoder-only transformer (Llama/Qwen2/Mistral layout) that memory depends on."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer in one decoder layer."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def linear_params(self) -> int:
        """Weights of all decoder-layer linears: what bitsandbytes quantizes."""
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def other_params(self) -> int:
        """Embeddings, LM head (unless tied), norms and biases: kept in the compute dtype."""
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        norms = (2 * self.layers + 1) * self.hidden
        bias = self.layers * (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return embed + norms + bias

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (6N rule): layer linears plus the LM head."""
        return self.linear_params + self.vocab * self.hidden


def architecture(config: dict[str, Any]) -> Architecture:
    """Read the fields that matter from a Hugging Face config.json dict.

    >>> a = architecture(load_model_config("llama-3.1-8b")[1])
    >>> round(a.params / 1e9, 2), a.kv_dim
    (8.03, 1024)
    """
    cfg = config.get("text_config") or config  # multimodal configs nest the language model
    if any(k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")):
        raise PlanError("mixture-of-experts configs are not supported by the memory estimate; plan a dense model")
    missing = [
        k
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if not cfg.get(k)
    ]
    if missing:
        raise PlanError(f"the model config lacks {', '.join(missing)}: give a decoder-only model's config.json")
    heads = cfg["num_attention_heads"]
    model_type = cfg.get("model_type", "")
    return Architecture(
        model_type=model_type,
        hidden=cfg["hidden_size"],
        intermediate=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
        tied=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 hard-codes q/k/v biases in its modeling code; others say so in attention_bias.
        qkv_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2",
    )


def lora_modules(targets: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The decoder-layer linears a LoRA config adapts ('all-linear' = all seven; None = PEFT's default).

    >>> lora_modules("all-linear")[-1], lora_modules(["q_proj", "v_proj"]), lora_modules(None)
    ('down_proj', ('q_proj', 'v_proj'), ('q_proj', 'v_proj'))
    """
    if targets is None:
        return PEFT_DEFAULT_TARGETS
    if isinstance(targets, str):
        targets = list(ALL_LINEAR) if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    unknown = [t for t in targets if t not in ALL_LINEAR]
    if unknown:
        raise PlanError(f"LoRA target(s) {unknown} unknown; use 'all-linear' or names from {list(ALL_LINEAR)}")
    return tuple(dict.fromkeys(targets))


def lora_params(arch: Architecture, rank: int, targets: str | list[str] | tuple[str, ...] | None = None) -> int:
    """A LoRA adapter's parameter count: rank x (in + out) for each adapted linear, in every layer.

    >>> lora_params(architecture(load_model_config("qwen2.5-7b")[1]), 16, lora_modules("all-linear"))
    40370176
    """
    shapes = arch.linear_shapes()
    return arch.layers * rank * sum(sum(shapes[t]) for t in lora_modules(targets))
