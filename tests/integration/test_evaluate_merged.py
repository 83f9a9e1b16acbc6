"""The holdout evaluation samples a plain LoRA adapter from its merged weights: the greedy completions the
unmerged adapter gives."""

import torch
from peft import LoraConfig, get_peft_model

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import EvalConfig, ModelConfig
from grpo_pipeline.tasks.evaluate import evaluate_model, generate, read_jsonl
from grpo_pipeline.tasks.job import model_load
from grpo_pipeline.trainer.loading import load_model

REWARDS = RewardSet(entries=["correct_answer"])


def test_a_merged_evaluation_answers_as_the_unmerged_adapter(tiny_model, tiny_splits, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in peft.named_parameters():
        if "lora_B" in name:  # a fresh adapter is B = 0, which any merge leaves as the base
            torch.nn.init.normal_(param, std=0.5)
    peft.save_pretrained(tmp_path / "adapter")
    cfg = EvalConfig(max_new_tokens=6, batch_size=3)
    prompts = [r["prompt"] for r in read_jsonl(tiny_splits["holdout"])]

    model, tokenizer = load_model(str(tiny_model), model_load(ModelConfig()), adapter=str(tmp_path / "adapter"))
    model.eval()
    unmerged, _ = generate(model, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size)

    merged = evaluate_model(
        str(tiny_model), ModelConfig(), tiny_splits["holdout"], REWARDS, cfg, str(tmp_path / "adapter")
    )
    plain = evaluate_model(str(tiny_model), ModelConfig(), tiny_splits["holdout"], REWARDS, cfg)

    assert [r["completion"] for r in merged.rows] == unmerged
    assert [r["completion"] for r in plain.rows] != unmerged  # the adapter changes the answers: a lost merge shows
