"""Checkpoints through a real S3 API (SeaweedFS on loopback), with boto3 as in production."""

import boto3
import pytest

from trainer.checkpoints import MANIFEST, S3Store, prune
from trainer.spec import JobSpec

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
        store.put(_checkpoint(tmp_path, step), step)
    assert store.complete_steps() == [2, 4, 6]

    fetched = store.fetch(6, tmp_path / "scratch")
    assert (fetched / "adapter.bin").read_bytes() == bytes(range(256)) * 6
    assert (fetched / "nested" / "state.json").read_text() == '{"step": 6}'

    prune(store, keep=1)
    assert store.complete_steps() == [6]
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(
        Bucket="ckpt", Prefix="unit/")["Contents"]]
    assert all(k.startswith("unit/checkpoint-6/") for k in keys)


def test_missing_bucket_is_named(s3_endpoint):
    from trainer.checkpoints import CheckpointStoreError

    with pytest.raises(CheckpointStoreError, match="cannot write to s3://no-such-bucket/x"):
        S3Store("s3://no-such-bucket/x", endpoint_url=s3_endpoint).check()


def test_trainer_resumes_from_s3_skipping_an_incomplete_checkpoint(tmp_path, s3_endpoint, tiny_model, tiny_splits,
                                                                   tiny_config):
    from trainer.train import run

    cfg = tiny_config("train.grpo.max_steps=4", "train.checkpoint_every=2",
                      f"train.s3_endpoint_url={s3_endpoint}")
    spec = JobSpec(model_path=str(tiny_model), model=cfg.model, train=cfg.train,
                   train_file=str(tiny_splits["train"]), work_dir=str(tmp_path / "work"),
                   checkpoint_uri="s3://ckpt/trainer", adapter_dir=str(tmp_path / "adapter"))
    first = run(spec)
    store = S3Store("s3://ckpt/trainer", endpoint_url=s3_endpoint)
    assert (first.global_step, store.complete_steps()) == (4, [2, 4])

    store.s3.delete_object(Bucket="ckpt", Key=f"trainer/checkpoint-4/{MANIFEST}")  # cut off mid-upload
    second = run(spec.model_copy(update={"work_dir": str(tmp_path / "work2")}))  # a fresh node: no local state
    assert (second.resumed_from_step, second.global_step) == (2, 4)
