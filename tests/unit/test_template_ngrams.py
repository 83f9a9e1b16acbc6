"""Template n-grams: the data stage's contamination and near-dedup checks judge what varies between rows (a fixed
instruction around varying inputs is no leak and no duplicate), and still catch a copied question."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.template_ngrams import INSTRUCTION, multiplication_rows, sentiment_rows
from grpo_pipeline.configs.schema import DataConfig
from grpo_pipeline.tasks.data.splits import split_of
from grpo_pipeline.tasks.data.stage import build_dataset
from tests.unit.test_data import GSM8K, VOCAB, key_in, read


def build(tmp_path: Path, rows: list[dict], name: str = "rows", **kw):
    source = tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        source=str(source), prompt_column="question", max_prompt_tokens=None, max_dropped_fraction=1.0, **kw
    )
    return build_dataset(cfg, tmp_path / f"out-{name}")


@pytest.mark.parametrize("task", [multiplication_rows, sentiment_rows])
def test_a_templated_task_is_kept_whole_where_whole_rows_were_judged_it_was_refused(tmp_path, task):
    rows = task(700)
    whole = build(tmp_path, rows, "whole", template_min_rows=None)
    assert whole.report.dropped_fraction > 0.15  # the template's n-grams counted as leaks and near duplicates
    assert {"contaminated", "near_duplicate"} <= set(whole.report.dropped)
    version = build(tmp_path, rows)
    assert version.report.dropped == {} and version.report.rows_kept == 700


def long_review(rng: random.Random, words: int = 30) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(words)) + "."


def templated_with_copies(rng: random.Random, edit, words: int = 30) -> tuple[list[dict], list[str]]:
    """300 sentiment rows with long varying reviews, keyed, and a train copy of 20 holdout rows edited by `edit`."""
    rows = [
        {"id": f"r{i}", "question": f"{INSTRUCTION} {long_review(rng, words)} Rated {rng.randrange(100)} of 100."}
        for i in range(300)
    ]
    for r in rows:
        r["answer"] = "1"
    holdout = [r for r in rows if split_of(r["id"]) == "holdout"][:20]
    copies = []
    for i, r in enumerate(holdout):
        copies.append({"id": key_in("train", f"copy{i}-"), "question": edit(r["question"]), "answer": "1"})
    return rows + copies, [c["id"] for c in copies]


def one_word_changed(text: str) -> str:
    w = text.split()
    w[-15] = "changed"
    return " ".join(w)


def number_changed(text: str) -> str:
    w = text.split()
    w[-3] = str(int(w[-3]) + 1)  # 'Rated N of 100.'
    return " ".join(w)


@pytest.mark.parametrize("edit", [one_word_changed, number_changed])
def test_a_holdout_question_copied_into_train_with_one_word_or_number_changed_is_still_contaminated(tmp_path, edit):
    # A 60-word varying part: one word changed leaves 3/4 of its 13-grams. The share is of what varies, so a copy is
    # caught where the varying part alone, as a question of its own, would be (a 30-word one keeps under half).
    rows, copies = templated_with_copies(random.Random(0), edit, words=60)
    version = build(tmp_path, rows, key_column="id", near_dup_threshold=None)
    quarantine = read(version.quarantine)
    assert sorted(q["row"]["key"] for q in quarantine) == sorted(copies)
    assert {q["reason"] for q in quarantine} == {"contaminated"}
    assert "template words aside" in quarantine[0]["detail"]


def test_near_dedup_drops_a_one_word_change_of_the_varying_part_not_another_input(tmp_path):
    rng = random.Random(1)
    rows, copies = templated_with_copies(rng, one_word_changed, words=60)  # 5-gram Jaccard about 0.85
    version = build(tmp_path, rows, key_column="id", contamination_threshold=None)
    quarantine = read(version.quarantine)
    assert sorted(q["row"]["key"] for q in quarantine) == sorted(copies)
    assert {q["reason"] for q in quarantine} == {"near_duplicate"}


def test_an_eval_set_sharing_the_instruction_leaks_nothing_but_its_own_items(tmp_path):
    rows = sentiment_rows(700)
    benchmark = [{"question": f"{INSTRUCTION} {long_review(random.Random(i), 12)}"} for i in range(50)]
    leaked = [{"question": b["question"], "answer": "1"} for b in benchmark[:5]]
    eval_set = tmp_path / "bench.jsonl"
    eval_set.write_text("".join(json.dumps(b) + "\n" for b in benchmark))
    version = build(tmp_path, rows + leaked, eval_sources=[str(eval_set)])
    quarantine = read(version.quarantine)
    dropped = {q["row"]["prompt"][-1]["content"] for q in quarantine}
    # The five copies are dropped where their key puts them in train; nothing else is.
    leaked_in_train = {r["question"] for r in leaked if split_of(build_key(r["question"])) == "train"}
    assert dropped == leaked_in_train and leaked_in_train
    assert {q["reason"] for q in quarantine} == {"contaminated"}


def build_key(prompt: str) -> str:
    """The default key: the normalized prompt's hash, as the data stage makes it."""
    import hashlib

    return hashlib.sha256(" ".join(prompt.lower().split()).encode()).digest()[:8].hex()


@pytest.mark.skipif(not (GSM8K / "train.jsonl").is_file(), reason="GSM8K is not in ../shared/data")
def test_gsm8k_drops_the_same_rows_for_the_same_reasons_with_or_without_template_ngrams(tmp_path):
    cfg = DataConfig(
        source=str(GSM8K / "train.jsonl"),
        prompt_column="question",
        answer_extraction="gsm8k",
        eval_sources=[str(GSM8K / "test.jsonl")],
        max_prompt_tokens=None,
    )
    dropped = {}
    for name, min_rows in (("whole", None), ("template", 10)):
        version = build_dataset(cfg.model_copy(update={"template_min_rows": min_rows}), tmp_path / name)
        dropped[name] = sorted((q["reason"], q["row"]["key"]) for q in read(version.quarantine))
    assert dropped["template"] == dropped["whole"]
    assert {r for r, _ in dropped["whole"]} == {"contaminated", "near_duplicate"}
