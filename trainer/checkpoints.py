"""Checkpoint store: a local directory or an `s3://bucket/prefix`, where a checkpoint counts once its manifest is in.

Layout: `<root>/<entry>/<files...>` and `<root>/<entry>/manifest.json`, the manifest written last; an
entry is `checkpoint-<step>` or `final` (the finished adapter and the job's result). An entry cut off by a
preemption has no manifest and is never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from datetime import UTC, datetime
from pathlib import Path

from trainer.spec import RESULT_FILE, JobSpec, TrainResult

MANIFEST = "manifest.json"
FINAL = "final"
METRICS_FILE = "metrics.json"  # in `final` and each checkpoint: the steps' metrics, for MLflow
_STEP = re.compile(r"checkpoint-(\d+)/" + re.escape(MANIFEST) + "$")


class CheckpointStoreError(RuntimeError):
    pass


def build_manifest(directory: Path, step: int) -> dict:
    """Describe every file of a checkpoint directory (size and sha256), so a reader can verify it."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": digest}
    return {"step": step, "created": datetime.now(UTC).isoformat(), "files": files}


def verify(directory: Path, manifest: dict) -> None:
    """Every file the manifest lists is there, whole and unchanged; a resume never starts from a bad copy."""
    for name, meta in manifest["files"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            raise CheckpointStoreError(f"checkpoint file {path} is missing or truncated")
        if hashlib.sha256(path.read_bytes()).hexdigest() != meta["sha256"]:
            raise CheckpointStoreError(f"checkpoint file {path} does not match its manifest's sha256")


def steps_with_manifest(keys: list[str]) -> list[int]:
    """Steps whose manifest is present, ascending.

    >>> steps_with_manifest(["checkpoint-4/a.bin", "checkpoint-2/manifest.json", "checkpoint-10/manifest.json"])
    [2, 10]
    """
    return sorted(int(m.group(1)) for k in keys if (m := _STEP.search(k)))


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


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
        return steps_with_manifest([p.relative_to(self.root).as_posix() for p in self.root.glob(f"checkpoint-*/{MANIFEST}")])

    def has(self, name: str) -> bool:
        return (self.root / name / MANIFEST).is_file()

    def put(self, local_dir: Path, name: str, step: int) -> None:
        manifest = build_manifest(local_dir, step)
        dest = self.root / name
        shutil.rmtree(dest, ignore_errors=True)
        for name in manifest["files"]:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(local_dir / name, dest / name)
        tmp = dest / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, dest / MANIFEST)  # atomic: the manifest is there whole or not at all

    def fetch(self, name: str, scratch: Path) -> Path:
        directory = self.root / name
        verify(directory, json.loads((directory / MANIFEST).read_text()))
        return directory

    def delete(self, name: str) -> None:
        directory = self.root / name
        (directory / MANIFEST).unlink(missing_ok=True)  # first: it stops counting before files go
        shutil.rmtree(directory, ignore_errors=True)


class S3Store:
    """Any S3 API (AWS, MinIO, SeaweedFS) through boto3."""

    def __init__(self, uri: str, endpoint_url: str | None = None, client=None):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise CheckpointStoreError(f"{uri!r} names no bucket; use s3://bucket/prefix")
        self.uri, self.bucket, self.prefix = uri, bucket, prefix.strip("/")
        self.endpoint_url = endpoint_url
        if client is None:
            import boto3
            from botocore.config import Config

            # A session of its own: boto3's default session caches credentials for the process's lifetime.
            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url,
                config=Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"}),
            )
        self.s3 = client

    def __repr__(self) -> str:
        return f"S3Store({self.uri})"

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def check(self) -> None:
        """Fail early, naming the endpoint, when the bucket is missing, unreachable or not writable."""
        from botocore.exceptions import BotoCoreError, ClientError

        where = self.endpoint_url or "AWS S3"
        fix = "Check train.s3_endpoint_url, that the bucket exists, and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        try:
            # Some S3 servers create a missing bucket on the first write; ask for it explicitly first.
            self.s3.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket"):
                raise CheckpointStoreError(f"bucket {self.bucket} does not exist at {where}; create it. {fix}") from None
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

    def has(self, name: str) -> bool:
        return bool(self._keys(self._key(name, MANIFEST)))

    def put(self, local_dir: Path, name: str, step: int) -> None:
        manifest = build_manifest(local_dir, step)
        for file in manifest["files"]:
            self.s3.upload_file(str(local_dir / file), self.bucket, self._key(name, file))
        body = json.dumps(manifest, indent=1).encode()
        self.s3.put_object(Bucket=self.bucket, Key=self._key(name, MANIFEST), Body=body)

    def fetch(self, name: str, scratch: Path) -> Path:
        directory = scratch / name
        shutil.rmtree(directory, ignore_errors=True)
        manifest = json.loads(self.s3.get_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))["Body"].read())
        for file in manifest["files"]:
            (directory / file).parent.mkdir(parents=True, exist_ok=True)
            self.s3.download_file(self.bucket, self._key(name, file), str(directory / file))
        verify(directory, manifest)
        return directory

    def delete(self, name: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))
        for key in self._keys(self._key(name) + "/"):
            self.s3.delete_object(Bucket=self.bucket, Key=key)


Store = LocalStore | S3Store


def open_store(uri: str, endpoint_url: str | None = None) -> Store:
    """A store for a local path or an s3:// URI.

    >>> open_store("/tmp/ckpt")
    LocalStore(/tmp/ckpt)
    """
    return S3Store(uri, endpoint_url) if uri.startswith("s3://") else LocalStore(uri)


def prune(store: Store, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints."""
    for step in store.complete_steps()[:-keep]:
        store.delete(checkpoint_name(step))


def collect_final(spec: JobSpec, store=None) -> tuple[TrainResult, Path]:
    """The finished job's result, with its adapter copied from the store's `final` entry to `adapter_dir`."""
    store = store or open_store(spec.checkpoint_uri, spec.train.s3_endpoint_url)
    final = store.fetch(FINAL, Path(spec.work_dir) / "fetched")
    shutil.rmtree(spec.adapter_dir, ignore_errors=True)
    shutil.copytree(final, spec.adapter_dir, ignore=shutil.ignore_patterns(RESULT_FILE, METRICS_FILE, MANIFEST))
    result = TrainResult.model_validate_json((final / RESULT_FILE).read_text())
    return result.model_copy(update={"adapter_dir": spec.adapter_dir}), final
