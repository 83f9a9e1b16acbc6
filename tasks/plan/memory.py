"""The memory model: peak GPU memory of GRPO training with TRL, by component, for a workload on a model.

    >>> from grpo_pipeline.tasks.plan.architecture import load_model_config
    >>> est = estimate_memory(load_model_config("qwen2.5-7b")[1], Workload(model="qwen2.5-7b", lora_rank=16),
    ...                       per_device_batch=8, gradient_checkpointing=True)
    >>> round(est.gib()["weights"], 1), round(est.gib()["total"], 1)
    (14.2, 19.4)

Units: bytes inside, GiB (2**30) when shown. Every formula below is an estimate built from how TRL 1.16,
PEFT and bitsandbytes allocate memory; docs/planning.md says what has been checked against a GPU.
"""

from __future__ import annotations

from typing import Any, get_args

from grpo_pipeline.tasks.plan.architecture import Architecture, architecture, lora_modules, lora_params
from grpo_pipeline.tasks.plan.base import GIB, Frozen, PlanError
from grpo_pipeline.tasks.plan.workload import DTYPE_BYTES, Optimizer, Workload, trl_default

# TRL >= 1.x scores completions through a fused, tiled LM head (trl.kernels.chunked_logprob): the
# (tokens x vocab) logits are never whole, only tiles of 4096 tokens x 32768 vocabulary entries.
LOGIT_TILE_TOKENS, LOGIT_TILE_VOCAB = 4096, 32768


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
    raise PlanError(f"optimizer {optimizer!r} unknown to the planner; use one of {list(get_args(Optimizer))}")


def activation_bytes_per_token_layer(arch: Architecture, act_bytes: int, rank: int, n_targets: int) -> int:
    """What one decoder layer keeps for backward, per token, without checkpointing (HF Llama/Qwen2 code,
    SDPA attention, no dropout): two RMSNorm inputs upcast to fp32 (2 x 4H), two normed inputs (2H),
    q and the repeated k, v plus the attention output (4 q_dim; GQA heads are expanded before SDPA),
    the MLP's gate, up, SiLU(gate) and product (4I), and each LoRA A output (rank)."""
    return (
        8 * arch.hidden
        + act_bytes * (2 * arch.hidden + 4 * arch.q_dim + 4 * arch.intermediate)
        + act_bytes * rank * n_targets
    )


def kv_bytes_per_token(arch: Architecture, act_bytes: int) -> int:
    """K and V of every layer for one token.

    >>> from grpo_pipeline.tasks.plan.architecture import load_model_config
    >>> kv_bytes_per_token(architecture(load_model_config("llama-3.1-70b")[1]), 2)
    327680
    """
    return 2 * arch.layers * arch.kv_dim * act_bytes


# MemoryEstimate's components, in the order a breakdown lists them (`MemoryEstimate.gib`, the plan's table)
COMPONENTS = (
    "weights",
    "adapter",
    "optimizer",
    "reference",
    "vllm",
    "gradients",
    "activations",
    "logits",
    "buffers",
    "kv_cache",
)


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
        """Each component (`COMPONENTS`, in order), then the two phases' peaks and the total, in GiB."""
        out = {k: getattr(self, k) / GIB for k in COMPONENTS}
        out.update(
            training_peak=self.training_peak / GIB, generation_peak=self.generation_peak / GIB, total=self.total / GIB
        )
        return out


def estimate_memory(
    model_config: dict[str, Any],
    work: Workload,
    *,
    per_device_batch: int = trl_default("per_device_train_batch_size"),
    gradient_checkpointing: bool | None = None,
    generation_batch: int | None = None,
    shards: int = 1,
    vllm_server: bool = False,
) -> MemoryEstimate:
    """Peak memory per GPU of `work` trained with TRL, from a Hugging Face config.json dict, at one layout.

    The layout is what the search (`fit`) chooses: per_device_batch counts sequences (completions) per
    micro-batch, each prompt_tokens + completion_tokens long; gradient_checkpointing is on or off (None:
    the workload's, and TRL's default when the workload leaves it to the planner, 'auto');
    generation_batch is the number of sequences generated at once per GPU (TRL: per_device_batch x
    steps_per_generation; default per_device_batch); shards > 1 splits weights, adapter, gradients and
    optimizer over that many GPUs (FSDP / ZeRO-3); activations and the KV cache are per GPU either way.
    vllm_server: generation runs in `trl vllm-serve` on GPUs of its own (TRL's vllm_mode=server), so a training
    GPU holds neither a vLLM share nor a KV cache (the server is sized by `estimate_vllm_server`).
    lora_rank=0 is full fine-tuning (no quantization allowed).

    >>> from grpo_pipeline.tasks.plan.architecture import load_model_config
    >>> cfg = load_model_config("llama-3.1-70b")[1]
    >>> q = estimate_memory(cfg, Workload(model="llama-3.1-70b", quantization="nf4"))
    >>> round(q.weights / GIB, 1), q.total < estimate_memory(cfg, Workload(model="llama-3.1-70b")).total
    (39.8, True)
    """
    if gradient_checkpointing is None:
        auto = work.gradient_checkpointing == "auto"
        gradient_checkpointing = trl_default("gradient_checkpointing") if auto else work.gradient_checkpointing is True
    if per_device_batch < 1 or shards < 1:
        raise PlanError("per_device_batch >= 1 and shards >= 1 are required")
    if work.lora_rank == 0 and work.quantization != "none":
        raise PlanError(
            "full fine-tuning (lora_rank=0) of a quantized base is not possible; use LoRA or quantization=none"
        )
    arch = architecture(model_config)
    a = DTYPE_BYTES[work.dtype]
    quantized = work.quantization != "none"
    lora_rank, prompt_tokens, completion_tokens = work.lora_rank, work.prompt_tokens, work.completion_tokens

    shapes = arch.linear_shapes()
    per_param = weight_bytes_per_param(work.quantization, work.double_quant, work.dtype)
    row_scales = arch.layers * sum(out for _, out in shapes.values()) * 4 if work.quantization == "int8" else 0
    weights = arch.linear_params * per_param + row_scales + arch.other_params * a

    targets = lora_modules(work.lora_targets) if lora_rank else ()
    adapter: float  # bytes; a share of them once sharded
    reference: float
    if lora_rank:
        trainable = lora_params(arch, lora_rank, targets)
        # fp32 on every base: PEFT upcasts adapters, and on a quantized base, where TRL casts them to bf16,
        # the trainer puts them back (trainer/loading.keep_adapter_fp32: bf16 rounded Adam's updates away).
        p_bytes = 4
        adapter = trainable * p_bytes
        reference = 0  # the reference policy is the base with the adapter disabled
    else:
        trainable = arch.params
        p_bytes = a
        adapter = 0
        reference = int(weights) if work.beta > 0 else 0
    gradients: float = trainable * p_bytes
    optimizer_b: float = trainable * _optimizer_bytes(work.optimizer, p_bytes)

    tokens = per_device_batch * (prompt_tokens + completion_tokens)
    per_layer = activation_bytes_per_token_layer(arch, a, lora_rank, len(targets))
    if gradient_checkpointing:
        # each layer's input is kept; one layer is recomputed at a time and its gradients live beside it
        activations = tokens * (arch.layers * a * arch.hidden + 2 * per_layer)
    else:
        activations = tokens * (arch.layers + 1) * per_layer
    scored = per_device_batch * completion_tokens
    logits = min(scored, LOGIT_TILE_TOKENS) * min(arch.vocab, LOGIT_TILE_VOCAB) * (a + 4) + tokens * arch.hidden * (
        4 + a
    )  # a tile (compute dtype + fp32 stats/grad) + final norm

    biggest_linear = max(i * o for i, o in shapes.values())
    buffers = biggest_linear * a if quantized else 0
    if shards > 1:  # FSDP all-gathers one layer's weights at a time
        layer_weights = weights / arch.layers
        buffers = max(buffers, int(layer_weights))
        weights, adapter, gradients, optimizer_b = (x / shards for x in (weights, adapter, gradients, optimizer_b))
        reference = reference / shards

    gen_seqs = generation_batch or per_device_batch
    gen_kv = gen_seqs * (prompt_tokens + completion_tokens) * kv_bytes_per_token(arch, a)
    vllm_b: float
    kv_cache: float
    if work.vllm and vllm_server:
        vllm_b = kv_cache = 0  # the server's GPUs generate; the trainers only send prompts and receive tokens
    elif work.vllm:
        vllm_weights = arch.linear_params * per_param + row_scales + arch.other_params * a
        vllm_b = vllm_weights + gen_kv + GIB  # + CUDA graphs, sampler and activation workspace
        kv_cache = 0
    else:
        vllm_b = 0
        kv_cache = gen_kv + gen_seqs * arch.vocab * 4  # + the last position's fp32 logits per step
    return MemoryEstimate(
        params=arch.params,
        trainable_params=trainable,
        weights=int(weights),
        adapter=int(adapter),
        optimizer=int(optimizer_b),
        reference=int(reference),
        vllm=int(vllm_b),
        gradients=int(gradients),
        activations=int(activations),
        logits=int(logits),
        buffers=int(buffers),
        kv_cache=int(kv_cache),
    )


# `trl vllm-serve` (as trainer/launch.py starts it, without --gpu-memory-utilization) takes this share of
# each of its GPUs for weights, KV cache and workspace: its default.
SERVER_MEMORY_UTILIZATION = 0.9


class ServerMemory(Frozen):
    """Memory per GPU of the vLLM server of vllm_mode=server, in bytes, tensor-parallel over `tensor_parallel` GPUs."""

    tensor_parallel: int
    weights: int
    kv_cache: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead


def estimate_vllm_server(
    model_config: dict[str, Any], work: Workload, *, sequences: int, tensor_parallel: int
) -> ServerMemory:
    """Per-GPU memory of `trl vllm-serve` holding `sequences` sequences of prompt + completion at once.

    The server loads the checkpoint itself, in bf16 and unquantized (trainer/launch.py passes no quantization:
    a bitsandbytes training base does not shrink it), split over the tensor-parallel GPUs; its KV cache holds
    the whole job's generation batch, since TRL's main process sends every rank's prompts in one request.
    KV heads fewer than the tensor-parallel size are replicated, as vLLM does.

    >>> from grpo_pipeline.tasks.plan.architecture import load_model_config
    >>> cfg = load_model_config("llama-3.1-70b")[1]
    >>> s = estimate_vllm_server(cfg, Workload(model="m", vllm=True), sequences=64, tensor_parallel=4)
    >>> round(s.weights / GIB, 1)  # 70.6 B parameters x 2 bytes / 4 GPUs
    32.9
    """
    arch = architecture(model_config)
    if arch.heads % tensor_parallel:
        raise PlanError(
            f"vLLM's tensor-parallel size must divide the attention heads: {tensor_parallel} does not "
            f"divide {arch.heads}"
        )
    weights = arch.params * 2 / tensor_parallel
    kv: float = sequences * (work.prompt_tokens + work.completion_tokens) * kv_bytes_per_token(arch, 2)
    kv /= min(tensor_parallel, arch.kv_heads)
    return ServerMemory(tensor_parallel=tensor_parallel, weights=int(weights), kv_cache=int(kv), overhead=GIB)
