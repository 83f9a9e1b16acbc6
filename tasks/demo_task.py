"""The embedded demo task: arithmetic questions whose answers a reward checks exactly.

Every (a, b) pair is assigned to a split by a hash of the pair itself, so the holdout never shares a
question with training, and growing `max_operand` keeps every old pair in the split it had.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from prefect import task

from grpo_pipeline.config import DemoTaskConfig

PROMPT = "What is {a} + {b}? Reply with just the number."
HOLDOUT_SHARE = 0.3
VAL_SHARE = 0.1


def split_of(key: str) -> str:
    """'holdout', 'val' or 'train', decided by a stable hash of the row's key.

    >>> split_of("3+4") == split_of("3+4")
    True
    """
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    if bucket < HOLDOUT_SHARE:
        return "holdout"
    return "val" if bucket < HOLDOUT_SHARE + VAL_SHARE else "train"


def make_row(a: int, b: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
        "answer": str(a + b),
        "key": f"{a}+{b}",
    }


def generate(cfg: DemoTaskConfig) -> dict[str, list[dict]]:
    """Train rows sampled (with repeats) from the train pairs; val and holdout rows are distinct pairs.

    >>> splits = generate(DemoTaskConfig(max_operand=9, n_train=50, n_val=4, n_holdout=10))
    >>> [len(splits[s]) for s in ("train", "val", "holdout")]
    [50, 4, 10]
    >>> not {r["key"] for r in splits["train"]} & {r["key"] for r in splits["holdout"]}
    True
    """
    pools: dict[str, list[tuple[int, int]]] = {"train": [], "val": [], "holdout": []}
    for a in range(cfg.max_operand + 1):
        for b in range(cfg.max_operand + 1):
            pools[split_of(f"{a}+{b}")].append((a, b))
    rng = random.Random(cfg.seed)
    wanted = {"val": cfg.n_val, "holdout": cfg.n_holdout}
    for split, n in wanted.items():
        if n > len(pools[split]):
            raise ValueError(
                f"data.demo.n_{split}={n} but max_operand={cfg.max_operand} gives only "
                f"{len(pools[split])} distinct {split} questions; lower n_{split} or raise max_operand"
            )
    splits = {split: [make_row(*p) for p in rng.sample(pools[split], n)] for split, n in wanted.items()}
    splits["train"] = [make_row(*rng.choice(pools["train"])) for _ in range(cfg.n_train)]
    return splits


def write_splits(splits: dict[str, list[dict]], directory: Path) -> dict[str, Path]:
    """Write each split as JSONL; returns split name -> path."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        path = directory / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[split] = path
    return paths


def fingerprint(splits: dict[str, Path]) -> str:
    """A content hash over every split file, so a model version names exactly the data it saw."""
    digest = hashlib.sha256()
    for name in sorted(splits):
        digest.update(name.encode() + b"\0" + Path(splits[name]).read_bytes())
    return digest.hexdigest()[:16]


@task(name="demo-data")
def demo_data_task(cfg: DemoTaskConfig, directory: Path) -> dict[str, Path]:
    return write_splits(generate(cfg), directory)
