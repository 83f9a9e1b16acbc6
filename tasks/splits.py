"""The deterministic split every data source shares, and the split files: a row's split is a stable hash of
its key alone, so the holdout never shares a question with training and a growing dataset never moves a row."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

HOLDOUT_SHARE = 0.3
VAL_SHARE = 0.1


def split_of(key: str, holdout_share: float = HOLDOUT_SHARE, val_share: float = VAL_SHARE) -> str:
    """'holdout', 'val' or 'train', decided by a stable hash of the row's key.

    The key's hash is a point in [0, 1): below `holdout_share` is holdout, then `val_share` of val, the
    rest train. A row's split depends only on its own key, so adding rows never moves another row.

    >>> split_of("3+4") == split_of("3+4")
    True
    >>> split_of("3+4", holdout_share=0.999999, val_share=0.0)
    'holdout'
    """
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    if bucket < holdout_share:
        return "holdout"
    return "val" if bucket < holdout_share + val_share else "train"


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
