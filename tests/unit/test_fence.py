"""The checkpoint store's fence (`grpo_pipeline.trainer.fence`) on a local store: a newer attempt's claim
stops every write of an older one, and claims made at once all get distinct epochs; a second SkyPilot job on
the same store is refused (and the SkyPilot launcher refuses to launch it, or releases the store of a job
SkyPilot reports ended)."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_pipeline.trainer.checkpoints import FINAL, LocalStore, checkpoint_name
from grpo_pipeline.trainer.fence import ATTEMPT, StoreTaken, Superseded, claim_store, release


def _checkpoint(tmp_path, step):
    folder = tmp_path / f"src-{step}"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"x" * step)
    return folder


def test_a_newer_claim_stops_every_write_of_the_older_attempt(tmp_path):
    root = tmp_path / "ckpt"
    old = claim_store(LocalStore(root))
    old.put(_checkpoint(tmp_path, 1), checkpoint_name(1), 1)
    new = claim_store(LocalStore(root))
    assert (old.claim.epoch, new.claim.epoch) == (1, 2)

    with pytest.raises(Superseded, match=r"owned by epoch 2 .*this attempt, epoch 1 .*stops without writing"):
        old.put(_checkpoint(tmp_path, 2), checkpoint_name(2), 2)
    with pytest.raises(Superseded):
        old.delete(checkpoint_name(1))
    with pytest.raises(Superseded):
        old.move_aside(checkpoint_name(1), "test")
    assert LocalStore(root).complete_steps() == [1]  # nothing of the old attempt's writes landed
    assert old.complete_steps() == [1]  # reads still pass through

    new.put(_checkpoint(tmp_path, 3), checkpoint_name(3), 3)
    assert new.complete_steps() == [1, 3]
    assert json.loads((root / ATTEMPT).read_text())["token"] == new.claim.token


def test_claims_made_at_once_get_distinct_epochs_and_only_the_last_owns_the_store(tmp_path):
    root = tmp_path / "ckpt"
    with ThreadPoolExecutor(8) as pool:
        fenced = list(pool.map(lambda _: claim_store(LocalStore(root)), range(16)))
    epochs = sorted(f.claim.epoch for f in fenced)
    assert epochs == list(range(1, 17))
    owners = []
    for f in fenced:
        try:
            f.check_owner()
            owners.append(f.claim.epoch)
        except Superseded:
            pass
    assert owners == [16]


@pytest.mark.parametrize("record", [b"not json", b"[1, 2]", b'{"epoch": "7"}', b'{"epoch": true}'])
def test_a_damaged_record_is_claimed_over_and_never_taken_as_an_owner(tmp_path, record):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / ATTEMPT).write_bytes(record)
    fenced = claim_store(LocalStore(root))
    assert fenced.claim.epoch == 1
    fenced.check_owner()


def test_a_store_whose_record_is_gone_stops_the_attempt(tmp_path):
    fenced = claim_store(LocalStore(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / ATTEMPT).unlink()
    with pytest.raises(Superseded, match="record is gone"):
        fenced.put(_checkpoint(tmp_path, 1), checkpoint_name(1), 1)


JOB_A = "sky-managed-2026-12-01-03-00-00-000001_grpo-daily_7-0"
JOB_B = "sky-managed-2026-12-01-05-00-00-000002_grpo-daily_9-0"


def test_a_second_job_on_the_same_store_is_refused_and_the_first_trains_on(tmp_path):
    root = tmp_path / "ckpt"
    a = claim_store(LocalStore(root), job=JOB_A)
    with pytest.raises(StoreTaken) as refused:
        claim_store(LocalStore(root), job=JOB_B)
    assert JOB_A in str(refused.value) and JOB_B in str(refused.value) and "train.checkpoint_uri" in str(refused.value)
    assert str(refused.value).startswith(f"{root} belongs to another job")
    a.put(_checkpoint(tmp_path, 1), checkpoint_name(1), 1)  # not superseded: the refused job wrote nothing
    assert json.loads((root / ATTEMPT).read_text())["job"] == JOB_A

    # a recovery of job A (SkyPilot may stamp a new time in front) supersedes A's old attempt, as before
    recovered = claim_store(LocalStore(root), job=JOB_A.replace("03-00-00", "04-30-00"))
    assert recovered.claim.epoch == 2
    with pytest.raises(Superseded, match="job sky-managed-2026-12-01-04-30-00"):
        a.put(_checkpoint(tmp_path, 2), checkpoint_name(2), 2)


def test_another_job_claims_once_the_owner_finished_or_was_released(tmp_path):
    root = tmp_path / "ckpt"
    a = claim_store(LocalStore(root), job=JOB_A)
    a.put(_checkpoint(tmp_path, 1), FINAL, 1)
    assert claim_store(LocalStore(root), job=JOB_B).claim.epoch == 2  # A published final: done with it

    other = tmp_path / "other"
    claim_store(LocalStore(other), job=JOB_A)
    assert not release(LocalStore(other), JOB_B, "not the owner")  # only the owner's record is released
    assert release(LocalStore(other), JOB_A, "managed job 7 ended CANCELLED")
    b = claim_store(LocalStore(other), job=JOB_B)
    assert "release" not in json.loads((other / ATTEMPT).read_text()) and b.claim.job == JOB_B


def test_attempts_without_a_job_identity_claim_as_before(tmp_path):
    root = tmp_path / "ckpt"
    claim_store(LocalStore(root), job=JOB_A)
    assert claim_store(LocalStore(root)).claim.epoch == 2  # a local attempt: the epoch fence alone
    assert claim_store(LocalStore(root), job=JOB_B).claim.epoch == 3  # a record without a job refuses nothing


@pytest.mark.parametrize("status", ["RUNNING", "RECOVERING", None])
def test_the_sky_launcher_refuses_a_uri_whose_job_still_runs(tmp_path, status):
    from grpo_pipeline.infra.launch import LaunchRefused
    from grpo_pipeline.infra.launch.skypilot import claim_checkpoints

    root = tmp_path / "ckpt"
    claim_store(LocalStore(root), job=JOB_A)
    asked = []
    with pytest.raises(LaunchRefused, match=JOB_A) as refused:
        claim_checkpoints(str(root), None, lambda job_id: asked.append(job_id) or status)
    assert asked == [7]
    assert (f"reports managed job 7 {status}" if status else "queue does not know") in str(refused.value)
    assert "release" not in json.loads((root / ATTEMPT).read_text())


def test_the_sky_launcher_releases_the_uri_of_a_job_that_ended(tmp_path):
    from grpo_pipeline.infra.launch import LaunchRefused
    from grpo_pipeline.infra.launch.skypilot import claim_checkpoints

    root = tmp_path / "ckpt"
    claim_store(LocalStore(root), job=JOB_A)
    said = []
    claim_checkpoints(str(root), None, lambda job_id: "CANCELLED", said.append)
    assert "managed job 7 ended CANCELLED" in json.loads((root / ATTEMPT).read_text())["release"]
    assert said and "released from managed job 7" in said[0]
    assert claim_store(LocalStore(root), job=JOB_B).claim.epoch == 2
    asked = []  # B owns it now: the next launch asks about B
    with pytest.raises(LaunchRefused, match=JOB_B):
        claim_checkpoints(str(root), None, lambda job_id: asked.append(job_id) or "RUNNING")
    assert asked == [9]
