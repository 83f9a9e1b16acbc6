"""Score only the completion tokens through TRL's fused LM head on the CPU, as TRL already does on GPUs.

TRL 1.16 computes the loss's per-token log-probabilities with a fused LM head (`trl.trainer.utils.add_fused_lm_head`):
the vocabulary projection runs in tiles and never materializes the logits. Where Triton runs (CUDA, XPU) it projects
only the positions whose label counts (the completion's tokens); elsewhere it projects every position of the batch
and zeroes the rest afterwards, because on Neuron-like compilers a changing number of positions would recompile
the tiles. An eager CPU compiles nothing, and there the full projection costs what it says: on the demo (16
sequences of ~47 prompt and at most 16 completion tokens) the head projects 1,008 positions onto 49,152 tokens for
~250 that count, in the forward, again in the backward's recompute, and once more for the hidden states' gradient.

`compact_lm_head()` makes the CPU take TRL's own compact branch: the same per-row computation on the rows that count
(`hidden_states[mask]`, then `masked_scatter` back), so the log-probabilities, the entropies and the loss are the
same to float rounding (tests/integration/test_faster_step.py). Where this TRL has no such branch, the head runs as
TRL ships it, after one warning naming `train.compact_lm_head` where the setting asked for the cut.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import trl.trainer.utils as trl_utils

from grpo_pipeline.trainer.cuts import Switch

log = logging.getLogger(__name__)
SETTING = "train.compact_lm_head"


@contextmanager
def compact_lm_head(fall_back: Callable[[str], None] | None = None) -> Iterator[None]:
    """Inside: TRL's fused LM head scores only the positions with a label on CPU tensors too (its `compact` branch,
    chosen by `trl.trainer.utils._use_triton`, which the head consults for nothing else). Where this TRL has no such
    branch, `fall_back(reason)` (by default a warning naming the setting) and the head as TRL ships it."""
    chooser = getattr(trl_utils, "_use_triton", None)
    if chooser is None or not hasattr(trl_utils, "add_fused_lm_head"):
        reason = "this TRL's fused LM head has no compact branch to choose; it scores every position"
        if fall_back is None:
            log.warning("%s: %s", SETTING, reason)
        else:
            fall_back(reason)
        yield
        return

    def compact_on_cpu(device: torch.device) -> bool:
        return device.type == "cpu" or bool(chooser(device))

    setattr(trl_utils, "_use_triton", compact_on_cpu)  # noqa: B010 (a private name of TRL's: mypy need not know it)
    try:
        yield
    finally:
        setattr(trl_utils, "_use_triton", chooser)  # noqa: B010


class CompactLMHead:
    """The cut `train.compact_lm_head` (`Switch`), around a whole training run (`compact_lm_head`)."""

    def __init__(self, value: bool | None) -> None:
        self.switch = Switch(SETTING, value, log)

    def around(self) -> AbstractContextManager[None]:
        if self.switch.off:
            return nullcontext()
        return compact_lm_head(lambda reason: self.switch.fall_back("the head runs as TRL ships it", reason))
