"""The deterministic split every data source shares, and the split files: a row's split is a stable hash of
its key alone, so the holdout never shares a question with training and a growing dataset never moves a row. A
split file is JSONL, one row a line (`jsonl_line`)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import orjson

SPLITS = ("train", "val", "holdout")
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


# Characters that str.splitlines() breaks lines at but JSON leaves unescaped (orjson escapes the ASCII ones).
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def jsonl_line(obj: Any) -> bytes:
    r"""One JSON line that every line splitter reads as one line (GSM8K has U+2028 inside questions).

    >>> jsonl_line({"q": "a\u2028b"})
    b'{"q":"a\\u2028b"}\n'
    """
    line = orjson.dumps(obj, default=str)
    for raw, escaped in _LINE_BREAKS:
        line = line.replace(raw, escaped)
    return line + b"\n"


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


def replay_rank(key: str, salt: str) -> int:
    """A row's place in the replay order: a hash of its key and `salt`, so the sample depends on the rows'
    content alone (not on their order in the source) and is the same on a rerun."""
    return int.from_bytes(hashlib.sha256(f"{salt}\0{key}".encode()).digest()[:8], "big")


def incremental_rows(
    rows: list[dict], seen: set[str], replay_fraction: float, salt: str
) -> tuple[list[dict], int, int]:
    """The train rows of an incremental run: every row whose key is not in `seen` (the keys the parent adapter's
    lineage trained on), plus `replay_fraction` of the seen ones (rounded up), picked by `replay_rank`; in the
    rows' own order. Returns (rows, new, replayed).

    >>> rows = [{"key": k} for k in "abcdef"]
    >>> picked, new, replayed = incremental_rows(rows, {"a", "b", "c", "d"}, 0.5, "v1")
    >>> new, replayed, [r["key"] for r in picked if r["key"] in "ef"]
    (2, 2, ['e', 'f'])
    >>> incremental_rows(rows, {"a", "b", "c", "d"}, 0.5, "v1") == (picked, new, replayed)
    True
    """
    old = [r["key"] for r in rows if r["key"] in seen]
    count = math.ceil(replay_fraction * len(old))
    replay = set(sorted(old, key=lambda k: replay_rank(k, salt))[:count])
    picked = [r for r in rows if r["key"] not in seen or r["key"] in replay]
    return picked, len(rows) - len(old), len(replay)
