"""Merge equivalence on the tiny model."""

import pytest
import torch

from grpo_pipeline.configs.schema import MergeConfig
from grpo_pipeline.tasks.promote.merge import MergeRefused, max_logit_difference, merge_adapter

pytestmark = pytest.mark.integration
PROMPTS = ["What is 3 + 4?", "What is 12 + 9? Reply with just the number."]


def _random_adapter(tiny_model, path, seed):
    """A LoRA adapter with non-zero B, so merging actually changes the weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    )
    model.save_pretrained(path)
    return str(path)


def test_merged_model_matches_base_plus_adapter(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = _random_adapter(tiny_model, tmp_path / "adapter", seed=1)
    info = merge_adapter(str(tiny_model), adapter, tmp_path / "merged", PROMPTS, MergeConfig())
    assert info["max_logit_difference"] <= 1e-3
    merged = AutoModelForCausalLM.from_pretrained(info["merged_dir"])  # plain transformers, no PEFT
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert list((tmp_path / "merged").glob("*.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert max_logit_difference(merged, base, tokenizer, PROMPTS) > 1e-3  # the adapter did change something


def test_merge_is_refused_beyond_tolerance(tmp_path, tiny_model):
    adapter = _random_adapter(tiny_model, tmp_path / "adapter", seed=2)
    with pytest.raises(MergeRefused, match="merge.tolerance"):
        merge_adapter(
            str(tiny_model), adapter, tmp_path / "merged", PROMPTS, MergeConfig(dtype="bfloat16", tolerance=1e-9)
        )
    assert not (tmp_path / "merged").exists()
