"""Checkpoints through a real S3 API (SeaweedFS on loopback), with boto3 as in production."""

import boto3
import pytest

from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.checkpoints import MANIFEST, S3Store, prune
from grpo_pipeline.trainer.spec import JobSpec

pytestmark = pytest.mark.integration


def _checkpoint(tmp_path, step):
    src = tmp_path / f"src-{step}"
    (src / "nested").mkdir(parents=True)
    (src / "adapter.bin").write_bytes(bytes(range(256)) * step)
    (src / "nested" / "state.json").write_text(f'{{"step": {step}}}')
    return src


def test_put_list_fetch_prune(tmp_path, s3_endpoint):
    store = S3Store("s3://ckpt/unit", endpoint_url=s3_endpoint)
    store.check()
    for step in (2, 4, 6):
        store.put(_checkpoint(tmp_path, step), f"checkpoint-{step}", step)
    assert store.complete_steps() == [2, 4, 6]

    fetched = store.fetch("checkpoint-6", tmp_path / "scratch")
    assert (fetched / "adapter.bin").read_bytes() == bytes(range(256)) * 6
    assert (fetched / "nested" / "state.json").read_text() == '{"step": 6}'

    prune(store, keep=1)
    assert store.complete_steps() == [6]
    keys = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket="ckpt", Prefix="unit/")["Contents"]
    ]
    assert all(k.startswith("unit/checkpoint-6/") for k in keys)


def test_missing_bucket_is_named(s3_endpoint):
    from grpo_pipeline.trainer.checkpoints import CheckpointStoreError

    with pytest.raises(CheckpointStoreError, match="bucket no-such-bucket does not exist at http://127.0.0.1"):
        S3Store("s3://no-such-bucket/x", endpoint_url=s3_endpoint).check()


def test_trainer_resumes_from_s3_skipping_an_incomplete_checkpoint(
    tmp_path, s3_endpoint, tiny_model, tiny_splits, tiny_config
):
    from grpo_pipeline.trainer.train import run

    cfg = tiny_config("train.grpo.max_steps=4", "train.checkpoint_every=2", f"train.s3_endpoint_url={s3_endpoint}")
    spec = JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri="s3://ckpt/trainer",
        adapter_dir=str(tmp_path / "adapter"),
    )
    first = run(spec)
    store = S3Store("s3://ckpt/trainer", endpoint_url=s3_endpoint)
    assert (first.global_step, store.complete_steps(), store.has("final")) == (4, [2, 4], True)

    store.delete("final")
    store.s3.delete_object(Bucket="ckpt", Key=f"trainer/checkpoint-4/{MANIFEST}")  # cut off mid-upload
    second = run(spec.model_copy(update={"work_dir": str(tmp_path / "work2")}))  # a fresh node: no local state
    assert (second.resumed_from_step, second.global_step) == (2, 4)


def test_bad_credentials_fail_the_check_with_the_fix(s3_endpoint, monkeypatch):
    from grpo_pipeline.trainer.checkpoints import CheckpointStoreError

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(CheckpointStoreError, match="AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"):
        S3Store("s3://ckpt/x", endpoint_url=s3_endpoint).check()


KILL_DURING_UPLOAD = """
import sys
from pathlib import Path
from grpo_pipeline.trainer.checkpoints import S3Store
S3Store("s3://ckpt/killed", endpoint_url=sys.argv[1]).put(Path(sys.argv[2]), "checkpoint-8", 8)
"""


def test_a_kill_during_an_upload_leaves_a_checkpoint_that_is_skipped(tmp_path, s3_endpoint):
    import subprocess
    import sys
    import time

    store = S3Store("s3://ckpt/killed", endpoint_url=s3_endpoint)
    store.put(_checkpoint(tmp_path, 4), "checkpoint-4", 4)
    big = tmp_path / "big"
    big.mkdir()
    (big / "a-small.json").write_text("{}")  # files upload in name order, the manifest last
    (big / "b-large.bin").write_bytes(b"\0" * 200_000_000)
    proc = subprocess.Popen([sys.executable, "-c", KILL_DURING_UPLOAD, s3_endpoint, str(big)])
    deadline = time.monotonic() + 60
    while not store._keys("killed/checkpoint-8/") and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert store._keys("killed/checkpoint-8/"), "the upload should have started"
    assert store.complete_steps() == [4]


def _add_to_manifest(store, name, files):
    """Rewrite an entry's manifest in the bucket so that it also names `files` ({name: bytes}), as a hostile
    writer to the checkpoint prefix could (AWS S3 stores keys with '..'; this server would refuse them)."""
    import hashlib
    import json

    key = store._key(name, MANIFEST)
    manifest = json.loads(store.s3.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    for file, payload in files.items():
        manifest["files"][file] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    store.s3.put_object(Bucket=store.bucket, Key=key, Body=json.dumps(manifest).encode())


def test_a_manifest_naming_files_outside_writes_nothing_there_and_resume_takes_the_good_checkpoint(
    tmp_path, s3_endpoint
):
    from grpo_pipeline.trainer.checkpoints import CORRUPT, REASON_FILE, choose_resume

    store = S3Store("s3://ckpt/hostile", endpoint_url=s3_endpoint)
    for step in (2, 4, 6):
        store.put(_checkpoint(tmp_path, step), f"checkpoint-{step}", step)
    scratch = tmp_path / "deep" / "scratch"  # '../../../' from an entry in it lands in tmp_path
    scratch.parent.mkdir()
    _add_to_manifest(store, "checkpoint-6", {"../../../escaped.sh": b"#!/bin/sh\necho owned\n"})
    _add_to_manifest(store, "checkpoint-4", {str(tmp_path / "absolute.sh"): b"#!/bin/sh\n"})
    before = {p for p in tmp_path.rglob("*") if not p.is_relative_to(scratch)}
    point = choose_resume(store, scratch)
    assert point.step == 2 and [s["step"] for s in point.skipped] == [6, 4]
    assert "'../../../escaped.sh', which has a '..' part" in point.skipped[0]["reason"]
    assert "which is absolute" in point.skipped[1]["reason"]
    assert {p for p in tmp_path.rglob("*") if not p.is_relative_to(scratch)} == before  # nothing written outside
    assert not list(tmp_path.rglob("*.sh"))
    assert (point.directory / "adapter.bin").read_bytes() == bytes(range(256)) * 2
    assert store.complete_steps() == [2]  # the next relaunch does not try them again
    keys = store._keys(f"hostile/{CORRUPT}/")
    reasons = [k for k in keys if k.endswith(REASON_FILE)]
    assert len(reasons) == 2 and any("/checkpoint-6-" in k and k.endswith("/nested/state.json") for k in keys)


def test_a_failed_upload_removes_its_partial_objects(tmp_path, s3_endpoint):
    store = S3Store("s3://ckpt/failed", endpoint_url=s3_endpoint)
    store.put(_checkpoint(tmp_path, 2), "checkpoint-2", 2)
    real, calls = store.s3.upload_file, []

    def upload_then_fail(filename, bucket, key, *args, **kwargs):
        calls.append(key)
        if len(calls) == 2:  # the first file is in the bucket by now
            raise ConnectionResetError("connection reset by peer")
        return real(filename, bucket, key, *args, **kwargs)

    store.s3.upload_file = upload_then_fail
    with pytest.raises(ConnectionResetError):
        store.put(_checkpoint(tmp_path, 4), "checkpoint-4", 4)
    store.s3.upload_file = real
    assert store._keys("failed/checkpoint-4/") == [] and store.complete_steps() == [2]


def test_prune_removes_incomplete_checkpoints_older_than_the_newest_complete_one(tmp_path, s3_endpoint):
    store = S3Store("s3://ckpt/cutoff", endpoint_url=s3_endpoint)
    store.put(_checkpoint(tmp_path, 2), "checkpoint-2", 2)
    for step in (3, 5):  # killed mid-upload: files, no manifest
        store.s3.put_object(Bucket="ckpt", Key=f"cutoff/checkpoint-{step}/adapter.bin", Body=b"partial")
    store.put(_checkpoint(tmp_path, 4), "checkpoint-4", 4)
    prune(store, keep=5)
    assert store.complete_steps() == [2, 4]
    assert store.entry_steps() == [2, 4, 5]  # 5 is newer than every complete one: an upload may be under way
