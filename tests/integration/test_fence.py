"""The fence against a real S3 API (SeaweedFS on loopback) and a real trainer: a relaunch's claim stops the
attempt it replaces at its next write, with exit 3, which the local launcher does not relaunch; a second
SkyPilot job on the same store is refused (the trainer exits 2 before training, naming both jobs), and the
SkyPilot launcher releases the store of a job SkyPilot reports ended."""

import json
import subprocess
import sys
import time

import pytest

from grpo_pipeline.trainer.checkpoints import FINAL, LocalStore, S3Store
from grpo_pipeline.trainer.fence import ATTEMPT, JOB_ENV, StoreTaken, Superseded, claim_store
from grpo_pipeline.trainer.spec import EXIT_SUPERSEDED, parse_bad_input
from tests.integration.test_trainer import _spec
from tests.unit.test_fence import JOB_A, JOB_B

pytestmark = pytest.mark.integration


def test_s3_claims_are_compare_and_swap(tmp_path, s3_endpoint):
    store = S3Store("s3://ckpt/fence", endpoint_url=s3_endpoint)
    body, tag = store.read_record(ATTEMPT)
    assert body is None
    assert store.write_record(ATTEMPT, b'{"epoch": 1}', None)
    assert not store.write_record(ATTEMPT, b'{"epoch": 1}', None)  # another writer created it first
    body, tag = store.read_record(ATTEMPT)
    assert store.write_record(ATTEMPT, b'{"epoch": 2}', tag)
    assert not store.write_record(ATTEMPT, b'{"epoch": 3}', tag)  # the tag read is stale now
    assert store.read_record(ATTEMPT)[0] == b'{"epoch": 2}'

    old, new = claim_store(store), claim_store(S3Store("s3://ckpt/fence", endpoint_url=s3_endpoint))
    assert new.claim.epoch == old.claim.epoch + 1 == 4
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a")
    with pytest.raises(Superseded):
        old.put(src, "checkpoint-1", 1)
    new.put(src, "checkpoint-2", 2)
    assert store.complete_steps() == [2]


@pytest.mark.slow  # a real trainer to its first checkpoint: a minute or more on 2 cores
def test_a_relaunch_elsewhere_stops_the_running_attempt_at_its_next_checkpoint(
    tmp_path, tiny_model, tiny_splits, tiny_config
):
    cfg = tiny_config("train.grpo.max_steps=30", "train.checkpoint_every=1", "train.keep_checkpoints=50")
    spec = _spec(tmp_path, tiny_model, tiny_splits, cfg)
    path = spec.write(tmp_path / "job.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_pipeline.trainer", "--spec", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    record = tmp_path / "ckpt" / ATTEMPT
    deadline = time.monotonic() + 300  # a bound on a hung trainer, not a timing assumption
    while not record.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(record.read_text())["epoch"] == 1
    relaunch = claim_store(LocalStore(tmp_path / "ckpt"))  # what a relaunch on another machine does first
    at_claim = LocalStore(tmp_path / "ckpt").complete_steps()

    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_SUPERSEDED, out[-3000:]
    assert "superseded" in out and "epoch 2" in out, out[-3000:]
    store = LocalStore(tmp_path / "ckpt")
    assert not store.has(FINAL)
    # At most the one upload whose ownership check ran before the claim lands after it (the documented window).
    assert len(set(store.complete_steps()) - set(at_claim)) <= 1
    relaunch.check_owner()  # the store is still the relaunch's
    assert not (tmp_path / "adapter").exists()


def test_two_jobs_on_one_s3_store_the_second_is_refused_until_the_first_is_released(s3_endpoint):
    from grpo_pipeline.infra.launch import LaunchRefused
    from grpo_pipeline.infra.launch.skypilot import claim_checkpoints

    uri = "s3://ckpt/two-jobs"
    a = claim_store(S3Store(uri, endpoint_url=s3_endpoint), job=JOB_A)
    with pytest.raises(StoreTaken, match=JOB_B):
        claim_store(S3Store(uri, endpoint_url=s3_endpoint), job=JOB_B)
    a.check_owner()  # A was not superseded
    with pytest.raises(LaunchRefused, match="reports managed job 7 RUNNING"):
        claim_checkpoints(uri, s3_endpoint, lambda job_id: "RUNNING")
    claim_checkpoints(uri, s3_endpoint, lambda job_id: "FAILED")  # A ended: released for the next job
    b = claim_store(S3Store(uri, endpoint_url=s3_endpoint), job=JOB_B)
    assert b.claim.epoch == a.claim.epoch + 1
    with pytest.raises(Superseded):  # should A's attempt still be writing, it is fenced off as any old attempt
        a.check_owner()


def test_a_trainer_of_another_job_exits_2_before_training_naming_both_jobs(
    tmp_path, tiny_model, tiny_splits, tiny_config, monkeypatch
):
    claim_store(LocalStore(tmp_path / "ckpt"), job=JOB_A)
    before = (tmp_path / "ckpt" / ATTEMPT).read_bytes()
    spec = _spec(tmp_path, tiny_model, tiny_splits, tiny_config("train.grpo.max_steps=2"))
    monkeypatch.setenv(JOB_ENV, JOB_B)
    done = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.trainer", "--spec", str(spec.write(tmp_path / "job.json"))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    reason = next(filter(None, map(parse_bad_input, done.stdout.splitlines())))
    assert JOB_A in reason and JOB_B in reason  # what the SkyPilot launcher cancels the job on
    assert (tmp_path / "ckpt" / ATTEMPT).read_bytes() == before  # nothing claimed, nothing trained
    assert LocalStore(tmp_path / "ckpt").complete_steps() == []
