"""Offline by default for a quantized base: bitsandbytes imported without its Hugging Face Hub kernel lookup.

Its own module, apart from `loading`, so the entry points can call it before anything imports peft."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

# "1" lets bitsandbytes fetch and run its optional fused CPU kernel from the Hugging Face Hub (an operator's choice,
# made in the worker's environment); by default the pipeline never loads code from the hub for a quantized base.
HUB_KERNELS_ENV = "GRPO_BNB_HUB_KERNELS"
_BNB_CPU_OPS = "bitsandbytes.backends.cpu.ops"


def import_bitsandbytes_offline() -> None:
    """Import bitsandbytes, when it is installed and not imported yet, without its hub kernel.

    On a CPU with AVX512-BF16, `import bitsandbytes` asks the Hugging Face Hub for a fused 4-bit kernel
    (`kernels.get_kernel("kernels-community/quantization-bitsandbytes")`: code downloaded and run at import), and
    when that fails it warns "Failed to load CPU gemm_4bit_forward from kernels-community ... Set
    trust_remote_code=True": a network call from a pipeline that must work offline, and advice to run remote code.
    Here the `kernels` package is hidden for the length of the import (a None entry in `sys.modules` makes its
    import fail, as documented for the import system), so bitsandbytes skips the lookup and runs its own CPU
    kernels; its note about the skipped kernel is kept out of the log. `kernels` is back afterwards for whoever
    else uses it. Called before anything imports peft (which imports bitsandbytes): the trainer's entry point and the
    pipeline's and search's flows. `GRPO_BNB_HUB_KERNELS=1` restores bitsandbytes' own behaviour."""
    if "bitsandbytes" in sys.modules or os.environ.get(HUB_KERNELS_ENV) == "1":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        return
    absent = object()
    held = sys.modules.get("kernels", absent)
    ops_log = logging.getLogger(_BNB_CPU_OPS)
    level = ops_log.level
    sys.modules["kernels"] = None  # type: ignore[assignment]
    ops_log.setLevel(logging.ERROR)  # its warning names the hub kernel it did not load, which is the point here
    try:
        import bitsandbytes  # noqa: F401
    finally:
        ops_log.setLevel(level)
        if held is absent:
            del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = held  # type: ignore[assignment]
