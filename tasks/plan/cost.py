"""Time and money: seconds per optimizer step of a setting on a GPU type (`step_seconds`), and what its hours
cost, on demand and on spot (`costs`)."""

from __future__ import annotations

from typing import Any

from grpo_pipeline.tasks.plan.architecture import architecture
from grpo_pipeline.tasks.plan.catalogue import GPU
from grpo_pipeline.tasks.plan.memory import kv_bytes_per_token, weight_bytes_per_param
from grpo_pipeline.tasks.plan.values import Assumptions, Estimate, Settings
from grpo_pipeline.tasks.plan.workload import DTYPE_BYTES, Workload


def step_seconds(
    model_config: dict[str, Any], work: Workload, settings: Settings, gpu: GPU, assumptions: Assumptions
) -> tuple[float, float]:
    """(training, generation) seconds per optimizer step.

    Training: FLOPs per token = forward 2N + input gradients 2N + weight gradients 2N (full fine-tuning
    only; LoRA's are negligible) + a recomputed forward 2N with checkpointing + the reference forward 2N
    when beta > 0; N = matmul parameters; at `mfu` of the GPU's dense bf16 peak. So LoRA is ~4N per
    token, ~6N with checkpointing; full fine-tuning 6N / 8N.
    Generation: prefill is compute-bound (2N per prompt token); each decoding step reads the weights and
    the KV cache once for the whole generation batch, at `decode_efficiency` of memory bandwidth, or is
    compute-bound (2N per sequence) when the batch is large, whichever is slower. With a vLLM server the
    whole job's generation batch decodes there, tensor-parallel (each of its GPUs reads 1/tp of the weights and
    KV cache), and TRL then pushes the merged bf16 weights to it once per optimizer step (`weight_sync_gbs`);
    trainers and server take turns, so the times add.
    """
    arch = architecture(model_config)
    n = arch.matmul_params
    full = work.lora_rank == 0
    per_token = n * (
        4 + (2 if full else 0) + (2 if settings.gradient_checkpointing else 0) + (2 if work.beta > 0 else 0)
    )
    world = settings.world_size
    seqs = work.effective_batch // world  # per training GPU per optimizer step
    peak = gpu.bf16_tflops * 1e12 * assumptions.mfu
    scale = 1 / assumptions.multi_gpu_efficiency if world > 1 else 1
    train = per_token * seqs * (work.prompt_tokens + work.completion_tokens) / peak * scale

    a = DTYPE_BYTES[work.dtype]
    weight_read = (
        arch.linear_params * weight_bytes_per_param(work.quantization, work.double_quant, work.dtype)
        + arch.other_params * a
    )
    gen_batch = settings.per_device_train_batch_size * settings.steps_per_generation
    tp = settings.vllm_tensor_parallel
    sync = 0.0
    if tp:  # the server: bf16 weights and the whole job's batch, split over its tp GPUs
        weight_read = arch.params * 2 / tp
        gen_batch *= world
        kv_token = kv_bytes_per_token(arch, 2) / min(tp, arch.kv_heads)
        gen_peak = peak * tp
        gen_scale = 1 / assumptions.multi_gpu_efficiency if tp > 1 else 1
        sync = arch.params * 2 / (assumptions.weight_sync_gbs * 1e9)
    else:
        if settings.strategy in ("fsdp", "zero3"):
            weight_read /= world
        kv_token = kv_bytes_per_token(arch, a)
        gen_peak, gen_scale = peak, scale
    rounds = settings.gradient_accumulation_steps // settings.steps_per_generation
    eff = assumptions.decode_efficiency_vllm if work.vllm else assumptions.decode_efficiency_transformers
    bandwidth = gpu.bandwidth_tbs * 1e12 * eff
    decode = 0.0
    for t in range(work.completion_tokens):
        read = weight_read + gen_batch * (work.prompt_tokens + t) * kv_token
        decode += max(read / bandwidth, 2 * n * gen_batch / gen_peak)
    prefill = 2 * n * gen_batch * work.prompt_tokens / gen_peak
    return train, rounds * (prefill + decode) * gen_scale + sync


def costs(hours: float, count: int, gpu: GPU, spot: bool, assumptions: Assumptions) -> Estimate:
    """What `hours` on `count` GPUs of this type cost: on demand, on spot (with the expected preemption overhead),
    under the chosen pricing, and a month of daily runs of each; the step times are the caller's to fill in."""
    gpu_hours = hours * count
    on_demand = gpu_hours * gpu.on_demand_usd_h
    spot_usd = gpu_hours * (1 + assumptions.preemption_overhead) * gpu.spot_usd_h
    usd = spot_usd if spot else on_demand
    days = assumptions.days_per_month
    return Estimate(
        train_s_per_step=None,
        generation_s_per_step=None,
        hours=hours,
        gpu_hours=gpu_hours,
        on_demand_usd=on_demand,
        spot_usd=spot_usd,
        pricing="spot" if spot else "on-demand",
        usd_per_gpu_hour=gpu.spot_usd_h if spot else gpu.on_demand_usd_h,
        usd=usd,
        monthly_usd=usd * days,
        monthly_on_demand_usd=on_demand * days,
        monthly_spot_usd=spot_usd * days,
    )
