"""No loss pass for a batch whose advantages are all zero (`train.skip_zero_advantage`), computing what TRL's does.

Why: a GRPO group whose completions all score the same has no advantage, and a batch made only of such groups has
an objective of exactly zero and a gradient of exactly zero; TRL still runs its forward over every row, with grad,
and the backward. On the demo about a third of a searched run's steps, and half of a short trial's, are such
batches (`frac_reward_zero_std` 1.0), and the loss's forward and backward are ~60 % of a CPU step
(bench.step_profile).

How: in training, a micro-batch whose advantages are all zero returns `0 x (the sum of every trainable weight)`
instead of TRL's loss: its backward gives every trainable weight a gradient of zeros, which is what TRL's backward
gives it, so the optimizer steps as it would (AdamW goes on moving the weights by its momentum; a weight without
a gradient would be skipped). The completions were sampled and scored as before; the metrics only the loss's
forward computes (entropy, clip ratios) are absent from that step's log, and `zero_advantage/skipped` logs the
share of micro-batches that ran no loss pass.

It runs TRL's loss, after one warning naming the setting where it was asked for (silently where it was left unset:
`grpo_pipeline.trainer.cuts.Switch`), where a zero advantage does not make the gradient zero
or where skipping cannot be exact: a KL term (`beta` > 0), an entropy bonus, a MoE's auxiliary loss, a loss type not
known here, Liger's fused loss, or several processes (DDP must see every process's forward and backward).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from grpo_pipeline.trainer.cuts import Switch

log = logging.getLogger(__name__)
SETTING = "train.skip_zero_advantage"
METRIC = "zero_advantage/skipped"

# TRL's loss types whose per-token loss is a product with the advantage (GRPOTrainer._compute_loss, TRL 1.16)
PROPORTIONAL = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"})


def skip_blocker(trainer: Any) -> str | None:
    """Why a zero-advantage batch of `trainer` (a TRL GRPOTrainer) may still have a gradient, or None."""
    if getattr(trainer, "beta", 0.0) != 0.0:
        return f"the KL term (beta={trainer.beta}) has a gradient where the advantages are zero"
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return "the entropy bonus has a gradient where the advantages are zero"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the model's auxiliary (MoE router) loss has a gradient where the advantages are zero"
    if getattr(trainer.args, "use_liger_kernel", False):
        return "Liger's fused loss is computed apart from TRL's"
    if trainer.loss_type not in PROPORTIONAL:
        return f"loss_type={trainer.loss_type!r} is not known to vanish with the advantages"
    if trainer.accelerator.num_processes > 1:
        return "several processes train (DDP must run every process's forward and backward)"
    return None


class ZeroAdvantageSkip:
    """The cut `train.skip_zero_advantage` (`Switch`), in place of TRL's `compute_loss`: a training micro-batch whose
    advantages are all zero runs no loss pass; where `skip_blocker` says a zero advantage may still have a gradient,
    TRL's loss (`plain`) runs for every batch. Decided once, at the first training batch."""

    def __init__(self, value: bool | None) -> None:
        self.switch = Switch(SETTING, value, log)
        self._reason: str | None = None
        self._checked = False

    def compute_loss(
        self,
        trainer: Any,
        plain: Callable[..., Any],
        model: Any,
        inputs: dict,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """What TRL's `compute_loss` (bound: `plain`) returns, or for a skipped batch a zero with a zero gradient."""

        def loss() -> Any:
            return plain(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

        if self.switch.off or return_outputs or not model.training:  # evaluation computes its metrics from the forward
            return loss()
        if not self._checked:
            self._checked, self._reason = True, skip_blocker(trainer)
            if self._reason:
                self.switch.fall_back("every batch runs the loss's pass", self._reason)
        skip = self._reason is None and not bool(inputs["advantages"].any())
        trainer._metrics["train"][METRIC].append(float(skip))
        if not skip:
            return loss()
        # zero, and a zero gradient for every trainable weight, as TRL's backward of this batch gives
        return torch.stack([p.float().sum() for p in model.parameters() if p.requires_grad]).sum() * 0.0
