"""Checkpoint store: a local directory or an `s3://bucket/prefix`, where a checkpoint counts once its manifest is in.

Layout: `<root>/<entry>/<files...>` and `<root>/<entry>/manifest.json`, the manifest written last; an
entry is `checkpoint-<step>`, `final` (the finished adapter and the job's result) or `init-adapter` (the adapter
a warm start continues, for a node that cannot read the pipeline's disk; checked against the job spec's hashes,
`fetch_init_adapter`). An entry cut off by a preemption has no manifest and is never used. A resume (`choose_resume`) verifies the newest complete
checkpoint against its manifest (every file's size and sha256) and falls back to the newest one that
verifies; one that does not is moved aside to `<root>/corrupt/<entry>-<UTC time>/`, with `REASON.txt`.

Names read from a store are data, never trusted as paths: a manifest's file names and the keys an S3 listing
gives must be relative, with no `..`, `.` or empty part, and must resolve inside their entry's directory
(`safe_relative`, `inside`). A manifest that breaks this (hostile, or damaged) makes its checkpoint corrupt:
nothing is written for it, it is moved aside with its reason and the resume goes on from the newest good one.

An upload that fails removes what it wrote (its objects, its directory); `prune` also removes entries cut off
by a kill (no manifest) once a newer checkpoint is complete.

One module, past the ~600 lines a module is cut at, on purpose: the manifest rules, the two stores and the resume are
one contract. Each store enforces the name rules (`safe_relative`, `inside`) and the entry patterns on its own
listing, `choose_resume` and `prune` are written against both, and a reader checks a rule against every store it
binds in one place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from grpo_pipeline.trainer.s3 import s3_client
from grpo_pipeline.trainer.spec import RESULT_FILE, JobSpec, TrainResult

MANIFEST = "manifest.json"
FINAL = "final"
INIT_ADAPTER = "init-adapter"  # a warm start's adapter, uploaded by a launcher whose node cannot read it locally
METRICS_FILE = "metrics.json"  # in `final` and each checkpoint: the steps' metrics, for MLflow
CORRUPT = "corrupt"  # <root>/corrupt/<entry>-<UTC time>/: checkpoints that failed verification, kept for a look
REASON_FILE = "REASON.txt"
_STEP = re.compile(r"checkpoint-(\d+)/" + re.escape(MANIFEST))  # matched from the root, so corrupt/... never counts
_ENTRY = re.compile(r"checkpoint-(\d+)(?:/.*)?", re.DOTALL)  # any object or directory of a checkpoint entry
_SHA256 = re.compile(r"[0-9a-f]{64}")
# What an S3 server answers for a key it will not take (a `..` part, a key too long): a fault of the name the
# manifest gave, so of the checkpoint, never of the network or the credentials.
_BAD_KEY = ("400", "InvalidArgument", "InvalidObjectName", "KeyTooLongError", "XMinioInvalidObjectName")
log = logging.getLogger(__name__)


class CheckpointStoreError(RuntimeError):
    pass


class CheckpointCorrupt(CheckpointStoreError):
    """A complete checkpoint (its manifest is there) that does not match its manifest: a file missing,
    truncated or changed, or the manifest itself unreadable. Not raised for a store that cannot be reached."""


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:  # streamed: optimizer states can be larger than the memory to spare
        return hashlib.file_digest(fh, "sha256").hexdigest()


def build_manifest(directory: Path, step: int) -> dict:
    """Describe every file of a checkpoint directory (size and sha256), so a reader can verify it."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return {"step": step, "created": datetime.now(UTC).isoformat(), "files": files}


def safe_relative(name: object, origin: str) -> str:
    """`name`, read from a store, as a relative path that cannot leave its directory; `CheckpointCorrupt` if not.

    Strict on purpose: only the canonical form `a/b/c` passes, so that no S3 server's or filesystem's own
    normalisation (`a//b`, `./a`, `a/../b`) can make two readers see different files.

    >>> safe_relative("sub/state.json", "the manifest of s3://b/p/checkpoint-2")
    'sub/state.json'
    >>> try: safe_relative("../../home/me/.bashrc", "the manifest of s3://b/p/checkpoint-2")
    ... except CheckpointCorrupt as error: print(error)
    the manifest of s3://b/p/checkpoint-2 names '../../home/me/.bashrc', which has a '..' part; a name read from a store must be a relative path inside its directory (a/b/c), so the checkpoint is treated as corrupt
    >>> try: safe_relative("/etc/cron.d/x", "the manifest of /ckpt/checkpoint-2")
    ... except CheckpointCorrupt as error: print(error)
    the manifest of /ckpt/checkpoint-2 names '/etc/cron.d/x', which is absolute; a name read from a store must be a relative path inside its directory (a/b/c), so the checkpoint is treated as corrupt
    """
    if not isinstance(name, str) or not name:
        problem = "is not a file name"
    elif "\0" in name:
        problem = "holds a NUL character"
    elif name.startswith("/"):
        problem = "is absolute"
    elif ".." in (parts := name.split("/")):
        problem = "has a '..' part"
    elif "" in parts or "." in parts:
        problem = "has an empty or '.' part"
    else:
        return name
    raise CheckpointCorrupt(
        f"{origin} names {name!r}, which {problem}; a name read from a store must be a relative "
        "path inside its directory (a/b/c), so the checkpoint is treated as corrupt"
    )


def inside(directory: Path, name: str) -> Path:
    """`directory / name` once it is sure to resolve inside `directory` (a symlink on the way could point out)."""
    path = directory / name
    root = directory.resolve()
    if not path.resolve().is_relative_to(root):
        raise CheckpointCorrupt(
            f"checkpoint file {path} resolves to {path.resolve()}, outside {root} (a symlink); "
            "the checkpoint is treated as corrupt"
        )
    return path


def manifest_files(manifest: dict, where: str) -> dict[str, tuple[int, str]]:
    """The files a manifest lists, `name -> (size, sha256)`, each name checked by `safe_relative`; any flaw
    (a missing size, a name that is both a file and another's directory) is `CheckpointCorrupt`.

    >>> manifest_files({"files": {"a/b.bin": {"size": 3, "sha256": "0" * 64}}}, "x")
    {'a/b.bin': (3, '0000000000000000000000000000000000000000000000000000000000000000')}
    >>> try: manifest_files({"files": {"a": {"size": 1, "sha256": "0" * 64}, "a/b": {"size": 1, "sha256": "0" * 64}}}, "x")
    ... except CheckpointCorrupt as error: print(error)
    the manifest of x names 'a' both as a file and as the directory of 'a/b'
    """
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointCorrupt(f"the manifest of {where} lists no files")
    out: dict[str, tuple[int, str]] = {}
    for name, meta in files.items():
        safe_relative(name, f"the manifest of {where}")
        size, sha = (meta.get("size"), meta.get("sha256")) if isinstance(meta, dict) else (None, None)
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or size < 0
            or not isinstance(sha, str)
            or not _SHA256.fullmatch(sha)
        ):
            raise CheckpointCorrupt(f"the manifest of {where} gives {name!r} no valid size and sha256: {meta!r:.200}")
        out[name] = (size, sha)
    for name in out:
        parents = name.split("/")[:-1]
        for i in range(1, len(parents) + 1):
            if (parent := "/".join(parents[:i])) in out:
                raise CheckpointCorrupt(
                    f"the manifest of {where} names {parent!r} both as a file and as the directory of {name!r}"
                )
    return out


def verify(directory: Path, manifest: dict) -> None:
    """Every file the manifest lists is there, whole and unchanged; a resume never starts from a bad copy."""
    for name, (size, sha) in manifest_files(manifest, str(directory)).items():
        path = inside(directory, name)
        if not path.is_file():
            raise CheckpointCorrupt(f"checkpoint file {path} is missing or truncated (it is missing)")
        if path.stat().st_size != size:
            raise CheckpointCorrupt(
                f"checkpoint file {path} is missing or truncated ({path.stat().st_size:,} bytes, "
                f"the manifest says {size:,})"
            )
        if _sha256(path) != sha:
            raise CheckpointCorrupt(f"checkpoint file {path} does not match its manifest's sha256")


def _read_manifest(raw: bytes, where: str) -> dict:
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"the manifest of {where} is not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"the manifest of {where} is not a JSON object")
    return manifest


def steps_with_manifest(keys: list[str]) -> list[int]:
    """Steps whose manifest is present, ascending; `keys` are relative to the store's root.

    >>> steps_with_manifest(["checkpoint-4/a.bin", "checkpoint-2/manifest.json", "checkpoint-10/manifest.json",
    ...                      "corrupt/checkpoint-12-20260101T000000Z/manifest.json"])
    [2, 10]
    """
    return sorted(int(m.group(1)) for k in keys if (m := _STEP.fullmatch(k)))


def entry_steps(keys: list[str]) -> list[int]:
    """Steps with anything in the store (complete or cut off), ascending; `keys` are relative to the root.

    >>> entry_steps(["checkpoint-4/a.bin", "checkpoint-2/manifest.json", "checkpoint-10", "final/manifest.json",
    ...              "corrupt/checkpoint-12-20260101T000000Z/a.bin"])
    [2, 4, 10]
    """
    return sorted({int(m.group(1)) for k in keys if (m := _ENTRY.fullmatch(k))})


def incomplete_to_prune(entries: list[int], complete: list[int]) -> list[int]:
    """Entries without a manifest older than the newest complete checkpoint: cut off by a kill or a failed
    upload, never to be used (a resume takes a newer one), so only their space is left. A newer one may be an
    upload in flight or the next save of the same step, and stays.

    >>> incomplete_to_prune([2, 3, 4, 6, 7], [2, 4, 6])
    [3]
    >>> incomplete_to_prune([3, 5], [])
    []
    """
    newest = max(complete, default=None)
    done = set(complete)
    return [s for s in entries if newest is not None and s < newest and s not in done]


def _aside_name(name: str) -> str:
    return f"{CORRUPT}/{name}-{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}"


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def read_checkpoint_json(checkpoint: Path | None, name: str) -> dict:
    """A state file a checkpoint holds beside the model's (the health monitor's `health.json`, the curriculum's
    `curriculum.json`); empty for no checkpoint, or one written without it.

    >>> read_checkpoint_json(None, "health.json")
    {}
    """
    path = Path(checkpoint) / name if checkpoint else None
    return json.loads(path.read_text()) if path and path.is_file() else {}


class LocalStore:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()

    def __repr__(self) -> str:
        return f"LocalStore({self.root})"

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / ".write-probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise CheckpointStoreError(f"checkpoint directory {self.root} is not writable: {exc}") from None

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return steps_with_manifest(
            [p.relative_to(self.root).as_posix() for p in self.root.glob(f"checkpoint-*/{MANIFEST}")]
        )

    def entry_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return entry_steps([p.name for p in self.root.glob("checkpoint-*")])

    def has(self, name: str) -> bool:
        return (self.root / name / MANIFEST).is_file()

    def put(self, local_dir: Path, name: str, step: int) -> None:
        """Copy a checkpoint in, manifest last; on a failure (a full disk) nothing of it stays."""
        manifest = build_manifest(local_dir, step)
        dest = self.root / name
        shutil.rmtree(dest, ignore_errors=True)
        try:
            for file in manifest["files"]:
                (dest / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(local_dir / file, dest / file)
            tmp = dest / f".{MANIFEST}.tmp"
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, dest / MANIFEST)  # atomic: the manifest is there whole or not at all
        except Exception:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    def fetch(self, name: str, scratch: Path) -> Path:
        directory = self.root / name
        try:
            raw = (directory / MANIFEST).read_bytes()
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{directory} has no manifest (moved aside or deleted meanwhile)") from None
        verify(directory, _read_manifest(raw, str(directory)))
        return directory

    def delete(self, name: str) -> None:
        directory = self.root / name
        (directory / MANIFEST).unlink(missing_ok=True)  # first: it stops counting before files go
        shutil.rmtree(directory, ignore_errors=True)

    def read_record(self, name: str) -> tuple[bytes | None, str | None]:
        """A small object at the root (`attempt.json`) and a tag that changes with each write (None: absent)."""
        try:
            body = (self.root / name).read_bytes()
        except FileNotFoundError:
            return None, None
        return body, hashlib.sha256(body).hexdigest()

    def write_record(self, name: str, body: bytes, expect: str | None) -> bool:
        """Write `name` only if it is still as read (`expect`: its tag, None for absent); False if another
        writer came first. A lock file serialises writers on this filesystem; the rename is atomic."""
        import fcntl  # POSIX only: the rest of the module (and the CLI that imports it) loads anywhere

        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.read_record(name)[1] != expect:
                return False
            tmp = self.root / f".{name}.tmp"
            tmp.write_bytes(body)
            os.replace(tmp, self.root / name)
        return True

    def move_aside(self, name: str, reason: str) -> str | None:
        """Move an entry to corrupt/<name>-<time>/ with REASON.txt; its location, or None if it was gone."""
        aside = self.root / _aside_name(name)
        aside.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(self.root / name, aside)  # atomic: another rank moving it too finds it gone
        except FileNotFoundError:
            return None
        (aside / REASON_FILE).write_text(reason + "\n")
        return str(aside)


class S3Store:
    """Any S3 API (AWS, MinIO, SeaweedFS) through boto3."""

    def __init__(self, uri: str, endpoint_url: str | None = None, client: Any = None):  # a boto3 S3 client
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise CheckpointStoreError(f"{uri!r} names no bucket; use s3://bucket/prefix")
        self.uri, self.bucket, self.prefix = uri, bucket, prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.s3 = client if client is not None else s3_client(endpoint_url)

    def __repr__(self) -> str:
        return f"S3Store({self.uri})"

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def check(self) -> None:
        """Fail early, naming the endpoint, when the bucket is missing, unreachable or not writable."""
        from botocore.exceptions import BotoCoreError, ClientError

        # The endpoint the client really uses: train.s3_endpoint_url, or AWS_ENDPOINT_URL(_S3), or AWS's own.
        where = self.s3.meta.endpoint_url
        fix = "Check train.s3_endpoint_url, that the bucket exists, and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        try:
            # Some S3 servers create a missing bucket on the first write; ask for it explicitly first.
            self.s3.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket"):
                raise CheckpointStoreError(
                    f"bucket {self.bucket} does not exist at {where}; create it. {fix}"
                ) from None
            raise CheckpointStoreError(f"cannot write to {self.uri} at {where}: {exc}. {fix}") from None
        except BotoCoreError as exc:
            raise CheckpointStoreError(f"cannot write to {self.uri} at {where}: {exc}. {fix}") from None
        probe = self._key(".write-probe")
        try:
            self.s3.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
            self.s3.delete_object(Bucket=self.bucket, Key=probe)
        except (BotoCoreError, ClientError) as exc:
            raise CheckpointStoreError(f"cannot write to {self.uri} at {where}: {exc}. {fix}") from None

    def _keys(self, prefix: str) -> list[str]:
        keys = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys += [obj["Key"] for obj in page.get("Contents", [])]
        return keys

    def complete_steps(self) -> list[int]:
        base = self._key("")
        keys = self._keys(base + "/" if base else "")
        return steps_with_manifest([k.removeprefix(base + "/") if base else k for k in keys])

    def entry_steps(self) -> list[int]:
        base = self._key("")
        keys = self._keys(base + "/" if base else "")
        return entry_steps([k.removeprefix(base + "/") if base else k for k in keys])

    def has(self, name: str) -> bool:
        return bool(self._keys(self._key(name, MANIFEST)))

    def put(self, local_dir: Path, name: str, step: int) -> None:
        """Upload a checkpoint, manifest last. An entry it replaces stops counting first (its manifest goes),
        and an upload that fails removes the objects it wrote before the error goes on (best effort: with the
        store unreachable they stay, without a manifest, for `prune` to remove later)."""
        manifest = build_manifest(local_dir, step)
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))
        try:
            for file in manifest["files"]:
                self.s3.upload_file(str(local_dir / file), self.bucket, self._key(name, file))
            body = json.dumps(manifest, indent=1).encode()
            self.s3.put_object(Bucket=self.bucket, Key=self._key(name, MANIFEST), Body=body)
        except Exception as exc:
            log.warning("upload of %s to %r failed (%s); removing its partial objects", name, self, exc)
            try:
                self.delete(name)
            except Exception as cleanup:  # the store may be the reason the upload failed
                log.warning(
                    "could not remove the partial upload of %s from %r: %s; prune removes it once a newer "
                    "checkpoint is complete",
                    name,
                    self,
                    cleanup,
                )
            raise

    def read_record(self, name: str) -> tuple[bytes | None, str | None]:
        """A small object at the prefix (`attempt.json`) and its ETag (None: absent)."""
        from botocore.exceptions import ClientError

        try:
            got = self.s3.get_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as exc:
            if _not_found(exc):
                return None, None
            raise
        return got["Body"].read(), got["ETag"]

    def write_record(self, name: str, body: bytes, expect: str | None) -> bool:
        """Write `name` only if it is still as read: S3's conditional PUT (If-Match its ETag, or If-None-Match
        for a new object), atomic on the server; False if another writer came first. A server without
        conditional writes (501) gets a plain PUT: the last writer wins, which is all such a server allows."""
        from botocore.exceptions import ClientError

        condition = {"IfMatch": expect} if expect else {"IfNoneMatch": "*"}
        try:
            self.s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=body, **condition)
        except ClientError as exc:
            if _code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            if _code(exc) not in ("NotImplemented", "501"):
                raise
            log.warning("%r does not support conditional writes; %s is written unconditionally", self, name)
            self.s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=body)
        return True

    def fetch(self, name: str, scratch: Path) -> Path:
        """Download an entry and verify it; CheckpointCorrupt when a file is missing or differs (an object
        that is not there), other errors (the network, credentials) as they come: they say nothing of it."""
        from botocore.exceptions import ClientError

        directory = scratch / name
        shutil.rmtree(directory, ignore_errors=True)
        where = f"s3://{self.bucket}/{self._key(name)}"
        try:
            raw = self.s3.get_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))["Body"].read()
        except ClientError as exc:
            if _not_found(exc):
                raise CheckpointCorrupt(f"{where} has no manifest (moved aside or deleted meanwhile)") from None
            raise
        manifest = _read_manifest(raw, where)
        files = manifest_files(manifest, where)  # every name checked before anything is written
        directory.mkdir(parents=True, exist_ok=True)
        for file in files:
            target = inside(directory, file)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.s3.download_file(self.bucket, self._key(name, file), str(target))
            except ClientError as exc:
                if _not_found(exc):
                    raise CheckpointCorrupt(
                        f"checkpoint file {where}/{file} is missing or truncated (it is missing)"
                    ) from None
                if _code(exc) in _BAD_KEY:  # the server will not take the name: so it is the manifest's fault
                    raise CheckpointCorrupt(
                        f"the manifest of {where} names {file!r}, a key the server refuses "
                        f"({exc}); the checkpoint is treated as corrupt"
                    ) from None
                raise
        verify(directory, manifest)
        return directory

    def delete(self, name: str) -> None:
        """Remove an entry, manifest first (it stops counting at once), and any upload of it left unfinished."""
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))
        prefix = self._key(name) + "/"
        for key in self._keys(prefix):
            self.s3.delete_object(Bucket=self.bucket, Key=key)
        self._abort_uploads(prefix)

    def _abort_uploads(self, prefix: str) -> None:
        """Abort multipart uploads left under `prefix` by a killed process: their parts cost storage unseen."""
        from botocore.exceptions import ClientError

        try:
            pages = self.s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for upload in page.get("Uploads", []):
                    self.s3.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        except ClientError as exc:
            if _code(exc) not in ("NotImplemented", "501"):  # a server without multipart listing has none to abort
                raise

    def move_aside(self, name: str, reason: str) -> str | None:
        """Copy an entry to corrupt/<name>-<time>/ with REASON.txt, then delete it (manifest first, so it stops
        counting at once); its new prefix, or None if it was gone."""
        from botocore.exceptions import ClientError

        aside = self._key(_aside_name(name))
        manifest = self._key(name, MANIFEST)
        try:
            self.s3.copy({"Bucket": self.bucket, "Key": manifest}, self.bucket, f"{aside}/{MANIFEST}")
        except ClientError as exc:
            if _not_found(exc):
                return None
            raise
        self.s3.delete_object(Bucket=self.bucket, Key=manifest)
        self.s3.put_object(Bucket=self.bucket, Key=f"{aside}/{REASON_FILE}", Body=(reason + "\n").encode())
        base = self._key(name) + "/"
        for key in self._keys(base):
            try:
                relative = safe_relative(key.removeprefix(base), f"the listing of s3://{self.bucket}/{base}")
            except CheckpointCorrupt as exc:  # copied under aside/, a '..' could land anywhere in the bucket
                log.warning("not copying %s aside: %s", key, exc)
                relative = None
            if relative is not None:
                try:
                    self.s3.copy({"Bucket": self.bucket, "Key": key}, self.bucket, f"{aside}/{relative}")
                except ClientError as exc:
                    if not _not_found(exc):  # gone: another rank is moving the same entry
                        raise
            try:
                self.s3.delete_object(Bucket=self.bucket, Key=key)  # the key exactly as listed: nothing else
            except ClientError as exc:
                if _code(exc) not in _BAD_KEY:
                    raise
                log.warning("cannot delete %s (%s); it stays, and never counts: it has no manifest", key, exc)
        return f"s3://{self.bucket}/{aside}"


def _code(exc: Any) -> str | None:  # botocore's ClientError (untyped)
    return exc.response.get("Error", {}).get("Code")


def _not_found(exc: Any) -> bool:
    return _code(exc) in ("404", "NoSuchKey", "NotFound")


Store = LocalStore | S3Store


class CheckpointStore(Protocol):
    """What a training job reads and writes its checkpoints through: a `Store`, or rank 0's
    `grpo_pipeline.trainer.fence.FencedStore` wrapping one (each write first checks this attempt owns it)."""

    def complete_steps(self) -> list[int]: ...

    def entry_steps(self) -> list[int]: ...

    def has(self, name: str) -> bool: ...

    def put(self, local_dir: Path, name: str, step: int) -> None: ...

    def fetch(self, name: str, scratch: Path) -> Path: ...

    def delete(self, name: str) -> None: ...

    def move_aside(self, name: str, reason: str) -> str | None: ...


def open_store(uri: str, endpoint_url: str | None = None) -> Store:
    """A store for a local path or an s3:// URI.

    >>> open_store("/tmp/ckpt")
    LocalStore(/tmp/ckpt)
    """
    return S3Store(uri, endpoint_url) if uri.startswith("s3://") else LocalStore(uri)


@dataclass
class ResumePoint:
    """Where a job resumes: a verified checkpoint (its step, its local directory) or nothing (start fresh),
    and the newer checkpoints passed over, each with why and where it was moved."""

    step: int | None = None
    directory: Path | None = None
    skipped: list[dict] = field(default_factory=list)  # {"step", "reason", "moved_to"}

    @property
    def reason(self) -> str | None:
        """One line for the log and MLflow on why the newest checkpoint was not used; None when it was."""
        if not self.skipped:
            return None
        passed = "; ".join(
            f"checkpoint {s['step']}: {s['reason']}" + (f" (moved to {s['moved_to']})" if s["moved_to"] else "")
            for s in self.skipped
        )
        target = f"resumed from step {self.step}" if self.step is not None else "no checkpoint verifies: started fresh"
        return f"{target}; passed over {passed}"


def choose_resume(store: CheckpointStore, scratch: Path, *, move_aside: bool = True) -> ResumePoint:
    """The newest complete checkpoint that verifies against its manifest, fetched into `scratch`.

    Newer ones that do not verify are passed over and, with `move_aside`, moved to `corrupt/` with their
    reason, so the next relaunch does not try them again; with several ranks, let one rank move them (the
    others see them gone, which also counts as passed over). Errors reaching the store are raised, never
    taken for corruption. Everything it decides is in the log; `ResumePoint.reason` says it in one line.
    """
    point = ResumePoint()
    for step in reversed(store.complete_steps()):
        name = checkpoint_name(step)
        try:
            point.directory, point.step = store.fetch(name, scratch), step
        except CheckpointCorrupt as exc:
            shutil.rmtree(Path(scratch) / name, ignore_errors=True)  # a partial download, if any
            moved = store.move_aside(name, str(exc)) if move_aside else None
            log.warning(
                "checkpoint %d in %r does not verify: %s%s", step, store, exc, f"; moved to {moved}" if moved else ""
            )
            point.skipped.append({"step": step, "reason": str(exc), "moved_to": moved})
            continue
        break
    if point.step is not None:
        log.info(
            "resuming from step %d in %r%s",
            point.step,
            store,
            f" (passed over {len(point.skipped)} newer checkpoint(s) that do not verify)" if point.skipped else "",
        )
    elif point.skipped:
        log.warning("no checkpoint in %r verifies; starting from step 0", store)
    return point


def prune(store: CheckpointStore, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and the incomplete ones older than the newest
    complete one (`incomplete_to_prune`). Run by the one process that uploads, after an upload, so nothing
    it removes is being written."""
    complete = store.complete_steps()
    for step in complete[:-keep]:
        store.delete(checkpoint_name(step))
    for step in incomplete_to_prune(store.entry_steps(), complete):
        log.info("removing checkpoint %d in %r: cut off before its manifest, and a newer one is complete", step, store)
        store.delete(checkpoint_name(step))


def collect_final(spec: JobSpec, store: CheckpointStore | None = None) -> tuple[TrainResult, Path]:
    """The finished job's result, with its adapter copied from the store's `final` entry to `adapter_dir`."""
    store = store or open_store(spec.checkpoint_uri, spec.train.s3_endpoint_url)
    final = store.fetch(FINAL, Path(spec.work_dir) / "fetched")
    shutil.rmtree(spec.adapter_dir, ignore_errors=True)
    shutil.copytree(final, spec.adapter_dir, ignore=shutil.ignore_patterns(RESULT_FILE, METRICS_FILE, MANIFEST))
    result = TrainResult.model_validate_json((final / RESULT_FILE).read_text())
    return result.model_copy(update={"adapter_dir": spec.adapter_dir}), final


def adapter_files(directory: Path) -> dict[str, tuple[int, str]]:
    """`name -> (size, sha256)` of every file of an adapter directory: what the job spec pins for the node."""
    return {name: (meta["size"], meta["sha256"]) for name, meta in build_manifest(directory, 0)["files"].items()}


def fetch_init_adapter(store: Store, expected: dict[str, tuple[int, str]], scratch: Path) -> Path:
    """The warm start's adapter from the store's `init-adapter` entry, verified against the files the job spec
    pins (`JobSpec.init_adapter_files`), not only against the store's own manifest: a store that changed, added or
    dropped a file, or pinned hashes of its own, gives `CheckpointCorrupt` naming the file, and nothing is loaded.
    Names are checked as every name read from a store is (`safe_relative`, `inside`)."""
    directory = store.fetch(INIT_ADAPTER, scratch)  # its own manifest's names confined, sizes and hashes checked
    where = f"the warm start's adapter in {store!r}"
    for name in expected:
        safe_relative(name, "the job spec's init_adapter_files")
    found = {
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if (p.is_file() or p.is_symlink()) and p.name != MANIFEST
    }
    if extra := sorted(found - set(expected)):
        raise CheckpointCorrupt(f"{where} has files the job spec does not pin: {extra}; it is not the checked adapter")
    for name, (size, sha) in expected.items():
        path = inside(directory, name)
        if not path.is_file():
            raise CheckpointCorrupt(f"{where} lacks {name!r}, which the job spec pins")
        if path.stat().st_size != size or _sha256(path) != sha:
            raise CheckpointCorrupt(
                f"{where}: {name!r} does not match the sha256 the job spec pins; it is not the checked adapter"
            )
    return directory
