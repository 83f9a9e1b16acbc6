"""Resume verifies before it uses: a corrupt newest checkpoint is passed over (and moved aside with its reason)
for the newest one that verifies, and only when none does the job starts fresh, saying so."""

from __future__ import annotations

import json
import logging

import pytest

from grpo_pipeline.trainer.checkpoints import (
    CORRUPT,
    MANIFEST,
    REASON_FILE,
    CheckpointStoreError,
    LocalStore,
    choose_resume,
)


def _store(tmp_path, steps=(2, 4, 6)) -> LocalStore:
    store = LocalStore(tmp_path / "store")
    for step in steps:
        src = tmp_path / f"src-{step}"
        (src / "sub").mkdir(parents=True)
        (src / "adapter.bin").write_bytes(b"weights" * 100 * step)
        (src / "sub" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        store.put(src, f"checkpoint-{step}", step)
    return store


def test_the_newest_checkpoint_that_verifies_is_used(tmp_path):
    point = choose_resume(_store(tmp_path), tmp_path / "scratch")
    assert (point.step, point.skipped, point.reason) == (6, [], None)
    assert json.loads((point.directory / "sub" / "trainer_state.json").read_text()) == {"global_step": 6}


def test_a_truncated_and_a_changed_checkpoint_are_passed_over_and_moved_aside(tmp_path, caplog):
    store = _store(tmp_path)
    (store.root / "checkpoint-6" / "adapter.bin").write_bytes(b"weights")  # truncated
    (store.root / "checkpoint-4" / "sub" / "trainer_state.json").write_text('{"global_step": 9}')  # same size, changed
    with caplog.at_level(logging.INFO, logger="grpo_pipeline.trainer.checkpoints"):
        point = choose_resume(store, tmp_path / "scratch")
    assert point.step == 2 and [s["step"] for s in point.skipped] == [6, 4]
    assert "missing or truncated" in point.skipped[0]["reason"] and "sha256" in point.skipped[1]["reason"]
    assert point.reason.startswith("resumed from step 2; passed over checkpoint 6:")
    assert store.complete_steps() == [2]  # the next relaunch does not try them again
    aside = sorted((store.root / CORRUPT).iterdir())
    assert [p.name.rsplit("-", 1)[0] for p in aside] == ["checkpoint-4", "checkpoint-6"]
    assert "missing or truncated" in (aside[1] / REASON_FILE).read_text() and (aside[1] / MANIFEST).is_file()
    logged = caplog.text
    assert "checkpoint 6" in logged and "does not verify" in logged and "resuming from step 2" in logged


def test_an_unreadable_manifest_counts_as_corrupt(tmp_path):
    store = _store(tmp_path, steps=(2, 4))
    (store.root / "checkpoint-4" / MANIFEST).write_text('{"step": 4, "files": {"adapter.bin": ')
    point = choose_resume(store, tmp_path / "scratch")
    assert point.step == 2 and "not JSON" in point.skipped[0]["reason"]


def test_when_none_verifies_the_job_starts_fresh_and_says_so(tmp_path, caplog):
    store = _store(tmp_path, steps=(2, 4))
    for step in (2, 4):
        (store.root / f"checkpoint-{step}" / "adapter.bin").unlink()
    with caplog.at_level(logging.WARNING, logger="grpo_pipeline.trainer.checkpoints"):
        point = choose_resume(store, tmp_path / "scratch")
    assert point.step is None and point.directory is None
    assert "no checkpoint verifies: started fresh" in point.reason and "starting from step 0" in caplog.text
    assert store.complete_steps() == []


def test_without_move_aside_nothing_moves(tmp_path):
    store = _store(tmp_path, steps=(2, 4))
    (store.root / "checkpoint-4" / "adapter.bin").write_bytes(b"x")
    point = choose_resume(store, tmp_path / "scratch", move_aside=False)
    assert point.step == 2 and point.skipped[0]["moved_to"] is None and store.complete_steps() == [2, 4]


def test_a_store_that_cannot_be_read_is_an_error_not_corruption(tmp_path):
    """A network or permission failure says nothing about the checkpoint: raised, nothing moved aside."""
    store = _store(tmp_path, steps=(2, 4))

    class Unreachable(LocalStore):
        def fetch(self, name, scratch):
            raise CheckpointStoreError("connection refused")

    with pytest.raises(CheckpointStoreError, match="connection refused"):
        choose_resume(Unreachable(store.root), tmp_path / "scratch")
    assert store.complete_steps() == [2, 4] and not (store.root / CORRUPT).exists()


def test_a_checkpoint_moved_by_another_rank_meanwhile_is_passed_over(tmp_path):
    store = _store(tmp_path, steps=(2, 4))
    (store.root / "checkpoint-4" / "adapter.bin").write_bytes(b"x")
    listed = store.complete_steps()

    class Racing(LocalStore):
        def complete_steps(self):  # listed before the other rank moved checkpoint-4 aside
            return listed

    choose_resume(store, tmp_path / "other-rank")  # the other rank moves it
    point = choose_resume(Racing(store.root), tmp_path / "scratch")
    assert point.step == 2 and "no manifest" in point.skipped[0]["reason"]
