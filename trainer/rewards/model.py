"""`reward_model`: scores from a Hugging Face sequence-classification model, batched, on the trainer's device."""

from __future__ import annotations

import functools
import os
from typing import Any

from grpo_pipeline.trainer.rewards.base import RewardError, completion_text


def _device() -> str:
    """The trainer's own device: this process's GPU under torchrun/accelerate (LOCAL_RANK), else the CPU."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


@functools.lru_cache(maxsize=4)
def _load(path: str, device: str, dtype: str, trust_remote_code: bool) -> tuple[Any, Any]:  # tokenizer, model
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise RewardError(f"reward_model: cannot load {path!r}: {exc}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"  # as TRL scores reward models: the score is read at the last real token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model.to(device).eval()


def _text(tokenizer: Any, prompt: str | list[dict] | None, completion: str | list[dict]) -> str:
    """Prompt and completion as the reward model reads them: its chat template for conversations."""
    if isinstance(completion, list):
        messages = (prompt if isinstance(prompt, list) else []) + completion
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(m.get("content", "") for m in messages)
    return (prompt if isinstance(prompt, str) else "") + completion_text(completion)


def reward_model(
    completions: list,
    prompts: list | None = None,
    *,
    model: str,
    batch_size: int = 16,
    max_length: int = 2048,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    **_: object,
) -> list[float]:
    """The score of a sequence-classification reward model (a path or hub id) for prompt + completion.

    One label: its logit (as TRL scores reward models). Several: the probability of the last label, the
    "good" one by convention. Loaded once per process and kept, on the trainer's device.

    >>> reward_model(["4"], model="any/classifier", batch_size=0)
    Traceback (most recent call last):
    ...
    grpo_pipeline.trainer.rewards.base.RewardError: reward_model: batch_size must be >= 1
    """
    if batch_size < 1:
        raise RewardError("reward_model: batch_size must be >= 1")
    import torch

    tokenizer, scorer = _load(model, _device(), dtype, trust_remote_code)
    prompts = prompts if prompts is not None else [None] * len(completions)
    texts = [_text(tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]
    scores: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max_length,
                add_special_tokens=False,
            ).to(scorer.device)
            logits = scorer(**batch).logits.float()
            values = logits[:, 0] if logits.shape[1] == 1 else logits.softmax(dim=-1)[:, -1]
            scores += values.tolist()
    return scores
