"""The embedded demo task: arithmetic questions whose answers a reward checks exactly.

Every (a, b) pair is assigned to a split by a hash of the pair itself, so the holdout never shares a
question with training, and growing `max_operand` keeps every old pair in the split it had. The data
stage (`grpo_pipeline.tasks.data.stage`) splits every source by the same `grpo_pipeline.tasks.data.splits.split_of`, so the demo rows go through
its chain unchanged.
"""

from __future__ import annotations

import random

from grpo_pipeline.configs.schema import DemoTaskConfig
from grpo_pipeline.tasks.data.splits import HOLDOUT_SHARE, VAL_SHARE, split_of

PROMPT = "What is {a} + {b}? Reply with just the number."


def make_row(a: int, b: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
        "answer": str(a + b),
        "key": f"{a}+{b}",
    }


def generate(
    cfg: DemoTaskConfig, holdout_share: float = HOLDOUT_SHARE, val_share: float = VAL_SHARE
) -> dict[str, list[dict]]:
    """Distinct questions per split: up to `n_train` train pairs (all of them when fewer exist; the
    trainer's max_steps decides how many it uses), `n_val` val and `n_holdout` holdout pairs.

    Every row is a distinct pair, so the data stage's exact dedup keeps them all; sampling train rows
    with repeats would only give dedup something to drop.

    >>> splits = generate(DemoTaskConfig(max_operand=9, n_train=50, n_val=4, n_holdout=10))
    >>> [len(splits[s]) for s in ("train", "val", "holdout")]
    [50, 4, 10]
    >>> len({r["key"] for r in splits["train"]})
    50
    >>> not {r["key"] for r in splits["train"]} & {r["key"] for r in splits["holdout"]}
    True
    """
    pools: dict[str, list[tuple[int, int]]] = {"train": [], "val": [], "holdout": []}
    for a in range(cfg.max_operand + 1):
        for b in range(cfg.max_operand + 1):
            pools[split_of(f"{a}+{b}", holdout_share, val_share)].append((a, b))
    rng = random.Random(cfg.seed)
    wanted = {"val": cfg.n_val, "holdout": cfg.n_holdout}
    for split, n in wanted.items():
        if n > len(pools[split]):
            raise ValueError(
                f"data.demo.n_{split}={n} but max_operand={cfg.max_operand} gives only "
                f"{len(pools[split])} distinct {split} questions; lower n_{split} or raise max_operand"
            )
    splits = {split: [make_row(*p) for p in rng.sample(pools[split], n)] for split, n in wanted.items()}
    splits["train"] = [make_row(*p) for p in rng.sample(pools["train"], min(cfg.n_train, len(pools["train"])))]
    return splits
