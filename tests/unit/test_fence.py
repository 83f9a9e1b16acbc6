"""The checkpoint store's fence (`grpo_pipeline.trainer.fence`) on a local store: a newer attempt's claim
stops every write of an older one, and claims made at once all get distinct epochs."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_pipeline.trainer.checkpoints import LocalStore, checkpoint_name
from grpo_pipeline.trainer.fence import ATTEMPT, Superseded, claim_store


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
