"""Planner: GPU memory, GPU choice, batch settings, time and cost of a GRPO run, from a model's config.json.

Pure functions over plain data, importing neither torch nor transformers, so `grpo-pipeline plan` answers
in well under a second and a GPU check script can call `estimate_memory` on any config.json:

    >>> est = estimate_memory(load_model_config("qwen2.5-7b")[1], quantization="none", lora_rank=16,
    ...                       per_device_batch=8, prompt_tokens=256, completion_tokens=512)
    >>> round(est.gib()["weights"], 1), round(est.gib()["total"], 1)
    (14.2, 19.4)

Units: bytes inside, GiB (2**30) when shown. Every formula below is an estimate built from how TRL 1.16,
PEFT and bitsandbytes allocate memory; none of it has been checked against a GPU yet (see the README).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from configs.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "configs" / "models"
CATALOG_FILE = ROOT / "configs" / "gpus.yaml"
GIB = 2**30

Quantization = Literal["none", "nf4", "fp4", "int8"]
DType = Literal["float32", "bfloat16", "float16"]
Optimizer = Literal[
    "adamw_torch", "adamw_torch_fused", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit"
]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's default targets when `target_modules` is unset (peft.utils.constants, llama/qwen2/mistral family).
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")
# TRL >= 1.x scores completions through a fused, tiled LM head (trl.kernels.chunked_logprob): the
# (tokens x vocab) logits are never whole, only tiles of 4096 tokens x 32768 vocabulary entries.
LOGIT_TILE_TOKENS, LOGIT_TILE_VOCAB = 4096, 32768

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
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
                     "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct",
                      "meta-llama/Meta-Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct"),
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
}


class PlanError(ConfigError):
    """The planner cannot answer for these inputs (unknown model, nothing fits); the message says what to change."""


class BudgetExceeded(ConfigError):
    """The run's estimated cost is above `plan.budget_usd`; refused before anything launches."""


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------------------------------------- models


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
        return stem, json.loads((MODELS_DIR / f"{stem}.json").read_text())
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
            "q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
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
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if not cfg.get(k)]
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


def lora_params(arch: Architecture, rank: int, targets=("q_proj", "v_proj")) -> int:
    """A LoRA adapter's parameter count: rank x (in + out) for each adapted linear, in every layer.

    >>> lora_params(architecture(load_model_config("qwen2.5-7b")[1]), 16, lora_modules("all-linear"))
    40370176
    """
    shapes = arch.linear_shapes()
    return arch.layers * rank * sum(sum(shapes[t]) for t in lora_modules(targets))


# ---------------------------------------------------------------------------------------------- memory


def weight_bytes_per_param(quantization: str, double_quant: bool, dtype: str) -> float:
    """Bytes per decoder-linear weight. NF4/FP4: 4 bits plus one fp32 absmax per 64-weight block (0.5 bit);
    double quantization stores those absmax in 8 bits with an fp32 scale per 256 blocks (~0.127 bit).

    >>> weight_bytes_per_param("nf4", False, "bfloat16"), round(weight_bytes_per_param("nf4", True, "bfloat16"), 4)
    (0.5625, 0.5159)
    """
    if quantization in ("nf4", "fp4"):
        return 0.5 + (1 / 64 + 4 / (64 * 256) if double_quant else 4 / 64)
    if quantization == "int8":
        return 1.0  # + an fp32 scale per output row, added per matrix below
    return DTYPE_BYTES[dtype]


def _optimizer_bytes(optimizer: str, param_bytes: int) -> float:
    """Optimizer state bytes per trainable parameter. torch AdamW keeps exp_avg and exp_avg_sq in the
    parameter's dtype; bitsandbytes 8-bit keeps them in 8 bits plus an fp32 absmax per 256-value block;
    paged variants hold the same bytes in unified memory that may spill to the CPU (counted in full here)."""
    if optimizer in ("adamw_torch", "adamw_torch_fused"):
        return 2 * param_bytes
    if optimizer in ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit"):
        return 2 * (1 + 4 / 256)
    if optimizer == "paged_adamw_32bit":
        return 8
    raise PlanError(f"optimizer {optimizer!r} unknown to the planner; use one of {list(Optimizer.__args__)}")


def activation_bytes_per_token_layer(arch: Architecture, act_bytes: int, rank: int, n_targets: int) -> int:
    """What one decoder layer keeps for backward, per token, without checkpointing (HF Llama/Qwen2 code,
    SDPA attention, no dropout): two RMSNorm inputs upcast to fp32 (2 x 4H), two normed inputs (2H),
    q and the repeated k, v plus the attention output (4 q_dim; GQA heads are expanded before SDPA),
    the MLP's gate, up, SiLU(gate) and product (4I), and each LoRA A output (rank)."""
    return (8 * arch.hidden + act_bytes * (2 * arch.hidden + 4 * arch.q_dim + 4 * arch.intermediate)
            + act_bytes * rank * n_targets)


def kv_bytes_per_token(arch: Architecture, act_bytes: int) -> int:
    """K and V of every layer for one token.

    >>> kv_bytes_per_token(architecture(load_model_config("llama-3.1-70b")[1]), 2)
    327680
    """
    return 2 * arch.layers * arch.kv_dim * act_bytes


class MemoryEstimate(Frozen):
    """Peak GPU memory of GRPO training, by component, in bytes.

    Peak = persistent state + the larger of the training phase (gradients, activations, logits tile,
    dequantization/gather buffer) and the generation phase (KV cache), since TRL generates first and
    then trains on what it generated; gradients are freed (set to None) between the two.
    """

    params: int
    trainable_params: int
    weights: int
    adapter: int
    optimizer: int
    reference: int  # a second copy of the weights: full fine-tuning with beta > 0 only
    vllm: int  # colocated vLLM: its own weights, KV pool and CUDA graphs
    gradients: int
    activations: int
    logits: int
    buffers: int  # one dequantized linear (4/8-bit) or one gathered layer (FSDP)
    kv_cache: int  # transformers generate(), when vLLM is not used

    @property
    def persistent(self) -> int:
        return self.weights + self.adapter + self.optimizer + self.reference + self.vllm

    @property
    def training_peak(self) -> int:
        return self.persistent + self.gradients + self.activations + self.logits + self.buffers

    @property
    def generation_peak(self) -> int:
        return self.persistent + self.kv_cache

    @property
    def total(self) -> int:
        return max(self.training_peak, self.generation_peak)

    def gib(self) -> dict[str, float]:
        parts = ("weights", "adapter", "optimizer", "reference", "vllm", "gradients", "activations", "logits",
                 "buffers", "kv_cache")
        out = {k: getattr(self, k) / GIB for k in parts}
        out.update(training_peak=self.training_peak / GIB, generation_peak=self.generation_peak / GIB,
                   total=self.total / GIB)
        return out


def estimate_memory(
    model_config: dict[str, Any],
    *,
    quantization: str = "none",
    double_quant: bool = False,
    dtype: str = "bfloat16",
    lora_rank: int = 16,
    lora_targets: str | list[str] | tuple[str, ...] | None = "all-linear",
    optimizer: str = "adamw_torch",
    gradient_checkpointing: bool = True,
    per_device_batch: int = 8,
    prompt_tokens: int = 256,
    completion_tokens: int = 512,
    generation_batch: int | None = None,
    beta: float = 0.0,
    vllm: bool = False,
    shards: int = 1,
) -> MemoryEstimate:
    """Peak memory per GPU of GRPO training with TRL, from a Hugging Face config.json dict.

    lora_rank=0 is full fine-tuning (no quantization allowed). per_device_batch counts sequences
    (completions) per micro-batch, each prompt_tokens + completion_tokens long. generation_batch is the
    number of sequences generated at once per GPU (TRL: per_device_batch x steps_per_generation; default
    per_device_batch). shards > 1 splits weights, adapter, gradients and optimizer over that many GPUs
    (FSDP / ZeRO-3); activations and the KV cache are per GPU either way.

    >>> cfg = load_model_config("llama-3.1-70b")[1]
    >>> q = estimate_memory(cfg, quantization="nf4", lora_rank=16)
    >>> round(q.weights / GIB, 1), q.total < estimate_memory(cfg, quantization="none", lora_rank=16).total
    (39.8, True)
    """
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {dtype!r} unknown; use float32, bfloat16 or float16")
    if quantization not in Quantization.__args__:
        raise PlanError(f"quantization {quantization!r} unknown; use none, nf4, fp4 or int8")
    if lora_rank < 0 or per_device_batch < 1 or shards < 1 or prompt_tokens < 0 or completion_tokens < 1:
        raise PlanError("lora_rank >= 0, per_device_batch >= 1, shards >= 1, completion_tokens >= 1 are required")
    if lora_rank == 0 and quantization != "none":
        raise PlanError("full fine-tuning (lora_rank=0) of a quantized base is not possible; use LoRA or quantization=none")
    arch = architecture(model_config)
    a = DTYPE_BYTES[dtype]
    quantized = quantization != "none"

    shapes = arch.linear_shapes()
    per_param = weight_bytes_per_param(quantization, double_quant, dtype)
    row_scales = arch.layers * sum(out for _, out in shapes.values()) * 4 if quantization == "int8" else 0
    weights = arch.linear_params * per_param + row_scales + arch.other_params * a

    targets = lora_modules(lora_targets) if lora_rank else ()
    if lora_rank:
        trainable = lora_params(arch, lora_rank, targets)
        # PEFT upcasts adapters to fp32; TRL casts them to bf16 on a quantized base (QLoRA paper's recipe).
        p_bytes = 2 if quantized else 4
        adapter = trainable * p_bytes
        reference = 0  # the reference policy is the base with the adapter disabled
    else:
        trainable = arch.params
        p_bytes = a
        adapter = 0
        reference = int(weights) if beta > 0 else 0
    gradients = trainable * p_bytes
    optimizer_b = trainable * _optimizer_bytes(optimizer, p_bytes)

    tokens = per_device_batch * (prompt_tokens + completion_tokens)
    per_layer = activation_bytes_per_token_layer(arch, a, lora_rank, len(targets))
    if gradient_checkpointing:
        # each layer's input is kept; one layer is recomputed at a time and its gradients live beside it
        activations = tokens * (arch.layers * a * arch.hidden + 2 * per_layer)
    else:
        activations = tokens * (arch.layers + 1) * per_layer
    scored = per_device_batch * completion_tokens
    logits = (min(scored, LOGIT_TILE_TOKENS) * min(arch.vocab, LOGIT_TILE_VOCAB) * (a + 4)
              + tokens * arch.hidden * (4 + a))  # a tile (compute dtype + fp32 stats/grad) + final norm

    biggest_linear = max(i * o for i, o in shapes.values())
    buffers = biggest_linear * a if quantized else 0
    if shards > 1:  # FSDP all-gathers one layer's weights at a time
        layer_weights = weights / arch.layers
        buffers = max(buffers, int(layer_weights))
        weights, adapter, gradients, optimizer_b = (x / shards for x in (weights, adapter, gradients, optimizer_b))
        reference = reference / shards

    gen_seqs = generation_batch or per_device_batch
    gen_kv = gen_seqs * (prompt_tokens + completion_tokens) * kv_bytes_per_token(arch, a)
    if vllm:
        vllm_weights = arch.linear_params * per_param + row_scales + arch.other_params * a
        vllm_b = vllm_weights + gen_kv + GIB  # + CUDA graphs, sampler and activation workspace
        kv_cache = 0
    else:
        vllm_b = 0
        kv_cache = gen_kv + gen_seqs * arch.vocab * 4  # + the last position's fp32 logits per step
    return MemoryEstimate(
        params=arch.params, trainable_params=trainable, weights=int(weights), adapter=int(adapter),
        optimizer=int(optimizer_b), reference=int(reference), vllm=int(vllm_b), gradients=int(gradients),
        activations=int(activations), logits=int(logits), buffers=int(buffers), kv_cache=int(kv_cache),
    )


# ---------------------------------------------------------------------------------------------- catalog


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
        raise PlanError(f"GPU {name!r} is not in the catalog; known: {', '.join(self.gpus)} (add it with plan.gpu_catalog)")


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
        return Catalog(as_of=str(data.get("as_of", "")), source=str(data.get("source", "")).strip(),
                       gpus={n: GPU(name=n, **f) for n, f in data["gpus"].items()})
    except (ValidationError, TypeError) as exc:
        raise PlanError(f"GPU catalog {override or CATALOG_FILE} is invalid: {exc}") from None


# ---------------------------------------------------------------------------------------------- planning


class Workload(Frozen):
    """What the run does; the planner chooses how (GPU, count, batch split, checkpointing)."""

    model: str
    quantization: Quantization = "none"
    double_quant: bool = False
    dtype: DType = "bfloat16"
    lora_rank: int = Field(16, ge=0, description="0 = full fine-tuning")
    lora_targets: str | tuple[str, ...] | None = "all-linear"
    optimizer: Optimizer = "adamw_torch"
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    prompt_tokens: int = Field(256, ge=0)
    completion_tokens: int = Field(512, ge=1)
    num_generations: int = Field(8, ge=2)
    effective_batch: int = Field(64, ge=1, description="completions per optimizer step, all GPUs together")
    max_steps: int | None = Field(500, ge=1, description="None: unknown (a local plan does not estimate time)")
    beta: float = Field(0.0, ge=0)
    vllm: bool = False


class Assumptions(Frozen):
    """The numbers the time and cost estimate rests on; shown with every plan."""

    mfu: float = Field(0.35, gt=0, le=1, description="model FLOPs utilisation of training and prefill")
    decode_efficiency_vllm: float = Field(0.6, gt=0, le=1, description="share of memory bandwidth vLLM decodes at")
    decode_efficiency_transformers: float = Field(
        0.15, gt=0, le=1, description="share of memory bandwidth transformers generate() decodes at (per-token Python overhead)")
    multi_gpu_efficiency: float = Field(0.9, gt=0, le=1, description="throughput kept per GPU when there are several")
    headroom_fraction: float = Field(0.95, gt=0, le=1, description="usable share of GPU memory (allocator fragmentation)")
    headroom_gib: float = Field(1.0, ge=0, description="CUDA context and library workspaces")
    setup_minutes: float = Field(15, ge=0, description="provisioning, install, model download, first step")
    preemption_overhead: float = Field(0.10, ge=0, description="extra spot GPU-time: lost steps since a checkpoint + restarts")
    days_per_month: float = 30
    max_gpus: int = Field(8, ge=1)
    max_micro_batch_tokens: int = Field(
        16384, ge=1, description="largest micro-batch tried: past ~16k tokens a GPU is saturated and more only adds memory")


class Settings(Frozen):
    gpu: str
    count: int
    strategy: Literal["single", "ddp", "fsdp", "local"]
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    gradient_checkpointing: bool
    bf16: bool
    vllm_gpu_memory_utilization: float | None = None

    def grpo_overrides(self) -> dict[str, Any]:
        """The `train.grpo` fields this plan sets (TRL GRPOConfig names)."""
        out = {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "steps_per_generation": self.steps_per_generation,
            "gradient_checkpointing": self.gradient_checkpointing,
            "bf16": self.bf16,
        }
        if self.vllm_gpu_memory_utilization is not None:
            out["vllm_gpu_memory_utilization"] = self.vllm_gpu_memory_utilization
        return out


class Estimate(Frozen):
    train_s_per_step: float | None
    generation_s_per_step: float | None
    hours: float | None
    gpu_hours: float
    on_demand_usd: float
    spot_usd: float  # includes the expected preemption overhead
    pricing: Literal["spot", "on-demand", "local"]
    usd_per_gpu_hour: float  # catalog price under the chosen pricing
    usd: float  # the estimate under the chosen pricing: what the budget guard compares
    monthly_usd: float | None  # daily retraining, chosen pricing
    monthly_on_demand_usd: float | None
    monthly_spot_usd: float | None


class Option(Frozen):
    gpu: str
    count: int | None
    fits: bool
    need_gib: float  # per GPU, at the chosen (or smallest) settings
    capacity_gib: float
    usd: float | None
    hours: float | None
    note: str = ""


class Plan(Frozen):
    model: str
    params: int
    workload: Workload
    memory: MemoryEstimate
    settings: Settings
    estimate: Estimate
    options: list[Option]
    assumptions: Assumptions
    catalog_as_of: str
    catalog_source: str
    notes: list[str] = []

    def report(self) -> dict[str, Any]:
        """Everything, JSON-ready, with the memory breakdown in GiB (what `grpo-pipeline plan --json` prints)."""
        return {**self.model_dump(mode="json"), "memory_gib": {k: round(v, 3) for k, v in self.memory.gib().items()}}

    def summary(self) -> dict[str, Any]:
        """Flat numbers for MLflow params/metrics."""
        return {
            "plan_gpu": self.settings.gpu, "plan_gpu_count": self.settings.count,
            "plan_memory_gib": round(self.memory.total / GIB, 2), "plan_hours": self.estimate.hours,
            "cost_usd_estimated": round(self.estimate.usd, 2), "plan_pricing": self.estimate.pricing,
            **{f"plan_{k}": v for k, v in self.settings.grpo_overrides().items()},
        }


def _divisors(n: int) -> list[int]:
    """Descending divisors.

    >>> _divisors(12)
    [12, 6, 4, 3, 2, 1]
    """
    return sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)


def _memory(model_config, work: Workload, *, ckpt: bool, pdb: int, gen: int, shards: int) -> MemoryEstimate:
    return estimate_memory(
        model_config, quantization=work.quantization, double_quant=work.double_quant, dtype=work.dtype,
        lora_rank=work.lora_rank, lora_targets=work.lora_targets, optimizer=work.optimizer,
        gradient_checkpointing=ckpt, per_device_batch=pdb, prompt_tokens=work.prompt_tokens,
        completion_tokens=work.completion_tokens, generation_batch=gen, beta=work.beta, vllm=work.vllm,
        shards=shards,
    )


def capacity_bytes(gpu: GPU, assumptions: Assumptions) -> float:
    return gpu.memory_gib * GIB * assumptions.headroom_fraction - assumptions.headroom_gib * GIB


def fit(model_config, work: Workload, gpu: GPU, count: int, assumptions: Assumptions):
    """The largest per-device batch (and its split) that fits `count` GPUs of this type, or None.

    Micro-batches are capped at `max_micro_batch_tokens` (at least one sequence).

    Returns (Settings, MemoryEstimate) or (None, the estimate at the smallest settings). Gradient
    checkpointing 'auto' leaves it off when a micro-batch of at least one prompt's group (num_generations,
    or the whole per-GPU share if smaller) fits without it: it costs ~1/3 more compute.
    """
    if work.effective_batch % work.num_generations:
        raise PlanError(f"the effective batch ({work.effective_batch}) must be a multiple of num_generations "
                        f"({work.num_generations}): GRPO normalises rewards within each prompt's group")
    if work.effective_batch % count:
        return None, None
    per_gpu = work.effective_batch // count
    cap = max(1, assumptions.max_micro_batch_tokens // (work.prompt_tokens + work.completion_tokens))
    capacity = capacity_bytes(gpu, assumptions)
    strategies = ["single"] if count == 1 else ["ddp", "fsdp"]
    ckpts = [False, True] if work.gradient_checkpointing == "auto" else [work.gradient_checkpointing]
    smallest = None
    for strategy in strategies:
        if strategy == "fsdp" and work.vllm:
            continue  # colocated vLLM needs the whole model on each GPU
        shards = count if strategy == "fsdp" else 1
        for ckpt in ckpts:
            floor = min(work.num_generations, per_gpu) if (work.gradient_checkpointing == "auto" and not ckpt) else 1
            for pdb in _divisors(per_gpu):
                if pdb > cap:
                    continue
                if pdb < floor:
                    break
                accum = per_gpu // pdb
                for spg in _divisors(accum):
                    if (pdb * count * spg) % work.num_generations:
                        continue
                    mem = _memory(model_config, work, ckpt=ckpt, pdb=pdb, gen=pdb * spg, shards=shards)
                    if smallest is None or mem.total < smallest.total:
                        smallest = mem
                    if mem.total <= capacity:
                        util = None
                        if work.vllm:
                            util = math.ceil(mem.vllm / (gpu.memory_gib * GIB) * 20) / 20
                        return Settings(
                            gpu=gpu.name, count=count, strategy=strategy, per_device_train_batch_size=pdb,
                            gradient_accumulation_steps=accum, steps_per_generation=spg,
                            gradient_checkpointing=ckpt, bf16=work.dtype == "bfloat16",
                            vllm_gpu_memory_utilization=util,
                        ), mem
    return None, smallest


def step_seconds(model_config, work: Workload, settings: Settings, gpu: GPU, assumptions: Assumptions) -> tuple[float, float]:
    """(training, generation) seconds per optimizer step.

    Training: FLOPs per token = forward 2N + input gradients 2N + weight gradients 2N (full fine-tuning
    only; LoRA's are negligible) + a recomputed forward 2N with checkpointing + the reference forward 2N
    when beta > 0; N = matmul parameters; at `mfu` of the GPU's dense bf16 peak. So LoRA is ~4N per
    token, ~6N with checkpointing; full fine-tuning 6N / 8N.
    Generation: prefill is compute-bound (2N per prompt token); each decoding step reads the weights and
    the KV cache once for the whole generation batch, at `decode_efficiency` of memory bandwidth, or is
    compute-bound (2N per sequence) when the batch is large, whichever is slower.
    """
    arch = architecture(model_config)
    n = arch.matmul_params
    full = work.lora_rank == 0
    per_token = n * (4 + (2 if full else 0) + (2 if settings.gradient_checkpointing else 0) + (2 if work.beta > 0 else 0))
    seqs = work.effective_batch // settings.count  # per GPU per optimizer step
    peak = gpu.bf16_tflops * 1e12 * assumptions.mfu
    scale = 1 / assumptions.multi_gpu_efficiency if settings.count > 1 else 1
    train = per_token * seqs * (work.prompt_tokens + work.completion_tokens) / peak * scale

    a = DTYPE_BYTES[work.dtype]
    weight_read = (arch.linear_params * weight_bytes_per_param(work.quantization, work.double_quant, work.dtype)
                   + arch.other_params * a)
    if settings.strategy == "fsdp":
        weight_read /= settings.count
    gen_batch = settings.per_device_train_batch_size * settings.steps_per_generation
    rounds = settings.gradient_accumulation_steps // settings.steps_per_generation
    eff = assumptions.decode_efficiency_vllm if work.vllm else assumptions.decode_efficiency_transformers
    bandwidth = gpu.bandwidth_tbs * 1e12 * eff
    kv_token = kv_bytes_per_token(arch, a)
    decode = 0.0
    for t in range(work.completion_tokens):
        read = weight_read + gen_batch * (work.prompt_tokens + t) * kv_token
        decode += max(read / bandwidth, 2 * n * gen_batch / peak)
    prefill = 2 * n * gen_batch * work.prompt_tokens / peak
    return train, rounds * (prefill + decode) * scale


def _costs(hours: float, count: int, gpu: GPU, spot: bool, assumptions: Assumptions) -> Estimate:
    gpu_hours = hours * count
    on_demand = gpu_hours * gpu.on_demand_usd_h
    spot_usd = gpu_hours * (1 + assumptions.preemption_overhead) * gpu.spot_usd_h
    usd = spot_usd if spot else on_demand
    days = assumptions.days_per_month
    return Estimate(
        train_s_per_step=None, generation_s_per_step=None, hours=hours, gpu_hours=gpu_hours,
        on_demand_usd=on_demand, spot_usd=spot_usd, pricing="spot" if spot else "on-demand",
        usd_per_gpu_hour=gpu.spot_usd_h if spot else gpu.on_demand_usd_h, usd=usd,
        monthly_usd=usd * days, monthly_on_demand_usd=on_demand * days, monthly_spot_usd=spot_usd * days,
    )


def make_plan(
    model_config: dict[str, Any],
    work: Workload,
    catalog: Catalog | None = None,
    *,
    allowed: list[str] | None = None,
    spot: bool = True,
    assumptions: Assumptions | None = None,
    daily: bool = True,
) -> Plan:
    """The cheapest GPU type and count (of `allowed`, default: the whole catalog) that fit, with settings,
    time and cost; every other option is listed with its cost or why it does not fit.

    >>> p = make_plan(load_model_config("qwen2.5-7b")[1], Workload(model="qwen2.5-7b", quantization="nf4"))
    >>> p.settings.count, p.estimate.usd > 0, len(p.options) == len(load_catalog().gpus)
    (1, True, True)
    """
    catalog = catalog or load_catalog()
    assumptions = assumptions or Assumptions()
    if work.max_steps is None:
        raise PlanError("the planner needs a step count: set train.grpo.max_steps (or plan after the data stage)")
    gpus = [catalog.get(name) for name in allowed] if allowed else list(catalog.gpus.values())
    arch = architecture(model_config)
    counts = [c for c in (1, 2, 4, 8, 16) if c <= assumptions.max_gpus]
    best = None
    options = []
    for gpu in gpus:
        option = None
        smallest = None
        for count in counts:
            settings, mem = fit(model_config, work, gpu, count, assumptions)
            if mem is not None and (smallest is None or mem.total < smallest.total):
                smallest = mem
            if settings is None:
                continue
            train, gen = step_seconds(model_config, work, settings, gpu, assumptions)
            hours = work.max_steps * (train + gen) / 3600 + assumptions.setup_minutes / 60
            est = _costs(hours, count, gpu, spot, assumptions).model_copy(
                update={"train_s_per_step": train, "generation_s_per_step": gen})
            if not daily:
                est = est.model_copy(update={"monthly_usd": None, "monthly_on_demand_usd": None, "monthly_spot_usd": None})
            candidate = (est.usd, hours, settings, mem, est)
            if option is None or candidate[:2] < option[:2]:
                option = candidate
        cap = capacity_bytes(gpu, assumptions) / GIB
        if option is None:
            need = smallest.total / GIB if smallest else float("nan")
            options.append(Option(gpu=gpu.name, count=None, fits=False, need_gib=need, capacity_gib=cap, usd=None,
                                  hours=None, note=f"needs {need:.1f} GiB per GPU at the smallest settings"))
            continue
        usd, hours, settings, mem, est = option
        options.append(Option(gpu=gpu.name, count=settings.count, fits=True, need_gib=mem.total / GIB,
                              capacity_gib=cap, usd=usd, hours=hours, note=settings.strategy))
        if best is None or (usd, hours) < (best[0], best[1]):
            best = option
    if best is None:
        need = min(o.need_gib for o in options)
        raise PlanError(
            f"{work.model} does not fit any allowed GPU ({', '.join(g.name for g in gpus)}, up to "
            f"{assumptions.max_gpus} per node): it needs at least {need:.1f} GiB per GPU. Quantize the base "
            f"(model.quantization=nf4), lower the LoRA rank or completion length, enable gradient checkpointing, "
            f"or allow larger GPUs (plan.allowed_gpus)"
        )
    _, _, settings, mem, est = best
    notes = [f"time assumes MFU {assumptions.mfu:.0%} and decoding at "
             f"{(assumptions.decode_efficiency_vllm if work.vllm else assumptions.decode_efficiency_transformers):.0%}"
             f" of memory bandwidth ({'vLLM' if work.vllm else 'transformers generate()'}); unvalidated on GPUs"]
    return Plan(model=work.model, params=arch.params, workload=work, memory=mem, settings=settings, estimate=est,
                options=options, assumptions=assumptions, catalog_as_of=catalog.as_of,
                catalog_source=catalog.source, notes=notes)


def local_ram_bytes() -> int:
    """Physical memory of this machine (Linux/macOS sysconf)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def plan_local(model_config: dict[str, Any], work: Workload, *, per_device_batch: int, gradient_accumulation: int,
               gradient_checkpointing: bool, daily: bool = True) -> Plan:
    """A run on this machine's CPU: memory of the configured settings against its RAM, and no rental cost.

    Time is not estimated: CPU throughput is not in the catalog and would be a guess.

    >>> p = plan_local(load_model_config("smollm2-135m")[1], Workload(model="smollm2-135m", dtype="float32",
    ...                effective_batch=16), per_device_batch=16, gradient_accumulation=1, gradient_checkpointing=False)
    >>> p.settings.gpu, p.estimate.usd, p.estimate.hours
    ('local-cpu', 0.0, None)
    """
    arch = architecture(model_config)
    mem = _memory(model_config, work, ckpt=gradient_checkpointing, pdb=per_device_batch,
                  gen=per_device_batch * gradient_accumulation, shards=1)
    ram = local_ram_bytes()
    settings = Settings(gpu="local-cpu", count=1, strategy="local", per_device_train_batch_size=per_device_batch,
                        gradient_accumulation_steps=gradient_accumulation, steps_per_generation=gradient_accumulation,
                        gradient_checkpointing=gradient_checkpointing, bf16=False)
    zero = 0.0 if daily else None
    est = Estimate(train_s_per_step=None, generation_s_per_step=None, hours=None, gpu_hours=0.0, on_demand_usd=0.0,
                   spot_usd=0.0, pricing="local", usd_per_gpu_hour=0.0, usd=0.0, monthly_usd=zero, monthly_on_demand_usd=zero,
                   monthly_spot_usd=zero)
    fits = not ram or mem.total <= ram
    option = Option(gpu="local-cpu", count=1, fits=fits, need_gib=mem.total / GIB, capacity_gib=ram / GIB,
                    usd=0.0, hours=None, note="this machine's RAM")
    notes = ["train.launcher=local: runs on this machine, no GPU rented, cost 0 USD; time not estimated"]
    if not fits:
        notes.append(f"needs {mem.total / GIB:.1f} GiB but this machine has {ram / GIB:.1f} GiB of RAM")
    return Plan(model=work.model, params=arch.params, workload=work, memory=mem, settings=settings, estimate=est,
                options=[option], assumptions=Assumptions(), catalog_as_of="", catalog_source="", notes=notes)


# ---------------------------------------------------------------------------------------------- guards


def check_budget(plan: Plan, budget_usd: float | None) -> None:
    """Refuse a run whose estimated cost is above the budget (None = no limit), before anything launches.

    >>> p = make_plan(load_model_config("qwen2.5-0.5b")[1], Workload(model="qwen2.5-0.5b", max_steps=10))
    >>> check_budget(p, None); check_budget(p, 1e6)
    >>> check_budget(p, 0.01)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tasks.plan.BudgetExceeded: estimated cost ... exceeds plan.budget_usd = $0.01...
    """
    if budget_usd is None or plan.estimate.usd <= budget_usd:
        return
    s, e = plan.settings, plan.estimate
    raise BudgetExceeded(
        f"estimated cost ${e.usd:,.2f} ({e.pricing}, {s.count}x {s.gpu}, {e.hours:.2f} h for "
        f"{plan.workload.max_steps} steps"
        + (f", incl. {plan.assumptions.preemption_overhead:.0%} expected preemption overhead" if e.pricing == "spot" else "")
        + f") exceeds plan.budget_usd = ${budget_usd:,.2f}; lower train.grpo.max_steps or the completion length, "
        f"quantize the base, use spot GPUs, or raise plan.budget_usd"
    )


def actual_cost(gpu_hours: float | None, plan: Plan) -> float:
    """What the launched job cost: GPU-hours (summed across preemptions and restarts, so lost work is
    already in them) x the plan's price per GPU-hour; 0 for a local run.

    >>> p = make_plan(load_model_config("qwen2.5-0.5b")[1], Workload(model="qwen2.5-0.5b", max_steps=10),
    ...               allowed=["L4"], spot=False)
    >>> actual_cost(2.0, p)
    1.61
    """
    if not gpu_hours or plan.estimate.pricing == "local":
        return 0.0
    return round(gpu_hours * plan.estimate.usd_per_gpu_hour, 6)


# ---------------------------------------------------------------------------------------------- pipeline


def model_config_for(base: str, model_path: str | None = None) -> tuple[str, dict[str, Any]]:
    """The config.json of the resolved model directory when there is one, else a known id's shipped config.

    >>> model_config_for("smollm2-135m-instruct")[0]
    'smollm2-135m'
    """
    if model_path and (Path(model_path) / "config.json").is_file():
        name = base if not Path(base).expanduser().exists() else Path(base).name
        return name, json.loads((Path(model_path) / "config.json").read_text())
    return load_model_config(base)


def sky_accelerators(task_yaml: Path) -> list[str]:
    """GPU names a SkyPilot task YAML asks for (resources.accelerators or resources.ordered/any_of).

    >>> sky_accelerators(ROOT / "sky" / "train.yaml")
    ['H100', 'A100-80GB', 'L40S']
    """
    try:
        resources = (yaml.safe_load(Path(task_yaml).read_text()) or {}).get("resources") or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"cannot read {task_yaml} for its GPU list ({exc}); set plan.allowed_gpus") from None
    entries = resources.get("ordered") or resources.get("any_of") or [resources]
    names: list[str] = []
    for entry in entries:
        acc = entry.get("accelerators")
        for item in acc if isinstance(acc, (list, dict)) else [acc] if acc else []:
            names.append(str(item).split(":")[0])
    return list(dict.fromkeys(names))


def workload_for(cfg, name: str, train_rows: int | None = None) -> Workload:
    """The run described by a PipelineConfig: model precision, LoRA, GRPO lengths and batch, steps
    (max_steps, else epochs x train_rows / prompts per step, else None: unknown)."""
    grpo, lora = cfg.train.grpo, cfg.train.lora
    generations = grpo.get("num_generations", 8)
    effective = cfg.plan.target_effective_batch or (
        grpo.get("per_device_train_batch_size", 8) * grpo.get("gradient_accumulation_steps", 1))
    steps = grpo.get("max_steps", -1)
    if steps is None or steps <= 0:
        steps = None if not train_rows else math.ceil(grpo.get("num_train_epochs", 3) * train_rows / (effective / generations))
    optimizer = cfg.plan.optimizer or grpo.get("optim", "adamw_torch_fused")
    if optimizer not in Optimizer.__args__:
        raise PlanError(f"optimizer {optimizer!r} (train.grpo.optim) is unknown to the planner; set plan.optimizer "
                        f"to one of {list(Optimizer.__args__)}")
    targets = lora.get("target_modules")
    try:
        return Workload(
            model=name, quantization=cfg.model.quantization, double_quant=cfg.model.double_quant,
            dtype=cfg.model.compute_dtype, lora_rank=lora.get("r", 8),
            lora_targets=tuple(targets) if isinstance(targets, list) else targets, optimizer=optimizer,
            gradient_checkpointing=cfg.plan.gradient_checkpointing, prompt_tokens=cfg.plan.prompt_tokens,
            completion_tokens=grpo.get("max_completion_length", 512), num_generations=generations,
            effective_batch=effective, max_steps=steps, beta=grpo.get("beta", 0.0), vllm=grpo.get("use_vllm", False),
        )
    except ValidationError as exc:
        raise PlanError(f"cannot plan this configuration: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


def plan_for_config(cfg, model_config: dict[str, Any], name: str, train_rows: int | None = None) -> Plan:
    """The plan for a PipelineConfig. train.launcher=local: this machine, memory against its RAM, 0 USD.
    train.launcher=sky: the cheapest of plan.allowed_gpus (default: the SkyPilot task's GPU list).

    >>> from configs.schema import load_config
    >>> cfg = load_config(ROOT / "configs" / "qwen2.5-7b-qlora.yaml", ["train.launcher=sky"])
    >>> p = plan_for_config(cfg, load_model_config(cfg.model.base)[1], "qwen2.5-7b")
    >>> p.settings.gpu in ("H100", "A100-80GB", "L40S"), p.estimate.pricing
    (True, 'spot')
    """
    work = workload_for(cfg, name, train_rows)
    if cfg.train.launcher == "local":
        grpo = cfg.train.grpo
        pdb = grpo.get("per_device_train_batch_size", 8)
        return plan_local(model_config, work, per_device_batch=pdb,
                          gradient_accumulation=max(1, work.effective_batch // pdb),
                          gradient_checkpointing=grpo.get("gradient_checkpointing", True),
                          daily=cfg.plan.daily_projection)
    allowed = cfg.plan.allowed_gpus or (
        [a.split(":")[0] for a in cfg.train.sky.accelerators] if cfg.train.sky.accelerators
        else sky_accelerators(ROOT / cfg.train.sky.task_yaml))
    spot = cfg.train.sky.use_spot if cfg.plan.spot is None else cfg.plan.spot
    assumptions = Assumptions(mfu=cfg.plan.mfu, preemption_overhead=cfg.plan.preemption_overhead)
    plan = make_plan(model_config, work, load_catalog(cfg.plan.gpu_catalog), allowed=allowed or None, spot=spot,
                     assumptions=assumptions, daily=cfg.plan.daily_projection)
    notes = list(plan.notes)
    if work.dtype == "float32":
        notes.append("model.compute_dtype=float32 keeps fp32 weights on the GPU (2x bf16); bfloat16 is usual there")
    if work.vllm and cfg.train.grpo.get("vllm_mode", "colocate") == "server":
        notes.append("vllm_mode=server generates on separate GPU(s) that this plan neither sizes nor prices")
    return plan.model_copy(update={"notes": notes})


def apply_plan(cfg, plan: Plan):
    """The config a SkyPilot run trains with: the plan's batch split, checkpointing and bf16 for every
    `train.grpo` field the user left unset, and, unless `train.sky.accelerators` is set, the GPU options
    that fit, cheapest first (SkyPilot takes the first one it can get). A local run is left as it is.

    >>> from configs.schema import load_config
    >>> cfg = load_config(ROOT / "configs" / "qwen2.5-7b-qlora.yaml", ["train.launcher=sky"])
    >>> plan = plan_for_config(cfg, load_model_config(cfg.model.base)[1], "qwen2.5-7b")
    >>> planned = apply_plan(cfg, plan)
    >>> planned.train.sky.accelerators[0] == f"{plan.settings.gpu}:{plan.settings.count}"
    True
    >>> planned.train.grpo["steps_per_generation"] == plan.settings.steps_per_generation  # unset: planned
    True
    >>> planned.train.grpo["gradient_checkpointing"]  # set in the recipe: kept
    True
    """
    if cfg.train.launcher != "sky":
        return cfg
    grpo = {**plan.settings.grpo_overrides(), **cfg.train.grpo}
    sky = cfg.train.sky
    if sky.accelerators is None:
        fitting = sorted((o for o in plan.options if o.fits and o.usd is not None), key=lambda o: o.usd)
        sky = sky.model_copy(update={"accelerators": [f"{o.gpu}:{o.count}" for o in fitting]})
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"grpo": grpo, "sky": sky})})


def plan_stage(cfg, model_path: str | None = None, train_rows: int | None = None) -> Plan:
    """The pipeline's plan stage: the model's own config.json when resolved, else the shipped one."""
    name, model_config = model_config_for(cfg.model.base, model_path)
    return plan_for_config(cfg, model_config, name, train_rows)


def __getattr__(name: str):
    # Prefect takes ~2 s to import and `grpo-pipeline plan` must answer faster, so the Prefect task is
    # built on first use (`from tasks.plan import plan_task`), not at import.
    if name == "plan_task":
        from prefect import task

        globals()["plan_task"] = task(plan_stage, name="plan")
        return globals()["plan_task"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plan_tables(plan: Plan) -> list:
    """Rich tables for a terminal: memory breakdown, chosen settings with time and cost, every GPU option."""
    from rich.table import Table

    gib = plan.memory.gib()
    memory = Table(title=f"{plan.model}: {plan.params / 1e9:.2f} B parameters, {plan.memory.trainable_params / 1e6:,.1f} M trainable")
    memory.add_column("memory per GPU")
    memory.add_column("GiB", justify="right")
    for key in ("weights", "adapter", "optimizer", "reference", "vllm", "gradients", "activations", "logits",
                "buffers", "kv_cache"):
        if gib[key]:
            memory.add_row(key.replace("_", " "), f"{gib[key]:.2f}")
    memory.add_row("peak while training", f"{gib['training_peak']:.2f}")
    memory.add_row("peak while generating", f"{gib['generation_peak']:.2f}")
    memory.add_row("[bold]peak", f"[bold]{gib['total']:.2f}")

    s, e, w = plan.settings, plan.estimate, plan.workload
    chosen = Table(title="plan", show_header=False)
    chosen.add_column()
    chosen.add_column()
    chosen.add_row("GPU", f"{s.count}x {s.gpu} ({s.strategy})")
    chosen.add_row("batch", f"{s.per_device_train_batch_size} per device x {s.gradient_accumulation_steps} accumulation "
                   f"x {s.count} GPU = {w.effective_batch} completions/step ({w.num_generations} per prompt); "
                   f"steps_per_generation {s.steps_per_generation}")
    chosen.add_row("precision", f"{w.quantization} base{' + double quant' if w.double_quant else ''}, {w.dtype}, "
                   f"gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}, bf16 {s.bf16}")
    if s.vllm_gpu_memory_utilization is not None:
        chosen.add_row("vLLM", f"colocated, vllm_gpu_memory_utilization {s.vllm_gpu_memory_utilization}")
    if e.hours is not None:
        chosen.add_row("time", f"{e.hours:.2f} h for {w.max_steps} steps ({e.train_s_per_step:.1f} s training + "
                       f"{e.generation_s_per_step:.1f} s generation per step, + setup)")
    chosen.add_row("cost", f"${e.usd:,.2f} {e.pricing}" + (
        f" (on-demand ${e.on_demand_usd:,.2f}; spot ${e.spot_usd:,.2f} incl. "
        f"{plan.assumptions.preemption_overhead:.0%} preemption overhead)" if e.pricing != "local" else " (this machine)"))
    if e.monthly_usd is not None and e.pricing != "local":
        chosen.add_row("daily retraining", f"${e.monthly_usd:,.0f}/month ({e.pricing}); on-demand ${e.monthly_on_demand_usd:,.0f}")
    for note in plan.notes:
        chosen.add_row("note", note)
    if plan.catalog_as_of:
        chosen.add_row("prices", f"catalog as of {plan.catalog_as_of}")

    options = Table(title="options (cheapest count of each GPU)")
    for col in ("GPU", "count", "need GiB", "usable GiB", "hours", "USD"):
        options.add_column(col, justify="left" if col == "GPU" else "right")
    for o in sorted(plan.options, key=lambda o: (not o.fits, o.usd or 0)):
        options.add_row(o.gpu, str(o.count or "-"), f"{o.need_gib:.1f}", f"{o.capacity_gib:.1f}",
                        f"{o.hours:.2f}" if o.hours is not None else "-",
                        f"{o.usd:,.2f}" if o.usd is not None else "does not fit")
    return [memory, chosen, options]
