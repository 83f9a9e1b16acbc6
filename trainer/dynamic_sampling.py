"""DAPO-style dynamic sampling (Yu et al. 2025, "DAPO", arXiv:2503.14476, §3.2): a group whose completions all got
the same reward has zero advantage and teaches nothing, so each generation makes more groups than the step
trains on and keeps the ones whose rewards differ: first those whose skill reward differs (DAPO keeps the groups whose
accuracy is neither all right nor all wrong), then those where only the total does.

TRL 1.16 has no such option, and the curriculum (`grpo_pipeline.trainer.sampling`) cannot help a run that draws
each prompt about once (it learns from a prompt's earlier groups). So `DynamicSampling` stands in for TRL's
`_generate_and_score_completions` in training mode (`grpo_pipeline.trainer.step` calls it): the local generation batch (whole groups of
`num_generations` consecutive rows: `grpo_pipeline.configs.train.dynamic_sampling_problem` requires it on every
process) is extended with `extra_groups` whole groups drawn from the training data, TRL generates and scores
them all in one batched call, and `choose_groups` keeps exactly the original number of groups: the ones with
reward variance first, flat ones only to fill up. Every per-row tensor of TRL's output is cut to the kept rows
and `num_items_in_batch` (the loss normalizer, a sum over every rank's kept tokens) is counted again, so the
step trains on the batch size it was configured with and every rank keeps as many rows (DDP stays in step).

The extra prompts come from a stream seeded by (seed, rank, global step): distinct per rank, the same again after
a resume or a rollback to the same step, and nothing to save in a checkpoint.
"""

from __future__ import annotations

import math
import random
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
    """Which of the generated groups to train on (their indices, ascending): the highest `priority` first (2: the
    skill reward differs in the group, 1: only the total does, 0: flat), in generation order within a priority
    (the dataloader's own groups come before the extras), flat ones only to fill `keep`.

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
    in training, more groups generated and the informative kept (`generate_and_score`); it reads the rewards TRL
    computed for them (`record`, from `_calculate_rewards`). Refuses (ValueError) what it cannot cut: a streamed
    dataset, a process's batch that is not whole groups."""

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

    def record(self, rewards_per_func: Any) -> None:
        """The rewards TRL just computed: every rank's rows, rank by rank (TRL gathers them)."""
        self._rewards_seen = rewards_per_func

    def generate_and_score(self, trainer: Any, plain: Callable[[list], dict], inputs: list) -> dict:
        """What TRL's `_generate_and_score_completions` (bound: `plain`) returns for `inputs` in training, cut to the
        chosen groups; evaluation generates what it is given."""
        if not trainer.model.training:
            return plain(inputs)
        g = trainer.num_generations
        groups = len(inputs) // g
        extra = extra_groups(groups, self.settings.oversample)
        data = trainer.train_dataset
        rank = trainer.accelerator.process_index
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
        kept_flat = 0
        mine: list[int] = []
        for other in range(len(priority) // per_rank):
            verdicts = priority[other * per_rank : (other + 1) * per_rank]
            chosen = choose_groups(verdicts, groups)
            kept_flat += sum(not verdicts[i] for i in chosen)
            if other == rank:
                mine = chosen
        index = torch.tensor([i * g + j for i in mine for j in range(g)], device=output["prompt_ids"].device)
        total = len(extended)
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == total:
                output[key] = value.index_select(0, index)
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        output["num_items_in_batch"] = trainer.accelerator.gather(mask.sum()).sum()
        metrics = trainer._metrics["train"]
        metrics["dynamic_sampling/generated_groups"].append(float(len(informative)))
        metrics["dynamic_sampling/informative_groups"].append(float(sum(informative)))
        metrics["dynamic_sampling/skill_groups"].append(float(sum(skill_informative)))
        trained = groups * (len(informative) // per_rank)
        metrics["dynamic_sampling/trained_zero_std"].append(kept_flat / trained)
        return output
