"""One attempt owns a job's checkpoint store at a time: a relaunch fences off any attempt still running.

A managed spot job is relaunched on a new machine when the old one stops answering, and a machine that
stops answering is not always dead: a network partition, a hung host that wakes up. Its ranks then train on
beside the relaunch and write to the same store: checkpoints of another trajectory, their metrics into the
same MLflow run, a `final` that is not the relaunch's. Ranks die with their parent on one machine
(`grpo_pipeline.trainer.launch.rank_lifeline`); across machines only the store both attempts write to can
tell them apart.

So each attempt, when it starts, claims the store: it writes `attempt.json` with an epoch one above the one
it found and a token of its own, by a compare-and-swap (S3's conditional PUT; a lock file on a local store),
so of two attempts starting at once one claims first and the other claims on top of it. Before every write
(a checkpoint, the rollback ledger, a deletion, `final`) an attempt reads the record back; if another
attempt's token is there, it raises `Superseded` and writes nothing more: the trainer exits with
EXIT_SUPERSEDED, which no launcher relaunches. What is left open is the moment between that read and the
write it guards (one checkpoint at the most, complete and verifiable, of the same job): a record read per
write keeps the cost at one small GET per checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from grpo_pipeline.trainer.checkpoints import CheckpointStoreError, Store

ATTEMPT = "attempt.json"
EXIT_SUPERSEDED = 3  # a newer attempt owns the store: no launcher relaunches this one
_CLAIM_TRIES = 20  # each lost race means another attempt claimed meanwhile: claim on top of it


class Superseded(CheckpointStoreError):
    """A newer attempt owns the store: this one must write nothing more."""


@dataclass(frozen=True)
class Claim:
    epoch: int
    token: str
    host: str
    pid: int
    since: str

    def describe(self) -> str:
        return f"epoch {self.epoch} ({self.host} pid {self.pid}, since {self.since})"


def next_claim(current: dict | None, *, token: str, host: str, pid: int, now: datetime) -> Claim:
    """The claim that follows the record read from the store (None: no attempt before).

    >>> t = datetime(2026, 12, 1, tzinfo=UTC)
    >>> next_claim(None, token="a", host="h", pid=1, now=t).epoch
    1
    >>> next_claim({"epoch": 4, "token": "x"}, token="b", host="h", pid=1, now=t).describe()
    'epoch 5 (h pid 1, since 2026-12-01T00:00:00+00:00)'
    """
    epoch = current.get("epoch") if isinstance(current, dict) else None
    previous = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else 0
    return Claim(previous + 1, token, host, pid, now.isoformat())


def _parse(body: bytes | None) -> dict | None:
    if body is None:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return {}  # unreadable: claimed over like an empty record, never trusted as an owner
    return record if isinstance(record, dict) else {}


class FencedStore:
    """A store whose every write first checks that this attempt still owns it (see the module's text).
    Reads pass through; only the process that writes (rank 0) wraps its store."""

    def __init__(self, store: Store, claim: Claim):
        self.store, self.claim = store, claim

    def __repr__(self) -> str:
        return repr(self.store)

    # the reads pass through
    def complete_steps(self) -> list[int]:
        return self.store.complete_steps()

    def entry_steps(self) -> list[int]:
        return self.store.entry_steps()

    def has(self, name: str) -> bool:
        return self.store.has(name)

    def fetch(self, name: str, scratch: Path) -> Path:
        return self.store.fetch(name, scratch)

    def read_record(self, name: str) -> tuple[bytes | None, str | None]:
        return self.store.read_record(name)

    def check_owner(self) -> None:
        record = _parse(self.store.read_record(ATTEMPT)[0])
        if record is not None and record.get("token") == self.claim.token:
            return
        if record is None:
            owner = "nobody: its attempt record is gone (the store was cleared or moved)"
        else:
            owner = (
                f"epoch {record.get('epoch')} ({record.get('host')} pid {record.get('pid')}, "
                f"since {record.get('since')})"
            )
        raise Superseded(
            f"{self.store!r} is now owned by {owner}; this attempt, {self.claim.describe()}, stops "
            "without writing, so the store holds only the newer attempt's checkpoints and final. "
            "Nothing to fix if a relaunch took over; otherwise two jobs share this checkpoint URI: "
            "give each its own"
        )

    def put(self, local_dir: Path, name: str, step: int) -> None:
        self.check_owner()
        self.store.put(local_dir, name, step)

    def delete(self, name: str) -> None:
        self.check_owner()
        self.store.delete(name)

    def move_aside(self, name: str, reason: str) -> str | None:
        self.check_owner()
        return self.store.move_aside(name, reason)


def claim_store(store: Store) -> FencedStore:
    """Claim the store for this attempt (epoch one above the last) and return it fenced."""
    for _ in range(_CLAIM_TRIES):
        body, tag = store.read_record(ATTEMPT)
        claim = next_claim(
            _parse(body), token=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(), now=datetime.now(UTC)
        )
        record = {
            "epoch": claim.epoch,
            "token": claim.token,
            "host": claim.host,
            "pid": claim.pid,
            "since": claim.since,
        }
        if store.write_record(ATTEMPT, json.dumps(record, indent=1).encode(), tag):
            return FencedStore(store, claim)
    raise CheckpointStoreError(f"could not claim {store!r}: {_CLAIM_TRIES} other attempts claimed it meanwhile")
