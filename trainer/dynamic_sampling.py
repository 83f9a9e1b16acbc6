"""DAPO-style dynamic sampling (Yu et al. 2025, "DAPO", arXiv:2503.14476, §3.2): a group whose completions all got
the same reward has zero advantage and teaches nothing, so each generation makes more groups than the step
trains on and keeps the ones whose rewards differ: first those whose skill reward differs (DAPO keeps the groups whose
accuracy is neither all right nor all wrong), then those where only the total does.

TRL 1.16 has no such option, and the curriculum (`grpo_pipeline.trainer.sampling`) cannot help a run that draws
each prompt about once (it learns from a prompt's earlier groups). So `DynamicSampling` stands in for TRL's
`_generate_and_score_completions` in training mode (`grpo_pipeline.trainer.step` calls it): the local generation batch (whole groups of
`num_generations` consecutive rows: `grpo_pipeline.configs.train.dynamic_sampling_problem` requires it on every
process) is extended with extra whole groups drawn from the training data, TRL generates and scores them all in
one batched call, and `choose_groups` keeps exactly the original number of groups: the ones with reward variance
first, flat ones only to fill up. Every per-row tensor of TRL's output is cut to the kept rows and
`num_items_in_batch` (the loss normalizer, a sum over every rank's kept tokens) is counted again, so the step
trains on the batch size it was configured with and every rank keeps as many rows (DDP stays in step).

Generation is most of a CPU step, so two things keep it from paying double (`carry`, `adaptive`):
- a mixed group generated but not trained on is kept, with TRL's tensors for its rows, and offered first at the
  next generation (`next_carry`); one not chosen there is dropped, so no group is trained on twice or more than
  one generation after the policy that wrote it (its advantages are its own group's; its importance ratio is 1
  unless TRL computed old log-probabilities, as verl's and prime-rl's one-step-off-policy training accepts);
- the extra groups follow the share of mixed groups measured over the last generations (`MixedShare`) and the
  carried groups: enough to fill the step in expectation (`groups_to_generate`), `oversample` at most.

The extra prompts come from a stream seeded by (seed, rank, global step): distinct per rank, the same again after
a resume or a rollback to the same step. The carried groups and the measured share are not kept in a checkpoint:
a resumed run starts as a fresh one does (no carry, the prior share), which costs it at most one generation's
extra groups.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from datasets import IterableDataset
from trl.trainer.utils import nanstd

from grpo_pipeline.configs.sampling import DynamicSamplingConfig

# TRL's output keys that hold one entry per row (completion); the image keys are per patch or per image, so a
# vision batch is refused rather than cut wrongly
_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes", "num_images")


def extra_groups(groups: int, oversample: float) -> int:
    """Groups generated beyond a process's `groups` so that about `oversample` groups are made per group trained.

    >>> extra_groups(2, 2.0), extra_groups(1, 1.5), extra_groups(4, 1.25)
    (2, 1, 1)
    """
    return max(1, math.ceil(groups * (oversample - 1) - 1e-9))


def groups_to_generate(groups: int, carried: int, share: float, oversample: float) -> int:
    """Extra groups beyond the data loader's `groups` so that the `carried` groups and, at the measured `share` of
    mixed groups, the fresh mixed ones fill the step's `groups` in expectation; `extra_groups` at most.

    >>> groups_to_generate(2, 0, 0.5, 2.0), groups_to_generate(2, 0, 0.9, 2.0), groups_to_generate(2, 1, 0.9, 2.0)
    (2, 1, 0)
    >>> groups_to_generate(1, 0, 0.1, 2.0), groups_to_generate(2, 2, 0.1, 2.0)  # capped; carried enough
    (1, 0)
    """
    need = groups - carried
    if need <= 0:
        return 0
    wanted = math.ceil(need / max(share, 1e-6) - groups - 1e-9)
    return min(extra_groups(groups, oversample), max(0, wanted))


class MixedShare:
    """The share of generated groups that were mixed (their first-ranked reward differs: the skill where the task
    declares one, else the total), over the last `window` generations; before any, `prior`.

    >>> share = MixedShare(prior=0.5, window=2)
    >>> share.value, share.add(3, 4), share.add(1, 4), share.add(0, 4), share.value
    (0.5, None, None, None, 0.125)
    """

    def __init__(self, prior: float, window: int = 8) -> None:
        self.prior = prior
        self.recent: deque[tuple[int, int]] = deque(maxlen=window)

    def add(self, mixed: int, generated: int) -> None:
        self.recent.append((mixed, generated))

    @property
    def value(self) -> float:
        generated = sum(n for _, n in self.recent)
        return sum(m for m, _ in self.recent) / generated if generated else self.prior


def extra_prompts(n: int, count: int, seed: int | None, rank: int, step: int) -> list[int]:
    """`count` row indices of an `n`-row training set for the extra groups of `rank` at global `step`: distinct
    within the draw while the data allows (then drawn again), the same for the same (seed, rank, step).

    >>> extra_prompts(10, 3, 42, 0, 5) == extra_prompts(10, 3, 42, 0, 5), extra_prompts(10, 3, 42, 0, 5) != extra_prompts(10, 3, 42, 1, 5)
    (True, True)
    >>> sorted(extra_prompts(2, 3, 0, 0, 0))[:2]
    [0, 1]
    """
    rng = random.Random(f"dynamic-sampling/{seed}/{rank}/{step}")
    picks: list[int] = []
    while len(picks) < count:
        picks += rng.sample(range(n), min(n, count - len(picks)))
    return picks


def choose_groups(priority: list[int], keep: int) -> list[int]:
    """Which of the offered groups to train on (their indices, ascending): the highest `priority` first (2: the
    skill reward differs in the group, 1: only the total does, 0: flat), in the order offered within a priority
    (the carried groups, then the data loader's own, then the extras), flat ones only to fill `keep`.

    >>> choose_groups([0, 1, 0, 1], 2)
    [1, 3]
    >>> choose_groups([0, 1, 0, 0], 2)  # too few with variance: the first flat one fills up
    [0, 1]
    >>> choose_groups([1, 1, 2, 1], 2)  # a group that differs on the skill before one that differs on length
    [0, 2]
    >>> choose_groups([1, 1, 1, 1], 2)  # plenty: the dataloader's own groups
    [0, 1]
    """
    if keep > len(priority):
        raise ValueError(f"cannot keep {keep} groups of {len(priority)}")
    order = sorted(range(len(priority)), key=lambda i: -priority[i])  # stable: generation order within a priority
    return sorted(order[:keep])


def next_carry(priority: list[int], chosen: list[int], first_fresh: int, keep: int) -> list[int]:
    """Which offered groups to carry to the next generation (indices, ascending): the fresh ones (from `first_fresh`
    on) not chosen that have reward variance, the highest `priority` first, `keep` at most; a carried group not
    chosen is not carried again.

    >>> next_carry([2, 0, 2, 1, 2], chosen=[2, 4], first_fresh=1, keep=2)  # group 0 was carried: dropped
    [3]
    >>> next_carry([1, 2, 2, 0], chosen=[1], first_fresh=0, keep=1)
    [2]
    """
    left = [i for i in range(first_fresh, len(priority)) if i not in chosen and priority[i] > 0]
    return sorted(sorted(left, key=lambda i: -priority[i])[:keep])


# Prompts are padded on the left, completions (and everything per completion token) on the right, as TRL pads them;
# the padding of these keys is a token or a mask value, of the others a zero that the completion mask hides
_LEFT_PADDED = ("prompt_ids", "prompt_mask")
_PAD_WITH_TOKEN = ("prompt_ids", "completion_ids")
_PAD_VALUE = {"tool_mask": 1}


def cat_rows(first: dict, then: dict, pad_token_id: int) -> dict:
    """The per-row tensors of `first` followed by those of `then` (TRL's output, cut to whole groups), each pair
    padded to the wider of the two as TRL pads it.

    >>> import torch
    >>> a = {"prompt_ids": torch.tensor([[5]]), "completion_ids": torch.tensor([[7, 8]]), "advantages": torch.tensor([1.0])}
    >>> b = {"prompt_ids": torch.tensor([[3, 4]]), "completion_ids": torch.tensor([[9]]), "advantages": torch.tensor([2.0])}
    >>> {k: v.tolist() for k, v in cat_rows(a, b, pad_token_id=0).items()}
    {'prompt_ids': [[0, 5], [3, 4]], 'completion_ids': [[7, 8], [9, 0]], 'advantages': [1.0, 2.0]}
    """
    out = {}
    for key, value in then.items():
        head = first[key]
        if value.dim() == 2 and head.size(1) != value.size(1):
            width = max(head.size(1), value.size(1))
            pad = pad_token_id if key in _PAD_WITH_TOKEN else _PAD_VALUE.get(key, 0)
            head, value = (_pad_to(t, width, pad, left=key in _LEFT_PADDED) for t in (head, value))
        out[key] = torch.cat([head, value])
    return out


def _pad_to(tensor: Any, width: int, value: float, left: bool) -> Any:
    missing = width - tensor.size(1)
    return torch.nn.functional.pad(tensor, (missing, 0) if left else (0, missing), value=value)


def informative_groups(rewards: Any, num_generations: int) -> list[bool]:  # Any: a torch tensor
    """Per group of `num_generations` consecutive rewards: whether they differ (TRL's zero-std test, negated). A
    group whose rewards are all NaN (unscorable: TRL gives it zero advantage) has none to offer.

    >>> import torch
    >>> informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), float("nan")]), 2)
    [False, True, False]
    """
    std = nanstd(rewards.reshape(-1, num_generations), dim=1)
    flat = torch.isclose(std, torch.zeros_like(std)) | ~torch.isfinite(std)
    return (~flat).tolist()


class DynamicSampling:
    """The cut `train.dynamic_sampling` of a trainer (TRL's GRPOTrainer): in place of `_generate_and_score_completions`
    in training, extra groups generated, the mixed kept and the spare mixed carried (`generate_and_score`); it reads
    the rewards TRL computed for them (`record`, from `_calculate_rewards`). Refuses (ValueError) what it cannot cut:
    a streamed dataset, a process's batch that is not whole groups."""

    def __init__(self, trainer: Any, settings: DynamicSamplingConfig, skill: str | None = None) -> None:
        if isinstance(trainer.train_dataset, IterableDataset):
            raise ValueError(
                "train.dynamic_sampling needs a map-style training dataset (it draws extra prompts by index); "
                "set train.dynamic_sampling.enabled=false for a streamed one"
            )
        local = trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
        if local % trainer.num_generations:
            raise ValueError(
                f"train.dynamic_sampling needs whole groups on each process: {local} completions per process "
                f"is not a multiple of num_generations ({trainer.num_generations})"
            )
        self.settings = settings
        # DAPO keeps the groups whose accuracy differs: a group that differs only on a shaping reward (its lengths)
        # teaches the shape, not the task, so it ranks below one where the skill reward differs
        self.skill_column = trainer.reward_func_names.index(skill) if skill in trainer.reward_func_names else None
        self._rewards_seen: Any = None
        # the first generation makes the most extra groups, as the fixed budget did, until a share is measured
        self.share = MixedShare(prior=1 / settings.oversample)
        world = trainer.accelerator.num_processes
        self._carried: list[list[int]] = [[] for _ in range(world)]  # every rank's carried groups' priorities
        self._carried_rows: dict | None = None  # this rank's: TRL's tensors for their rows

    def record(self, rewards_per_func: Any) -> None:
        """The rewards TRL just computed: every rank's rows, rank by rank (TRL gathers them)."""
        self._rewards_seen = rewards_per_func

    def generate_and_score(self, trainer: Any, plain: Callable[[list], dict], inputs: list) -> dict:
        """What TRL's `_generate_and_score_completions` (bound: `plain`) returns for `inputs` in training, cut to the
        chosen groups, the carried ones first; evaluation generates what it is given."""
        if not trainer.model.training:
            return plain(inputs)
        g = trainer.num_generations
        groups = len(inputs) // g
        rank = trainer.accelerator.process_index
        carried = min(len(c) for c in self._carried)  # every rank generates as many groups, so TRL's gathers align
        if self.settings.adaptive:
            extra = groups_to_generate(groups, carried, self.share.value, self.settings.oversample)
        else:
            extra = extra_groups(groups, self.settings.oversample)
        data = trainer.train_dataset
        picks = extra_prompts(len(data), extra, trainer.args.seed, rank, trainer.state.global_step)
        extended = list(inputs) + [dict(data[i]) for i in picks for _ in range(g)]
        output = plain(extended)
        if present := [k for k in _IMAGE_KEYS if k in output]:
            raise ValueError(f"train.dynamic_sampling handles text batches only (TRL returned {present})")

        weights = trainer.reward_weights.to(self._rewards_seen.device).unsqueeze(0)
        rewards = (self._rewards_seen * weights).nansum(dim=1)
        rewards[torch.isnan(self._rewards_seen).all(dim=1)] = torch.nan
        per_rank = len(extended) // g  # every rank generated as many groups, so each rank's choice is known
        informative = informative_groups(rewards, g)
        skill_informative = (
            informative_groups(self._rewards_seen[:, self.skill_column], g)
            if self.skill_column is not None
            else [False] * len(informative)
        )
        priority = [int(total) + int(skill) for total, skill in zip(informative, skill_informative, strict=True)]
        top = 2 if self.skill_column is not None else 1
        self.share.add(sum(p >= top for p in priority), len(priority))

        kept_flat = trained_carried = first_mine = 0
        mine: list[int] = []
        mine_carry: list[int] = []
        for other in range(len(priority) // per_rank):
            offered = self._carried[other] + priority[other * per_rank : (other + 1) * per_rank]
            chosen = choose_groups(offered, groups)
            first_fresh = len(self._carried[other])
            carry = next_carry(offered, chosen, first_fresh, groups) if self.settings.carry else []
            kept_flat += sum(not offered[i] for i in chosen)
            trained_carried += sum(i < first_fresh for i in chosen)
            self._carried[other] = [offered[i] for i in carry]
            if other == rank:
                mine, mine_carry, first_mine = chosen, carry, first_fresh

        total = len(extended)
        fresh = {k: v for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == total}
        trained = self._select(fresh, [i - first_mine for i in mine if i >= first_mine], g)
        if self._carried_rows is not None and (old := [i for i in mine if i < first_mine]):
            trained = cat_rows(self._select(self._carried_rows, old, g), trained, trainer.processing_class.pad_token_id)
        self._carried_rows = self._select(fresh, [i - first_mine for i in mine_carry], g) if mine_carry else None
        output.update(trained)

        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        output["num_items_in_batch"] = trainer.accelerator.gather(mask.sum()).sum()
        metrics = trainer._metrics["train"]
        metrics["dynamic_sampling/generated_groups"].append(float(len(informative)))
        metrics["dynamic_sampling/informative_groups"].append(float(sum(informative)))
        metrics["dynamic_sampling/skill_groups"].append(float(sum(skill_informative)))
        metrics["dynamic_sampling/carried_groups"].append(float(trained_carried))
        metrics["dynamic_sampling/mixed_share"].append(self.share.value)
        metrics["dynamic_sampling/trained_zero_std"].append(kept_flat / (groups * len(self._carried)))
        return output

    @staticmethod
    def _select(rows: dict, groups: list[int], g: int) -> dict:
        """The rows of whole `groups` (indices of groups of `g` consecutive rows) of every per-row tensor."""
        first = next(iter(rows.values()))
        index = torch.tensor([i * g + j for i in groups for j in range(g)], dtype=torch.long, device=first.device)
        return {key: value.index_select(0, index) for key, value in rows.items()}
