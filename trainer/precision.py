"""Which precision a job computes in: bfloat16 mixed precision where the hardware runs it fast, float32 elsewhere.

On a GPU that supports it, bf16 is the norm. On a CPU it depends on the instruction set, and the difference is
large both ways. Measured with one torch process multiplying 1024x576 by 576x1536 (the demo model's shapes):
- a CPU with AVX512-BF16 (AMD EPYC Genoa): 363 GFLOP/s in bfloat16 against 74 in float32 (4.9x faster);
- a CPU without it (AMD EPYC Milan, AVX2 only): 0.8 GFLOP/s in bfloat16 against 42 in float32 (50x slower:
  oneDNN has no bf16 kernel there and torch falls back to a scalar loop).
So bf16 is chosen from the CPU's own flags at run time, on the node that trains, and asking for it on a CPU
without native support is refused rather than left to run 50x slower.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from pathlib import Path

# x86 flags of native bf16 matmul: AVX512-BF16 (Cooper Lake, Zen 4 and later) or AMX (Sapphire Rapids and later).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpuinfo_value(keys: Iterable[str], cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The value of the first line of the CPU's description (Linux) whose key is one of `keys`; None where there
    is none or it cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    wanted = set(keys)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            return value.strip()
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The instruction-set flags of this machine's CPU (Linux); empty where they cannot be read."""
    return frozenset((cpuinfo_value(("flags", "Features"), cpuinfo) or "").split())  # x86 / arm64


def cpu_has_native_bf16(flags: Iterable[str] | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware.

    >>> cpu_has_native_bf16({"avx2", "avx512_bf16"}), cpu_has_native_bf16({"avx2", "fma"})
    (True, False)
    """
    if flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return False  # arm64's bf16 (FEAT_BF16) is not yet fast in torch's CPU kernels: float32 there
        flags = cpu_flags()
    return not BF16_CPU_FLAGS.isdisjoint(flags)


def default_bf16(cuda: bool, cuda_bf16: bool, cpu_native_bf16: bool) -> bool:
    """bf16 mixed precision where it is fast: a bf16-capable GPU, or a CPU with native bf16 when there is no GPU.

    >>> default_bf16(cuda=False, cuda_bf16=False, cpu_native_bf16=True), default_bf16(False, False, False)
    (True, False)
    >>> default_bf16(cuda=True, cuda_bf16=False, cpu_native_bf16=True)  # a V100: its fp16 is the user's to choose
    False
    """
    return cuda_bf16 if cuda else cpu_native_bf16


def slow_bf16_reason(bf16: bool, cuda: bool, cpu_native_bf16: bool) -> str | None:
    """Why a bf16 request cannot be honoured at speed on this node, or None.

    >>> slow_bf16_reason(True, cuda=False, cpu_native_bf16=False)[:44]
    'train.grpo.bf16=true on a CPU without native'
    >>> slow_bf16_reason(True, cuda=False, cpu_native_bf16=True) is None
    True
    """
    if not bf16 or cuda or cpu_native_bf16:
        return None
    return (
        "train.grpo.bf16=true on a CPU without native bfloat16 (no avx512_bf16 or amx_bf16 flag): bfloat16 "
        "matmuls run about 50x slower than float32 there. Leave train.grpo.bf16 unset (bf16 is chosen "
        "automatically where the CPU has it) or set it to false"
    )


def node_default_bf16() -> bool:
    """`default_bf16` for the machine this runs on."""
    import torch

    cuda = torch.cuda.is_available()
    return default_bf16(cuda, cuda and torch.cuda.is_bf16_supported(), cpu_has_native_bf16())
