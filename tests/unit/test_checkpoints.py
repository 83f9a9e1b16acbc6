import json

import pytest

from grpo_pipeline.trainer.checkpoints import MANIFEST, CheckpointStoreError, LocalStore, open_store, prune


def _checkpoint(tmp_path, step, payload=b"weights"):
    src = tmp_path / f"src-{step}"
    (src / "sub").mkdir(parents=True)
    (src / "adapter.bin").write_bytes(payload * step)
    (src / "sub" / "state.json").write_text(json.dumps({"step": step}))
    return src


def test_manifest_written_last_and_lists_every_file(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put(_checkpoint(tmp_path, 2), f"checkpoint-{2}", 2)
    manifest = json.loads((tmp_path / "store" / "checkpoint-2" / MANIFEST).read_text())
    assert manifest["step"] == 2
    assert set(manifest["files"]) == {"adapter.bin", "sub/state.json"}
    assert store.complete_steps() == [2]


def test_checkpoint_without_manifest_is_skipped(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put(_checkpoint(tmp_path, 2), f"checkpoint-{2}", 2)
    store.put(_checkpoint(tmp_path, 4), f"checkpoint-{4}", 4)
    (tmp_path / "store" / "checkpoint-4" / MANIFEST).unlink()  # as if preempted mid-upload
    (tmp_path / "store" / "checkpoint-6").mkdir()
    assert store.complete_steps() == [2]


def test_truncated_file_fails_verification(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put(_checkpoint(tmp_path, 3), f"checkpoint-{3}", 3)
    (tmp_path / "store" / "checkpoint-3" / "adapter.bin").write_bytes(b"x")
    with pytest.raises(CheckpointStoreError, match="missing or truncated"):
        store.fetch("checkpoint-3", tmp_path / "scratch")


def test_corrupted_file_fails_verification(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put(_checkpoint(tmp_path, 3), f"checkpoint-{3}", 3)
    (tmp_path / "store" / "checkpoint-3" / "adapter.bin").write_bytes(b"x" * len(b"weights" * 3))
    with pytest.raises(CheckpointStoreError, match="sha256"):
        store.fetch("checkpoint-3", tmp_path / "scratch")


def test_prune_keeps_newest(tmp_path):
    store = LocalStore(tmp_path / "store")
    for step in (1, 2, 3, 4):
        store.put(_checkpoint(tmp_path, step), f"checkpoint-{step}", step)
    prune(store, keep=2)
    assert store.complete_steps() == [3, 4]
    assert not (tmp_path / "store" / "checkpoint-1").exists()


def test_unreachable_s3_endpoint_names_it():
    store = open_store("s3://bucket/run", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(CheckpointStoreError, match=r"cannot write to s3://bucket/run at http://127.0.0.1:9"):
        store.check()


def test_s3_uri_without_bucket():
    with pytest.raises(CheckpointStoreError, match="names no bucket"):
        open_store("s3:///prefix")
