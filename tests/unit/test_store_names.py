"""Names read from a checkpoint store never become paths outside its directory: a manifest naming `../` or an
absolute file, or a checkpoint holding a symlink out, is corrupt (moved aside with its reason) and the resume
goes on from the newest good checkpoint. A failed upload leaves nothing behind; prune removes entries cut off
before their manifest once a newer checkpoint is complete."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from grpo_pipeline.trainer.checkpoints import (
    CORRUPT,
    MANIFEST,
    REASON_FILE,
    CheckpointCorrupt,
    LocalStore,
    S3Store,
    choose_resume,
    prune,
)


def _src(tmp_path, step):
    src = tmp_path / f"src-{step}"
    (src / "sub").mkdir(parents=True)
    (src / "adapter.bin").write_bytes(b"weights" * step)
    (src / "sub" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return src


def _store(tmp_path, steps=(2, 4)) -> LocalStore:
    store = LocalStore(tmp_path / "store")
    for step in steps:
        store.put(_src(tmp_path, step), f"checkpoint-{step}", step)
    return store


def _name_in_manifest(manifest_path, name, payload):
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("hostile", ["../../outside.bin", "ABSOLUTE", "sub/../../../outside.bin", "a//b", "./a"])
def test_a_manifest_naming_a_file_outside_is_corrupt_even_when_that_file_verifies(tmp_path, hostile):
    store = _store(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")  # it would verify: size and hash are the manifest's own
    name = str(outside) if hostile == "ABSOLUTE" else hostile
    _name_in_manifest(store.root / "checkpoint-4" / MANIFEST, name, b"secret")
    point = choose_resume(store, tmp_path / "scratch")
    assert point.step == 2 and point.skipped[0]["step"] == 4
    reason = point.skipped[0]["reason"]
    assert repr(name) in reason and "a name read from a store must be a relative path" in reason
    assert store.complete_steps() == [2]
    aside = next((store.root / CORRUPT).iterdir())
    assert repr(name) in (aside / REASON_FILE).read_text()
    assert outside.read_bytes() == b"secret"


def test_a_symlink_out_of_a_local_checkpoint_is_corrupt(tmp_path):
    store = _store(tmp_path)
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"weights" * 4)
    linked = store.root / "checkpoint-4" / "adapter.bin"
    linked.unlink()
    linked.symlink_to(target)  # same bytes: only where it points is wrong
    point = choose_resume(store, tmp_path / "scratch")
    assert point.step == 2 and "outside" in point.skipped[0]["reason"] and "symlink" in point.skipped[0]["reason"]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"a.bin": {"size": 1}}, "no valid size and sha256"),
        ({"a.bin": {"size": "1", "sha256": "0" * 64}}, "no valid size and sha256"),
        ({"a": {"size": 1, "sha256": "0" * 64}, "a/b": {"size": 1, "sha256": "0" * 64}}, "both as a file and as the"),
        ([], "lists no files"),
    ],
)
def test_a_malformed_manifest_is_corrupt_not_a_crash(tmp_path, files, message):
    store = _store(tmp_path)
    (store.root / "checkpoint-4" / MANIFEST).write_text(json.dumps({"step": 4, "files": files}))
    point = choose_resume(store, tmp_path / "scratch")
    assert point.step == 2 and message in point.skipped[0]["reason"]


class _FakeS3:
    """Just what `S3Store.fetch` calls; a download answers as a server answers a key it will not take."""

    def __init__(self, objects: dict[str, bytes], refuse: str):
        self.objects, self.refuse, self.downloaded = objects, refuse, []

    def get_object(self, Bucket, Key):
        import io

        from botocore.exceptions import ClientError

        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
        return {"Body": io.BytesIO(self.objects[Key])}

    def download_file(self, bucket, key, filename):
        from botocore.exceptions import ClientError

        if self.refuse in key:
            raise ClientError({"Error": {"Code": "400", "Message": "Bad Request"}}, "HeadObject")
        self.downloaded.append(filename)
        with open(filename, "wb") as fh:
            fh.write(self.objects[key])

    def get_paginator(self, _):
        objects = self.objects

        class Pages:
            def paginate(self, Bucket, Prefix):
                return [{"Contents": [{"Key": k} for k in objects if k.startswith(Prefix)]}]

        return Pages()


def test_a_key_the_s3_server_refuses_makes_the_checkpoint_corrupt_not_the_relaunch_crash(tmp_path):
    def manifest(files):
        return json.dumps(
            {
                "step": 1,
                "files": {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()},
            }
        ).encode()

    good, odd = {"adapter.bin": b"w2"}, {"adapter.bin": b"w4", "x" * 2000: b"?"}  # a key too long for the server
    objects = {
        "p/checkpoint-2/adapter.bin": b"w2",
        "p/checkpoint-2/manifest.json": manifest(good),
        "p/checkpoint-4/adapter.bin": b"w4",
        "p/checkpoint-4/manifest.json": manifest(odd),
    }
    store = S3Store("s3://b/p", client=_FakeS3(objects, refuse="x" * 2000))
    point = choose_resume(store, tmp_path / "scratch", move_aside=False)
    assert point.step == 2 and "a key the server refuses" in point.skipped[0]["reason"]
    assert (point.directory / "adapter.bin").read_bytes() == b"w2"


def test_a_failed_local_upload_leaves_nothing(tmp_path, monkeypatch):
    store = _store(tmp_path, steps=(2,))
    real = shutil.copy2

    def copy_then_fail(src, dst, *args, **kwargs):
        if str(src).endswith("trainer_state.json"):
            raise OSError(28, "No space left on device")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copy2", copy_then_fail)
    with pytest.raises(OSError, match="No space left"):
        store.put(_src(tmp_path, 4), "checkpoint-4", 4)
    assert not (store.root / "checkpoint-4").exists() and store.complete_steps() == [2]


def test_a_failed_upload_leaves_no_staging_copy_and_reaches_the_training_thread(tmp_path, monkeypatch):
    from grpo_pipeline.trainer.callbacks import CheckpointSync

    store = _store(tmp_path, steps=(2,))
    monkeypatch.setattr(store, "put", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    sync = CheckpointSync(store, keep=2, staging=tmp_path / "staging")
    snapshot = _src(tmp_path, 4)
    sync._pending.append(sync._pool.submit(sync._upload, snapshot, 4, [], None))
    with pytest.raises(OSError, match="No space left"):
        sync.wait()
    assert not snapshot.exists() and store.complete_steps() == [2]


def test_prune_removes_incomplete_checkpoints_older_than_the_newest_complete_one(tmp_path):
    store = _store(tmp_path, steps=(2, 4, 6))
    for step in (3, 5, 7):  # cut off before their manifests; 7 is newer than every complete one
        (store.root / f"checkpoint-{step}").mkdir()
        (store.root / f"checkpoint-{step}" / "adapter.bin").write_bytes(b"partial")
    prune(store, keep=2)
    assert store.complete_steps() == [4, 6]
    assert sorted(p.name for p in store.root.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6", "checkpoint-7"]


def test_a_listing_key_with_dots_is_never_copied_aside(tmp_path):
    from grpo_pipeline.trainer.checkpoints import safe_relative

    with pytest.raises(CheckpointCorrupt, match=r"the listing of s3://b/p/checkpoint-4/ names '\.\./x', which has a"):
        safe_relative("../x", "the listing of s3://b/p/checkpoint-4/")
