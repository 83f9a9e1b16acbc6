"""A corrupt checkpoint in S3 never stops a job: the trainer resumes from the newest checkpoint that verifies,
moves the bad one aside with its reason, and says so in the log and in MLflow (SeaweedFS on loopback)."""

from __future__ import annotations

import boto3
import pytest

from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.checkpoints import CORRUPT, MANIFEST, REASON_FILE, S3Store, choose_resume
from grpo_pipeline.trainer.spec import JobSpec

pytestmark = pytest.mark.integration


def _checkpoint(tmp_path, step):
    src = tmp_path / f"src-{step}"
    (src / "nested").mkdir(parents=True)
    (src / "adapter.bin").write_bytes(bytes(range(256)) * 40 * step)
    (src / "nested" / "state.json").write_text(f'{{"global_step": {step:03d}}}')
    return src


def test_a_truncated_and_a_wrong_hash_file_in_s3_fall_back_to_the_older_checkpoint(tmp_path, s3_endpoint):
    store = S3Store("s3://ckpt/fallback", endpoint_url=s3_endpoint)
    for step in (2, 4, 6):
        store.put(_checkpoint(tmp_path, step), f"checkpoint-{step}", step)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.put_object(Bucket="ckpt", Key="fallback/checkpoint-6/adapter.bin", Body=b"cut short")  # truncated
    s3.put_object(
        Bucket="ckpt", Key="fallback/checkpoint-4/nested/state.json", Body=b'{"global_step": 999}'
    )  # same size

    point = choose_resume(store, tmp_path / "scratch")
    assert point.step == 2 and (point.directory / "nested" / "state.json").read_text() == '{"global_step": 002}'
    assert ["missing or truncated" in s["reason"] for s in point.skipped] == [True, False]
    assert "sha256" in point.skipped[1]["reason"]
    assert store.complete_steps() == [2]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix=f"fallback/{CORRUPT}/")["Contents"]}
    for skipped in point.skipped:
        prefix = skipped["moved_to"].removeprefix("s3://ckpt/")
        assert {f"{prefix}/{MANIFEST}", f"{prefix}/{REASON_FILE}", f"{prefix}/adapter.bin"} <= keys
    assert not [
        k
        for k in (
            o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix="fallback/checkpoint-6/").get("Contents", [])
        )
    ]


def test_the_trainer_resumes_past_a_corrupt_checkpoint_and_logs_why(
    tmp_path, s3_endpoint, tiny_model, tiny_splits, tiny_config
):
    from mlflow import MlflowClient

    from grpo_pipeline.trainer.train import run

    cfg = tiny_config(
        "train.grpo.max_steps=4",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=3",
        f"train.s3_endpoint_url={s3_endpoint}",
    )
    spec = JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri="s3://ckpt/corrupt-run",
        adapter_dir=str(tmp_path / "adapter"),
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    first = run(spec)
    store = S3Store("s3://ckpt/corrupt-run", endpoint_url=s3_endpoint)
    assert store.complete_steps() == [2, 4]
    store.delete("final")  # as if preempted after checkpoint 4, whose largest file then went bad in the store
    key = max(
        store._keys("corrupt-run/checkpoint-4/"),
        key=lambda k: store.s3.head_object(Bucket="ckpt", Key=k)["ContentLength"],
    )
    body = store.s3.get_object(Bucket="ckpt", Key=key)["Body"].read()
    store.s3.put_object(Bucket="ckpt", Key=key, Body=body[: len(body) // 2])

    train = train_settings(cfg.train).model_copy(update={"grpo": {**spec.train.grpo, "max_steps": 6}})
    second = run(
        spec.model_copy(
            update={"work_dir": str(tmp_path / "work2"), "train": train, "mlflow_run_id": first.mlflow_run_id}
        )
    )
    assert (second.resumed_from_step, second.global_step, second.interrupted) == (2, 6, False)
    client = MlflowClient(spec.mlflow_tracking_uri)
    tag = client.get_run(first.mlflow_run_id).data.tags["resume_fallback"]
    assert tag.startswith("resumed from step 2; passed over checkpoint 4:") and "missing or truncated" in tag
    for name in ("global_step", "epoch"):  # each step once, the final one included
        steps = [m.step for m in client.get_metric_history(first.mlflow_run_id, name)]
        assert sorted(steps) == sorted(set(steps)) and max(steps) == 6, (name, steps)
