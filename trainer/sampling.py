"""Fewer wasted GRPO steps: a prompt whose last group of completions all got the same reward (all right: too
easy; all wrong: too hard) gives no advantage and no gradient, so the sampler benches it for a while.

TRL 1.16 has no option for this (its GRPOConfig has no dynamic sampling or group filter; `scale_rewards` and
`mask_truncated_completions` change the loss, not which prompts are drawn), so the pipeline replaces TRL's
`RepeatSampler` with `CurriculumSampler`, which keeps its batch structure (each prompt repeated
`num_generations` times, each chunk repeated `num_iterations x steps_per_generation` times) and its order: pass
`e` over the data is the very permutation RepeatSampler draws in epoch `e`. The only difference: a prompt
benched by `Curriculum` is passed over, at most `max_skips` times in a row (the cap: a prompt too hard today may
be learnable later, one too easy may be forgotten), and the next prompt of the pass takes its place. A run
that sees each prompt once is therefore drawn exactly as TRL would draw it.

`Curriculum` is the pure part: which prompts are benched, the chunks drawn this epoch, where the pass stands;
its state is JSON (`curriculum.json` in every checkpoint). A resumed run replays the chunks its epoch had
already drawn, which is what HF's resume skips over, so it continues as the uninterrupted run would have.
Every rank holds the same state: each rank sees the same gathered rewards (TRL gathers them across ranks
before it normalizes groups), so each makes the same decisions, as RepeatSampler's shared seed does.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_pipeline.configs.sampling import CurriculumConfig
from grpo_pipeline.trainer.checkpoints import checkpoint_name
from grpo_pipeline.trainer.spec import ZeroSignal

# torch, TRL, datasets and accelerate load inside the functions that use them: the trainer's entry (train.py) imports
# this module before they load, so a bad job spec is refused without them.
STATE_FILE = "curriculum.json"  # in each checkpoint, beside health.json


def prompt_key(prompt: object) -> str:
    """A short stable key for a prompt (text or chat messages), the same on every rank.

    >>> prompt_key("What is 2 + 2?") == prompt_key("What is 2 + 2?"), len(prompt_key([{"role": "user", "content": "x"}]))
    (True, 32)
    """
    text = json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass
class Curriculum:
    """Which prompts sit out, and the chunks (prompt indices per generation batch) each epoch draws.

    `streak[i]`: consecutive observed groups of prompt i with zero reward variance; benched once it reaches
    `patience`. `skips[i]`: passes over a benched prompt since it was last drawn; at `max_skips` it is drawn
    again, and its next group decides (still no variance: benched anew; otherwise it is back for good).

    >>> c = Curriculum(n=4, batch_size=2, seed=0, settings=CurriculumConfig(), shuffle=False)
    >>> list(c.epoch_chunks(0))
    [[0, 1], [2, 3]]
    >>> c.observe([(0, True), (1, False)])
    >>> list(c.epoch_chunks(1))  # prompt 0 taught nothing: the next prompt takes its place
    [[1, 2], [3, 1]]
    """

    n: int
    batch_size: int  # distinct prompts per chunk (TRL: generation_batch_size // num_generations)
    seed: int | None
    settings: CurriculumConfig
    shuffle: bool = True
    streak: dict[int, int] = field(default_factory=dict)
    skips: dict[int, int] = field(default_factory=dict)
    epoch: int | None = None
    drawn: list[list[int]] = field(default_factory=list)  # this epoch's chunks, in order
    cursor: tuple[int, int] = (0, 0)  # (pass within the epoch, position in that pass)
    skipped_total: int = 0  # draws that passed over a benched prompt, the whole run
    _passes: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    @property
    def chunks_per_epoch(self) -> int:
        return self.n // self.batch_size  # RepeatSampler's: the last, incomplete chunk is dropped

    def benched(self, index: int) -> bool:
        return (
            self.streak.get(index, 0) >= self.settings.patience and self.skips.get(index, 0) < self.settings.max_skips
        )

    def epoch_chunks(self, epoch: int) -> Iterator[list[int]]:
        """The chunks of `epoch`, drawn lazily (each as late as the data loader asks for it, so it sees every
        observation made before); the ones already drawn in this epoch (a resume) come first, as they were."""
        if epoch != self.epoch:
            self.epoch, self.drawn, self.cursor = epoch, [], (0, 0)
        yield from list(self.drawn)
        while len(self.drawn) < self.chunks_per_epoch:
            chunk = self._draw()
            self.drawn.append(chunk)
            yield chunk

    def _draw(self) -> list[int]:
        epoch = self.epoch
        if epoch is None:
            raise RuntimeError("Curriculum._draw before epoch_chunks set the epoch")
        chunk: list[int] = []
        while len(chunk) < self.batch_size:
            k, pos = self.cursor
            order = self._pass(epoch, k)
            if pos >= len(order):
                self.cursor = (k + 1, 0)  # this epoch's pass is spent by skips: an overflow pass continues it
                continue
            self.cursor = (k, pos + 1)
            index = order[pos]
            if index in chunk:  # an overflow pass can meet a prompt this chunk already holds
                continue
            if self.benched(index):
                self.skips[index] = self.skips.get(index, 0) + 1
                self.skipped_total += 1
                continue
            chunk.append(index)
        return chunk

    def _pass(self, epoch: int, k: int) -> list[int]:
        """Pass k of an epoch: k = 0 is RepeatSampler's permutation for that epoch (its generator, seeded once,
        draws one permutation per epoch); later passes, needed only when skips spend the first, are seeded
        from (seed, epoch, k)."""
        if (epoch, k) not in self._passes:
            self._passes = {key: v for key, v in self._passes.items() if key[0] == epoch}  # keep this epoch's
            if not self.shuffle:
                order = list(range(self.n))
            elif k == 0:
                import torch

                generator = torch.Generator()
                if self.seed is not None:
                    generator.manual_seed(self.seed)
                for _ in range(epoch + 1):
                    order = torch.randperm(self.n, generator=generator).tolist()
            else:
                order = random.Random(f"{self.seed}/{epoch}/{k}").sample(range(self.n), self.n)
            self._passes[(epoch, k)] = order
        return self._passes[(epoch, k)]

    def observe(self, groups: list[tuple[int, bool]]) -> None:
        """One generation batch's groups: (prompt index, whether its completions' rewards had zero variance)."""
        for index, zero in groups:
            if zero:
                self.streak[index] = self.streak.get(index, 0) + 1
            else:
                self.streak.pop(index, None)
            self.skips.pop(index, None)  # drawn and scored: its sit-out count starts again

    @property
    def benched_now(self) -> int:
        return sum(1 for i in self.streak if self.benched(i))

    def state(self) -> dict:
        return {
            "streak": {str(i): v for i, v in self.streak.items()},
            "skips": {str(i): v for i, v in self.skips.items()},
            "epoch": self.epoch,
            "drawn": self.drawn,
            "cursor": list(self.cursor),
            "skipped_total": self.skipped_total,
            "n": self.n,
            "batch_size": self.batch_size,
        }

    def load(self, state: dict) -> None:
        """A checkpoint's state; one made for other data or another batch shape is not replayed (its chunks
        would not fit), but its benched prompts are kept when the data has the same size."""
        same_data = state.get("n") == self.n
        if same_data:
            self.streak = {int(i): int(v) for i, v in (state.get("streak") or {}).items()}
            self.skips = {int(i): int(v) for i, v in (state.get("skips") or {}).items()}
        if same_data and state.get("batch_size") == self.batch_size:
            self.epoch = state.get("epoch")
            self.drawn = [list(map(int, c)) for c in state.get("drawn") or []]
            self.cursor = tuple(state.get("cursor") or (0, 0))
        self.skipped_total = int(state.get("skipped_total", 0))


def zero_variance_groups(rewards: Any, num_generations: int) -> list[bool]:  # Any: a torch tensor or a list
    """Per group of `num_generations` consecutive rewards: True when they all agree (TRL's `frac_reward_zero_std`
    test: the group's std is close to 0). A group that is all NaN (unscorable) is not counted as zero.

    >>> import torch
    >>> zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2)
    [True, False]
    """
    import torch
    from trl.trainer.utils import nanstd

    std = nanstd(rewards.view(-1, num_generations), dim=1)
    return torch.isclose(std, torch.zeros_like(std)).tolist()


def summarize(log_history: list[dict], curriculum: Curriculum | None) -> ZeroSignal | None:
    """The run's zero-signal figures from HF's log history (in trainer_state.json, so a resumed run counts its
    earlier steps too), the curriculum's when it ran, and with dynamic sampling the fraction of flat groups among
    those trained on (`dynamic_sampling/trained_zero_std`; TRL's `frac_reward_zero_std` then counts every
    generated group).

    >>> summarize([{"step": 1, "frac_reward_zero_std": 0.5}, {"step": 2, "frac_reward_zero_std": 1.0}], None)
    ZeroSignal(mean_fraction=0.75, wasted_steps=1, logged_steps=2, skipped_draws=None, benched_prompts=None, trained_fraction=None, trained_wasted_steps=None)
    >>> summarize([{"step": 1, "frac_reward_zero_std": 0.5, "dynamic_sampling/trained_zero_std": 0.0}], None).trained_fraction
    0.0
    """

    def per_step(metric: str) -> list[float]:
        by_step = {e["step"]: e[metric] for e in log_history if isinstance(e.get(metric), int | float) and "step" in e}
        return list(by_step.values())

    fractions = per_step("frac_reward_zero_std")
    if not fractions:
        return None
    trained = per_step("dynamic_sampling/trained_zero_std")
    return ZeroSignal(
        mean_fraction=sum(fractions) / len(fractions),
        wasted_steps=sum(f >= 1.0 for f in fractions),
        logged_steps=len(fractions),
        skipped_draws=curriculum.skipped_total if curriculum else None,
        benched_prompts=curriculum.benched_now if curriculum else None,
        trained_fraction=sum(trained) / len(trained) if trained else None,
        trained_wasted_steps=sum(f >= 1.0 for f in trained) if trained else None,
    )


def curriculum_sampler(curriculum: Curriculum, mini_repeat_count: int, repeat_count: int) -> Any:  # a torch Sampler
    """A torch Sampler yielding RepeatSampler's index stream for the curriculum's chunks."""
    from torch.utils.data import Sampler

    class CurriculumSampler(Sampler):
        def __init__(self):
            self.next_epoch = 0

        def set_epoch(self, epoch: int) -> None:  # accelerate's DataLoaderShard passes HF's epoch down
            self.next_epoch = epoch

        def __len__(self) -> int:
            return curriculum.chunks_per_epoch * curriculum.batch_size * mini_repeat_count * repeat_count

        def __iter__(self):
            epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
            for chunk in curriculum.epoch_chunks(epoch):
                for _ in range(repeat_count):
                    for index in chunk:
                        for _ in range(mini_repeat_count):
                            yield index

    return CurriculumSampler()


class CurriculumCut:
    """The cut `train.curriculum` of a trainer (TRL's GRPOTrainer): its prompts drawn through a `Curriculum`
    (`sampler`, in place of `_get_train_sampler`), which each training generation's per-group zero-variance verdicts
    feed (`observe`, after `_calculate_rewards`), and whose state goes into each checkpoint (`save`, after
    `_save_checkpoint`). Refuses (ValueError) a streamed dataset: it indexes prompts."""

    def __init__(self, trainer: Any, settings: CurriculumConfig, restored: dict | None = None) -> None:
        from datasets import IterableDataset

        data = trainer.train_dataset
        if isinstance(data, IterableDataset):
            raise ValueError(
                "train.curriculum needs a map-style training dataset (it indexes prompts); "
                "set train.curriculum.enabled=false for a streamed one"
            )
        self.curriculum = Curriculum(
            n=len(data),
            batch_size=trainer.args.generation_batch_size // trainer.num_generations,
            seed=trainer.args.seed,
            settings=settings,
            shuffle=trainer.shuffle_dataset,
        )
        if restored:
            self.curriculum.load(restored)
        self._indices_of: dict[str, list[int]] = {}
        for index, prompt in enumerate(data["prompt"]):  # a prompt repeated in the data shares its record
            self._indices_of.setdefault(prompt_key(prompt), []).append(index)

    def sampler(self, trainer: Any) -> Any:  # a torch Sampler
        return curriculum_sampler(
            self.curriculum, trainer.num_generations, trainer.num_iterations * trainer.args.steps_per_generation
        )

    def observe(self, trainer: Any, inputs: list[dict], rewards_per_func: Any) -> None:
        """A training generation's rewards (TRL's `_calculate_rewards`: every rank's rows, rank by rank)."""
        from accelerate.utils import gather_object

        if not trainer.model.training:
            return
        keys = gather_object([prompt_key(x["prompt"]) for x in inputs])  # so are the keys: every rank's
        weights = trainer.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        zero = zero_variance_groups(rewards, trainer.num_generations)
        g = trainer.num_generations
        self.curriculum.observe(
            [(i, z) for k, z in zip(keys[::g], zero, strict=True) for i in self._indices_of.get(k, [])]
        )
        trainer._metrics["train"]["curriculum/benched_prompts"].append(float(self.curriculum.benched_now))
        trainer._metrics["train"]["curriculum/skipped_draws"].append(float(self.curriculum.skipped_total))

    def save(self, trainer: Any) -> None:
        """The curriculum's state beside the checkpoint TRL just saved, before the callbacks (`CheckpointSync`) upload
        it."""
        folder = Path(trainer.args.output_dir) / checkpoint_name(trainer.state.global_step)
        if trainer.is_world_process_zero() and folder.is_dir():
            (folder / STATE_FILE).write_text(json.dumps(self.curriculum.state()))
