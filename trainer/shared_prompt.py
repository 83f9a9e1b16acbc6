"""The loss's forward over each distinct prompt once (`train.share_prompt_forward`), computing what TRL's computes.

Why: TRL scores a generation batch by running every row, prompt and completion, through the policy, with grad, and
back. But each prompt is repeated `num_generations` times: on the demo, 16 rows of ~47 prompt and at most 16
completion tokens hold 2 distinct prompts, so about 3 in 4 of the tokens the forward and the backward carry are
copies of a prompt another row already ran (bench.step_profile: the loss's forward and backward are most of a CPU
step once generation is cut).

How: the distinct prompts (all but their last token) run once through the backbone, with grad, into a
`DynamicCache`; its keys and values are indexed out to every row that shares the prompt (an index, so the
backward sums each copy's gradient into its prompt's), and TRL's own call then runs only each row's last prompt
token and its completion against that cache, through the same fused LM head, labels and autocast. Positions are
what the full forward gives (the cache's length plus the column: TRL passes no position ids), the attention mask is
the full one, so each completion token attends to what it attended to before: the same log-probabilities,
entropies, loss and gradients to float rounding (a prompt's keys come from a smaller batch).

It runs the plain forward, after one warning naming the setting where it was asked for (silently where it was left
unset: `grpo_pipeline.trainer.cuts.Switch`), where it cannot be exact or is not understood:
gradient checkpointing (its recompute does not keep a cache), dropout in train mode (the rows would share one
mask), a model wrapped for distributed training (DDP must see the forward), a cache other than full-attention
`DynamicCache` layers, multimodal inputs, a MoE's auxiliary loss, prompts not left-padded. A batch without a
repeated prompt runs the plain forward silently: there is nothing to share.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from grpo_pipeline.trainer.cuts import Switch
from grpo_pipeline.trainer.generation import (
    active_dropout,
    cache_blocker,
    cache_kwarg,
    distinct_rows,
    transformers_model,
)

log = logging.getLogger(__name__)
SETTING = "train.share_prompt_forward"


def share_blocker(model: Any, unwrapped: Any, extra: dict[str, Any]) -> str | None:
    """Why the loss's forward of `model` (as the trainer calls it; `unwrapped`: accelerate's unwrap of it) cannot
    share its prompts' pass, given TRL's other inputs `extra`, or None.

    >>> import torch
    >>> share_blocker(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), {"pixel_values": torch.zeros(1)})
    'multimodal inputs (pixel_values)'
    """
    if extra.get("compute_aux_loss"):
        return "the model's MoE load-balancing loss is asked for"
    if given := sorted(name for name, value in extra.items() if name != "compute_aux_loss" and value is not None):
        return f"multimodal inputs ({', '.join(given)})"
    if unwrapped is not model:
        return f"the model is wrapped for distributed training ({type(model).__name__})"
    config = getattr(unwrapped, "active_peft_config", None)
    if config is not None and config.is_prompt_learning:
        return f"the adapter is prompt learning ({config.peft_type})"
    base = transformers_model(unwrapped)
    if getattr(base, "is_gradient_checkpointing", False):
        return "gradient checkpointing recomputes each layer's forward without a cache"
    if reason := cache_blocker(base):
        return reason
    if reason := active_dropout(unwrapped):
        return f"dropout is active in train mode ({reason}): the rows that share a prompt would share its mask"
    return None


def shared_prompt_logps(
    model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, compute_entropy: bool, autocast: Any
) -> tuple[Any, Any] | None:
    """TRL's per-token log-probabilities (and entropies) of the last `logits_to_keep` columns, with each distinct
    prompt run once; None where no prompt repeats or the prompts are not left-padded (the caller runs the plain
    forward). `model`: the policy as TRL calls it (its fused LM head); `autocast`: the accelerator's context."""
    prompt = input_ids.shape[1] - logits_to_keep
    if prompt < 2:
        return None
    firsts, inverse = distinct_rows(input_ids[:, :prompt], attention_mask[:, :prompt])
    if len(firsts) == input_ids.shape[0] or not bool(attention_mask[:, prompt - 1].all()):
        return None
    base = transformers_model(model)
    cache_name = cache_kwarg(base)
    assert cache_name is not None  # share_blocker's cache_blocker checked it before the trainer came here
    cache = DynamicCache(config=base.config.get_text_config(decoder=True))
    rows = torch.tensor(firsts, device=input_ids.device)
    tail = input_ids[:, prompt - 1 :]
    labels = tail.masked_fill(attention_mask[:, prompt - 1 :] == 0, -100)  # column 0 predicts nothing scored
    with autocast:
        # the backbone alone: the prompt's hidden states feed only the cache, never the LM head
        base.base_model(
            input_ids=input_ids[rows, : prompt - 1],
            attention_mask=attention_mask[rows, : prompt - 1],
            use_cache=True,
            **{cache_name: cache},
        )
        cache.batch_select_indices(torch.tensor(inverse, device=input_ids.device))
        out = model(
            input_ids=tail, attention_mask=attention_mask, labels=labels, fused_lm_head=True, **{cache_name: cache}
        )
    entropies = out.entropy[:, -logits_to_keep:] if compute_entropy else None
    return out.log_probs[:, -logits_to_keep:], entropies


class SharedPromptForward:
    """The cut `train.share_prompt_forward` (`Switch`), in place of TRL's `_get_per_token_logps_and_entropies`:
    the loss's forward over each distinct prompt once (`shared_prompt_logps`), chunk by chunk as TRL's runs; where
    `share_blocker` says it cannot, TRL's forward (`plain`)."""

    def __init__(self, value: bool | None) -> None:
        self.switch = Switch(SETTING, value, log)

    def per_token_logps(
        self,
        trainer: Any,
        plain: Callable[..., Any],
        model: Any,
        input_ids: Any,
        attention_mask: Any,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        **extra: Any,
    ) -> Any:
        """What TRL's `_get_per_token_logps_and_entropies` (bound: `plain`) returns for these arguments."""
        reason = None if self.switch.off else share_blocker(model, trainer.accelerator.unwrap_model(model), extra)
        if reason:
            self.switch.fall_back("the loss's forward runs every row's prompt", reason)
        if self.switch.off or reason:
            return plain(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **extra)
        size = batch_size or input_ids.size(0)  # TRL's chunks, each sharing its own prompts
        parts = []
        for start in range(0, input_ids.size(0), size):
            chunk = slice(start, start + size)
            part = shared_prompt_logps(
                model,
                input_ids[chunk],
                attention_mask[chunk],
                logits_to_keep,
                compute_entropy,
                trainer.accelerator.autocast(),
            )
            if part is None:  # nothing repeats in this chunk
                part = plain(model, input_ids[chunk], attention_mask[chunk], logits_to_keep, None, compute_entropy)[:2]
            parts.append(part)
        logps = torch.cat([p[0] for p in parts])
        entropies = torch.cat([p[1] for p in parts]) if compute_entropy else None
        return logps, entropies, None
