"""The fence against a real S3 API (SeaweedFS on loopback) and a real trainer: a relaunch's claim stops the
attempt it replaces at its next write, with exit 3, which the local launcher does not relaunch."""

import json
import subprocess
import sys
import time

import pytest

from grpo_pipeline.trainer.checkpoints import FINAL, LocalStore, S3Store
from grpo_pipeline.trainer.fence import ATTEMPT, EXIT_SUPERSEDED, Superseded, claim_store
from tests.integration.test_trainer import _spec

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
