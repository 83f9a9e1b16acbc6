"""A tiny randomly initialised model of a real architecture, for tests and for the benchmarks' --tiny mode."""

from __future__ import annotations

from pathlib import Path

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def create_random_model(target: Path, *, hidden_size: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A tiny randomly initialised Llama (SmolLM2's architecture) with a byte-level BPE tokenizer trained here.

    For tests and CPU benchmarks: real architecture, real tokenizer files, no hub.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} + {b}? Reply with just the number. {a + b}" for a in range(30) for b in range(30)]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def create_random_adapter(base: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter with random, non-zero weights (so it changes the outputs), with the tokenizer, saved as the
    trainer saves one: for the serving tests and `bench.serving`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=rank, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False),
    )
    peft_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out
