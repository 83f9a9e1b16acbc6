"""bitsandbytes in the pipeline asks no hub for code: on a CPU with AVX512-BF16 its import looks up a fused 4-bit
kernel on the Hugging Face Hub (`kernels.get_kernel`) and, failing, advises `trust_remote_code=True`;
`import_bitsandbytes_offline` (called before peft imports it) skips that lookup, with no warning.

This machine may lack AVX512-BF16, so a child process answers bitsandbytes' CPU probe as such a CPU would; the same
child without the pipeline's import shows the lookup and the warning happen there, so the test can fail."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("bitsandbytes")

CHILD = r"""
import importlib.abc, importlib.machinery, json, sys

class AvxBf16(importlib.abc.MetaPathFinder):
    # bitsandbytes.functional as on a CPU with AVX512-BF16: its probe answers True
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, AvxBf16())
import kernels
asked, real = [], kernels.get_kernel
def get_kernel(repo_id, *args, **kwargs):
    asked.append(repo_id)
    return real(repo_id, *args, **kwargs)
kernels.get_kernel = get_kernel
if sys.argv[1] == "pipeline":
    from grpo_pipeline.trainer.offline import import_bitsandbytes_offline
    import_bitsandbytes_offline()
import bitsandbytes  # as peft imports it in the pipeline's stages
import torch
import bitsandbytes.functional as F
weight = torch.randn(64, 64)
packed, state = F.quantize_4bit(weight, quant_type="nf4")
error = (F.dequantize_4bit(packed, state) - weight).abs().mean().item()
print(json.dumps({"asked": asked, "kernels_back": sys.modules.get("kernels") is kernels, "nf4_error": error}))
"""


def child(mode: str) -> tuple[dict, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the baseline's own lookup fails fast, without a network wait
    env.pop("GRPO_BNB_HUB_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_bitsandbytes_asks_the_hub_for_code_unless_the_pipeline_imports_it():
    plain, plain_err = child("plain")
    assert plain["asked"] == ["kernels-community/quantization-bitsandbytes"]  # the lookup this test guards against
    assert "Failed to load CPU gemm_4bit_forward from kernels-community" in plain_err

    ours, ours_err = child("pipeline")
    assert ours["asked"] == [], ours
    assert "kernels-community" not in ours_err and "trust_remote_code" not in ours_err, ours_err
    assert ours["kernels_back"]  # hidden only while bitsandbytes imports
    assert ours["nf4_error"] < 0.2  # its own CPU kernels quantize and dequantize NF4
