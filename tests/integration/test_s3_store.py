"""Checkpoints through a real S3 API (SeaweedFS on loopback), with boto3 as in production."""

import boto3
import pytest

from trainer.checkpoints import MANIFEST, S3Store, prune
from trainer.spec import JobSpec
from tasks.job import model_load, train_settings

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
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(
        Bucket="ckpt", Prefix="unit/")["Contents"]]
    assert all(k.startswith("unit/checkpoint-6/") for k in keys)


def test_missing_bucket_is_named(s3_endpoint):
    from trainer.checkpoints import CheckpointStoreError

    with pytest.raises(CheckpointStoreError, match="bucket no-such-bucket does not exist at http://127.0.0.1"):
        S3Store("s3://no-such-bucket/x", endpoint_url=s3_endpoint).check()


def test_trainer_resumes_from_s3_skipping_an_incomplete_checkpoint(tmp_path, s3_endpoint, tiny_model, tiny_splits,
                                                                   tiny_config):
    from trainer.train import run

    cfg = tiny_config("train.grpo.max_steps=4", "train.checkpoint_every=2",
                      f"train.s3_endpoint_url={s3_endpoint}")
    spec = JobSpec(model_path=str(tiny_model), model=model_load(cfg.model), train=train_settings(cfg.train),
                   train_file=str(tiny_splits["train"]), work_dir=str(tmp_path / "work"),
                   checkpoint_uri="s3://ckpt/trainer", adapter_dir=str(tmp_path / "adapter"))
    first = run(spec)
    store = S3Store("s3://ckpt/trainer", endpoint_url=s3_endpoint)
    assert (first.global_step, store.complete_steps(), store.has("final")) == (4, [2, 4], True)

    store.delete("final")
    store.s3.delete_object(Bucket="ckpt", Key=f"trainer/checkpoint-4/{MANIFEST}")  # cut off mid-upload
    second = run(spec.model_copy(update={"work_dir": str(tmp_path / "work2")}))  # a fresh node: no local state
    assert (second.resumed_from_step, second.global_step) == (2, 4)


def test_bad_credentials_fail_the_check_with_the_fix(s3_endpoint, monkeypatch):
    from trainer.checkpoints import CheckpointStoreError

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(CheckpointStoreError, match="AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"):
        S3Store("s3://ckpt/x", endpoint_url=s3_endpoint).check()


KILL_DURING_UPLOAD = """
import sys
from pathlib import Path
from trainer.checkpoints import S3Store
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
