"""The requests the router answered while the A/B log store was unreachable: a local write-ahead file, replayed
into the store as soon as a write succeeds again, and counted by `grpo-pipeline ab status` meanwhile.

A request is never silently dropped: when `RequestLog.record` fails mid-run, the row goes to
`<data_dir>/ab/unlogged.jsonl` (appended, flushed and fsynced before the response returns), and the next
successful write replays the file. Replaying is safe to repeat: the request id is the log's primary key, so a
row written twice is one row. An exclusive `flock` serialises appends and replays between threads and between
routers sharing the folder.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import IO

from grpo_pipeline.tasks.serve.ab_log import RequestLog, RequestRow


def spool_path(data_dir: Path) -> Path:
    return Path(data_dir) / "ab" / "unlogged.jsonl"


@contextmanager
def _locked(path: Path) -> Iterator[IO[str]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def append(path: Path, row: RequestRow) -> None:
    """Keep the row on local disk until the store takes it (durable before the response returns)."""
    line = json.dumps({**asdict(row), "created_at": row.created_at.isoformat() if row.created_at else None})
    with _locked(path) as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def pending(path: Path) -> int:
    """How many answered requests wait for the store (0 when the file is absent)."""
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def replay(path: Path, log: RequestLog) -> int:
    """Write the spooled rows to the store and empty the file; the rows written now (a row already there is
    skipped). Raises `LogStoreError` (and keeps the file) while the store is still unreachable."""
    if not path.exists():
        return 0
    written = 0
    with _locked(path) as f:
        f.seek(0)
        for line in f:
            if line.strip():
                raw = json.loads(line)
                raw["created_at"] = datetime.fromisoformat(raw["created_at"]) if raw["created_at"] else None
                written += log.record(RequestRow(**raw))
        f.truncate(0)
    return written
