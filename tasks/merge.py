"""Adapter merge and LoRA stacking.

Merging folds the adapter into a full-precision copy of the base (never into 4-bit weights), then proves
the merged model computes what base + adapter computes: its logits on a few prompts must match within a
tolerance, or the merge is refused. Stacking combines several adapters with weights into one (PEFT's
`add_weighted_adapter`), exported adapter-only for multi-LoRA serving.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from prefect import task

from configs.schema import MergeConfig


class MergeRefused(RuntimeError):
    pass


def _load_base(base_path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype)), tokenizer


def max_logit_difference(model_a, model_b, tokenizer, prompts: list[str]) -> float:
    """The largest |logit| difference between two models over the prompts' tokens."""
    import torch

    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        a = model_a(**batch).logits.float()
        b = model_b(**batch).logits.float()
    mask = batch["attention_mask"].bool()
    return float((a - b).abs()[mask].max())


def merge_adapter(base_path: str, adapter_dir: str, out_dir: Path, prompts: list[str], cfg: MergeConfig) -> dict:
    """Merge, verify against base + adapter, and save as safetensors (written aside, then moved in place)."""
    from peft import PeftModel

    base, tokenizer = _load_base(base_path, cfg.dtype)
    unmerged = PeftModel.from_pretrained(base, adapter_dir)
    reference_model, _ = _load_base(base_path, cfg.dtype)
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


def stack_adapters(base_path: str, adapters: list[tuple[str, float]], out_dir: Path, combination: str = "cat") -> Path:
    """Combine adapters with weights into one adapter (PEFT); 'cat' keeps each exactly, 'linear' averages."""
    from peft import PeftModel

    base, _ = _load_base(base_path, "float32")
    model = PeftModel.from_pretrained(base, adapters[0][0], adapter_name="a0")
    for i, (path, _) in enumerate(adapters[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    names = [f"a{i}" for i in range(len(adapters))]
    model.add_weighted_adapter(names, [w for _, w in adapters], adapter_name="stacked", combination_type=combination)
    model.set_adapter("stacked")
    for name in names:
        model.delete_adapter(name)
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir, selected_adapters=["stacked"])
    # PEFT writes a non-default adapter under a subfolder of its name; serve it from the top level.
    nested = out_dir / "stacked"
    if nested.is_dir():
        for item in nested.iterdir():
            item.rename(out_dir / item.name)
        nested.rmdir()
    return out_dir


merge_task = task(merge_adapter, name="merge")
