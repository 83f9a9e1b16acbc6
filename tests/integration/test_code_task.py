"""A code task through the data stage: rows with `tests` choose `code_tests`, each reference solution is run against
its row's tests in the sandbox, and a row without tests, with tests of the wrong type, or whose reference fails its
own tests is quarantined with the reason."""

from __future__ import annotations

import pytest

from tests.unit.test_data import read
from tests.unit.test_own_task import built, write

pytestmark = pytest.mark.integration  # the sandbox runs each reference solution in a subprocess


def test_a_code_task_keeps_rows_whose_reference_passes_and_quarantines_the_rest(tmp_path):
    rows = [
        {
            "prompt": f"Write add{i}(a, b).",
            "answer": f"def add{i}(a, b):\n    return a + b",
            "tests": f"assert add{i}(2, 3) == 5",
        }
        for i in range(6)
    ]
    rows += [
        {"prompt": "Write sub(a, b).", "answer": "def sub(a, b):\n    return a - b"},  # no tests
        {"prompt": "Write mul(a, b).", "answer": "def mul(a, b):\n    return a * b", "tests": {"a": 1}},
        {"prompt": "Write neg(a).", "answer": "def neg(a):\n    return a", "tests": "assert neg(2) == -2"},
    ]
    cfg, version = built(tmp_path, write(tmp_path / "code.jsonl", rows), "data.near_dup_threshold=null")
    assert cfg.train.reward_set().skill == "code_tests"  # chosen by the tests column
    kept = read(version.splits["train"]) + read(version.splits["val"]) + read(version.splits["holdout"])
    assert sorted(r["prompt"][-1]["content"] for r in kept) == [f"Write add{i}(a, b)." for i in range(6)]
    assert all(r["tests"].startswith("assert add") for r in kept)  # the tests travel with the row
    why = {q["row"]["answer"].split("(")[0]: (q["reason"], q["detail"]) for q in read(version.quarantine)}
    assert why["def sub"] == ("missing_field", "no 'tests' (the row has: prompt, answer)")
    assert why["def mul"] == (
        "wrong_type",
        "'tests' is an object here and text in the rows before: one type per column",
    )
    assert why["def neg"] == (
        "answer_unverifiable",
        "reward 'code_tests' gives 0.0 to the answer 'def neg(a):\\n    return a' itself",
    )
