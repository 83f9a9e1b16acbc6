"""Adapter merge: the adapter folded into a full-precision copy of the base (never into 4-bit weights),
then proven to compute what base + adapter computes: its logits on a few prompts must match within a
tolerance, or the merge is refused.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import task

from grpo_pipeline.configs.schema import MergeConfig
from grpo_pipeline.trainer.loading import load_model
from grpo_pipeline.trainer.spec import ModelLoad

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class MergeRefused(RuntimeError):
    pass


def _load_base(base_path: str, dtype: str, trust_remote_code: bool) -> PreTrainedModel:
    """The base at full precision (a merge into 4-bit weights would lose the adapter's precision)."""
    load = ModelLoad(quantization="none", double_quant=False, compute_dtype=dtype, trust_remote_code=trust_remote_code)
    return load_model(base_path, load)


def max_logit_difference(
    model_a: PreTrainedModel, model_b: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str]
) -> float:
    """The largest |logit| difference between two models over the prompts' tokens."""
    import torch

    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        a = model_a(**batch).logits.float()
        b = model_b(**batch).logits.float()
    mask = batch["attention_mask"].bool()
    return float((a - b).abs()[mask].max())


def merge_adapter(
    base_path: str,
    adapter_dir: str,
    out_dir: Path,
    prompts: list[str],
    cfg: MergeConfig,
    trust_remote_code: bool = False,
) -> dict:
    """Merge, verify against base + adapter, and save as safetensors (written aside, then moved in place)."""
    from peft import PeftModel

    base, tokenizer = _load_base(base_path, cfg.dtype, trust_remote_code)
    unmerged = PeftModel.from_pretrained(base, adapter_dir)
    reference_model, _ = _load_base(base_path, cfg.dtype, trust_remote_code)
    reference = PeftModel.from_pretrained(reference_model, adapter_dir)  # stays unmerged for the check
    merged = unmerged.merge_and_unload()
    difference = max_logit_difference(merged, reference, tokenizer, prompts[: cfg.verify_prompts])
    if difference > cfg.tolerance:
        raise MergeRefused(
            f"merged logits differ from base + adapter by {difference:.2e} > merge.tolerance={cfg.tolerance:.0e}; "
            "serve the adapter unmerged, or merge in float32"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    merged.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return {"merged_dir": str(out_dir), "max_logit_difference": difference, "dtype": cfg.dtype}


merge_task = task(name="merge")(merge_adapter)
