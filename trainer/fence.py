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
EXIT_SUPERSEDED (trainer/spec.py), which no launcher relaunches. What is left open is the moment between that read and the
write it guards (one checkpoint at the most, complete and verifiable, of the same job): a record read per
write keeps the cost at one small GET per checkpoint.

The fence tells attempts apart, not jobs: two SkyPilot managed jobs configured with one checkpoint URI would
each claim the store at every recovery, superseding the other, and (SkyPilot restarts a job that exits with
an error) ping-pong until their restarts run out. So a claim also records the job it belongs to (SkyPilot's
`SKYPILOT_TASK_ID`, the same across a managed job's recoveries up to the timestamp SkyPilot puts first), and
an attempt of another job claims only a store whose owner has finished (`final` is in it) or was released by
a launcher that saw that job end (`release`): otherwise it raises `StoreTaken`, naming both jobs, and the
trainer exits 2 (bad input), which the SkyPilot launcher cancels instead of recovering. The other job,
never superseded, trains on. Outside SkyPilot an attempt has no job identity and claims as before.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from grpo_pipeline.trainer.checkpoints import FINAL, CheckpointStoreError, Store

ATTEMPT = "attempt.json"
JOB_ENV = "SKYPILOT_TASK_ID"  # a managed job's identity, the same for all its recoveries (see `same_job`)
_CLAIM_TRIES = 20  # each lost race means another attempt claimed meanwhile: claim on top of it


class Superseded(CheckpointStoreError):
    """A newer attempt owns the store: this one must write nothing more."""


class StoreTaken(CheckpointStoreError):
    """Another job, not finished, owns the store: two jobs share one checkpoint URI. Bad input (exit 2)."""


_TASK_ID = re.compile(r"^(?:sky-managed|managed-sky|sky)-[0-9-]+_(?P<job>.+)$")
_MANAGED_ID = re.compile(r"_(?P<id>\d+)-\d+$")


def job_key(task_id: str) -> str:
    """What stays the same across one managed job's recoveries: its task id without the timestamp in front
    (SkyPilot's docs say the whole id stays; some versions stamp a new time at a recovery).

    >>> job_key("sky-managed-2026-12-01-03-00-00-123456_grpo-run_14-0"), job_key("my-own-id")
    ('grpo-run_14-0', 'my-own-id')
    """
    match = _TASK_ID.match(task_id)
    return match["job"] if match else task_id


def managed_job_id(task_id: str | None) -> int | None:
    """The managed job's number in SkyPilot's queue, from its task id (`..._<job id>-<task index>`).

    >>> managed_job_id("sky-managed-2026-12-01-03-00-00-123456_grpo-run_14-0"), managed_job_id("local")
    (14, None)
    """
    match = _MANAGED_ID.search(task_id or "")
    return int(match["id"]) if match else None


def same_job(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and job_key(a) == job_key(b)


def refusal(current: dict | None, job: str | None, *, finished: bool, where: str) -> str | None:
    """Why this job may not claim the store, or None: the store's owner is another job that has not finished
    (no `final`) and that no launcher released. A record without a job (a local attempt, or one from before
    jobs were recorded) and an attempt without one never refuse: the epoch fence alone decides.

    >>> other = {"epoch": 3, "job": "sky-managed-2026-12-01-03-00-00-1_a_7-0", "host": "h", "since": "t"}
    >>> refusal(other, "sky-managed-2026-12-01-04-00-00-1_a_7-0", finished=False, where="s3://b/r") is None
    True
    >>> refusal(other, "sky-managed-2026-12-01-04-00-00-1_b_9-0", finished=False, where="s3://b/r")[:90]
    's3://b/r belongs to another job, sky-managed-2026-12-01-03-00-00-1_a_7-0 (epoch 3 on h sin'
    >>> refusal(other, "sky-managed-x_b_9-0", finished=True, where="s3://b/r") is None
    True
    """
    if not isinstance(current, dict):
        return None
    owner = current.get("job")
    if not isinstance(owner, str) or job is None or same_job(owner, job) or finished or current.get("release"):
        return None
    owner = owner[:200]  # the store's text: shown, never trusted to be short
    return (
        f"{where} belongs to another job, {owner} (epoch {current.get('epoch')} on {current.get('host')} since "
        f"{current.get('since')}), which has not finished; this job, {job}, would supersede it and be "
        "superseded back at each recovery. Give each job its own train.checkpoint_uri (or run name); if job "
        f"{owner} has ended, launch again through the pipeline's SkyPilot launcher, which releases the store "
        f"of a job SkyPilot reports ended, or delete {where.rstrip('/')}/{ATTEMPT}"
    )


@dataclass(frozen=True)
class Claim:
    epoch: int
    token: str
    host: str
    pid: int
    since: str
    job: str | None = None  # the managed job's task id; None outside SkyPilot

    def describe(self) -> str:
        job = f", job {self.job}" if self.job else ""
        return f"epoch {self.epoch} ({self.host} pid {self.pid}{job}, since {self.since})"


def next_claim(
    current: dict | None, *, token: str, host: str, pid: int, now: datetime, job: str | None = None
) -> Claim:
    """The claim that follows the record read from the store (None: no attempt before).

    >>> t = datetime(2026, 12, 1, tzinfo=UTC)
    >>> next_claim(None, token="a", host="h", pid=1, now=t).epoch
    1
    >>> next_claim({"epoch": 4, "token": "x"}, token="b", host="h", pid=1, now=t).describe()
    'epoch 5 (h pid 1, since 2026-12-01T00:00:00+00:00)'
    """
    epoch = current.get("epoch") if isinstance(current, dict) else None
    previous = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else 0
    return Claim(previous + 1, token, host, pid, now.isoformat(), job)


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
            job = f", job {record['job']}" if record.get("job") else ""
            owner = (
                f"epoch {record.get('epoch')} ({record.get('host')} pid {record.get('pid')}{job}, "
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


def claim_store(store: Store, job: str | None = None) -> FencedStore:
    """Claim the store for this attempt (epoch one above the last) and return it fenced; `StoreTaken` when
    another job that has not finished owns it (`refusal`). `job`: this attempt's job, by default SkyPilot's
    task id from the environment (None outside SkyPilot)."""
    job = job if job is not None else (os.environ.get(JOB_ENV) or None)
    for _ in range(_CLAIM_TRIES):
        body, tag = store.read_record(ATTEMPT)
        current = _parse(body)
        where = str(getattr(store, "uri", None) or getattr(store, "root", None) or store)  # as configured
        refused = refusal(current, job, finished=job is not None and store.has(FINAL), where=where)
        if refused:
            raise StoreTaken(refused)
        claim = next_claim(
            current, token=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(), now=datetime.now(UTC), job=job
        )
        record = {
            "epoch": claim.epoch,
            "token": claim.token,
            "host": claim.host,
            "pid": claim.pid,
            "since": claim.since,
            **({"job": job} if job else {}),
        }
        if store.write_record(ATTEMPT, json.dumps(record, indent=1).encode(), tag):
            return FencedStore(store, claim)
    raise CheckpointStoreError(f"could not claim {store!r}: {_CLAIM_TRIES} other attempts claimed it meanwhile")


def release(store: Store, job: str, why: str) -> bool:
    """Mark the store's record released when it still belongs to `job` (which a launcher saw end), so that
    another job may claim it; False when the record changed meanwhile (a claim came first: nothing released).
    The owner's epoch and token stay: should the ended job's attempt still write, the next claim fences it."""
    body, tag = store.read_record(ATTEMPT)
    record = _parse(body)
    if not record or record.get("job") != job:
        return False
    record["release"] = why
    return store.write_record(ATTEMPT, json.dumps(record, indent=1).encode(), tag)
