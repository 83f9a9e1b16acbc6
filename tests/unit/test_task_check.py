"""The task check's pure parts: the verdict rule on fake measurements, the intervals, the figures read from samples,
the training estimate's factor against its benchmark, the cache key and a corrupt cache entry."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.tasks import check as tc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("accuracy", "mixed", "format_share", "expected"),
    [
        (0.42, 0.69, 0.05, "learnable"),  # the demo's base: many mixed groups
        (0.0, 0.0, 0.0, "too_hard"),  # nothing right anywhere
        (0.5, 0.0, None, "too_hard"),  # every group flat, right or wrong: still nothing to learn from
        (0.02, 1 / 32, None, "learnable"),  # one mixed group of 32 is a start (dynamic sampling finds it)
        (1.0, 0.0, None, "already_solved"),
        (tc.ALREADY_SOLVED_ACCURACY, tc.ALREADY_SOLVED_MIXED, None, "already_solved"),  # both bounds inclusive
        (tc.ALREADY_SOLVED_ACCURACY, tc.ALREADY_SOLVED_MIXED + 0.01, None, "learnable"),  # groups left to sharpen
        (tc.ALREADY_SOLVED_ACCURACY - 0.01, 0.1, None, "learnable"),
        (0.05, 0.2, tc.FORMAT_FIRST_SHARE, "format_first"),
        (0.05, 0.2, tc.FORMAT_FIRST_SHARE - 0.01, "learnable"),
        (0.0, 0.0, 0.9, "format_first"),  # right answers the reward cannot read: not too hard, misread
        (0.95, 0.1, 0.9, "already_solved"),  # solved first: the few misreadings cost little
    ],
)
def test_verdict_on_fake_measurements(accuracy, mixed, format_share, expected):
    verdict, reason, fixes = tc.verdict(accuracy, mixed, format_share)
    assert verdict == expected
    assert reason and ("accuracy" in reason or "right on" in reason or "wrong answers" in reason)
    assert bool(fixes) == (expected != "learnable")


def test_too_hard_names_the_fixes():
    _, _, fixes = tc.verdict(0.0, 0.0, None)
    text = " ".join(fixes)
    assert "base model" in text and "curriculum" in text and "prompt" in text


def test_clustered_interval_covers_the_mean_and_widens_with_fewer_prompts():
    rng = np.random.default_rng(1)
    means = list(rng.uniform(0.2, 0.6, size=32))
    low, high = tc.clustered_interval(means)
    assert low < float(np.mean(means)) < high
    low8, high8 = tc.clustered_interval(means[:8])
    assert high8 - low8 > high - low
    assert tc.clustered_interval(means) == (low, high)  # seeded: the same interval every time


def test_intervals_at_the_edges_are_wilsons_on_prompts():
    assert tc.clustered_interval([1.0] * 10) == tc.proportion_interval(10, 10)
    low, high = tc.proportion_interval(0, 32)
    assert low == 0.0 and 0.05 < high < 0.15  # none of 32 seen: up to about a tenth could still be mixed
    assert tc.proportion_interval(0, 0) == (0.0, 1.0)


def test_read_samples_counts_groups_lengths_and_the_format():
    skill = [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.5, 0.0]]
    lengths = [[4, 6], [8, 16], [16, 16], [3, 2]]
    holds = [[None, None], [None, True], [True, False], [None, None]]
    r = tc.read_samples(skill, lengths, holds, cap=16)
    assert r["accuracy"] == pytest.approx(3.5 / 8)
    assert (r["mixed_prompts"], r["all_right_prompts"], r["all_wrong_prompts"]) == (2, 1, 1)
    assert r["mixed_fraction"] == 0.5
    assert (r["right_length_median"], r["right_length_max"]) == (5.0, 8)  # 4, 6, 8, 3
    assert r["cut_share"] == 3 / 8
    assert r["wrong_samples"] == 4 and r["format_share"] == pytest.approx(2 / 3)  # one wrong sample had no reference


@pytest.mark.parametrize(
    ("completion", "reference", "prompt", "holds"),
    [
        ("The answer is 17.", "17", "What is 3 + 14?", True),
        ("3 + 14 = 18", "17", "What is 3 + 14?", False),
        ("3 + 14 = 18", "3", "What is 3 + 14?", False),  # an echo of the question is no answer
        ("Three plus fourteen is 17", 17, "", True),  # a number as the data holds it
        ("NEGATIVE", "negative", "positive or negative?", True),
        ("positive or negative? I think positive", "negative", "positive or negative?", False),
        ('{"a": 1}', {"a": 1}, "", False),  # structured references are their reward's to read
    ],
)
def test_holds_reference(completion, reference, prompt, holds):
    assert tc.holds_reference(completion, reference, prompt) is holds


def test_pick_prompts_tops_up_from_train_and_says_so():
    val = [{"key": f"v{i}"} for i in range(3)]
    train = [{"key": f"t{i}"} for i in range(50)]
    rows, topped, note = tc.pick_prompts(val, train, 10, seed=0)
    assert [r["key"] for r in rows[:3]] == ["v0", "v1", "v2"] and topped == 7 and len(rows) == 10
    assert "topped up with 7 train rows" in note
    assert tc.pick_prompts(val, train, 10, seed=0)[0] == rows  # seeded
    assert tc.pick_prompts(val, train, 10, seed=1)[0] != rows
    assert tc.pick_prompts(val, train, 2, seed=0) == (val[:2], 0, None)
    assert len(tc.pick_prompts(val, train[:2], 10, seed=0)[0]) == 5  # what there is


def test_step_over_generation_is_the_benchmarks_figure():
    profile = json.loads((ROOT / tc.STEP_PROFILE).read_text())
    measured = profile["wall"]["candidate"] / profile["groups"]["generation"]["candidate"]
    assert tc.STEP_OVER_GENERATION == pytest.approx(measured, abs=0.01)


def test_estimate_scales_with_steps_groups_and_oversample():
    base = {"groups_per_step": 2.0, "oversample": 1.0, "max_steps": 40, "num_train_epochs": 3.0}
    plain = tc.estimate_training(8.0, 4, base, 100)
    assert plain.step_seconds == pytest.approx(2.0 * 2 * tc.STEP_OVER_GENERATION)
    assert tc.estimate_training(8.0, 4, base | {"max_steps": 80}, 100).seconds == pytest.approx(2 * plain.seconds)
    oversampled = tc.estimate_training(8.0, 4, base | {"oversample": 2.0}, 100)
    assert oversampled.step_seconds == pytest.approx(plain.step_seconds + 2.0 * 2)  # one more generation per group
    assert "oversample" in oversampled.how and tc.STEP_PROFILE in oversampled.how
    epochs = tc.estimate_training(8.0, 4, base | {"max_steps": -1}, 100)
    assert epochs.steps == 150  # 3 epochs of 100 rows at 2 prompts a step


def test_recipe_reads_the_training_settings():
    cfg = load_config(ROOT / "configs" / "demo-cpu.yaml", ["train.dynamic_sampling.oversample=3"])
    r = tc.recipe(cfg.train)
    assert (r["oversample"], r["groups_per_step"], r["temperature"], r["max_completion_length"]) == (3.0, 2.0, 0.8, 16)
    assert tc.recipe(load_config(None, ["train.dynamic_sampling.enabled=false"]).train)["oversample"] == 1.0


KEY_ARGS = {
    "fingerprint": "fp",
    "model_path": "/m",
    "model_files": [("model.safetensors", 10, 1)],
    "model_load": {"quantization": "none"},
    "rewards": {"entries": [{"name": "correct_answer"}]},
    "generation": {"num_generations": 8, "temperature": 0.8, "max_completion_length": 16},
    "prompts": 16,
    "seed": 0,
    "code": "c0",
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fingerprint", "fp2"),
        ("model_path", "/other"),
        ("model_files", [("model.safetensors", 10, 2)]),  # the weights rewritten
        ("model_load", {"quantization": "nf4"}),
        ("rewards", {"entries": [{"name": "math_answer"}]}),
        ("generation", {"num_generations": 8, "temperature": 1.0, "max_completion_length": 16}),
        ("prompts", 32),
        ("seed", 1),
        ("code", "c1"),
    ],
)
def test_a_changed_input_changes_the_cache_key(field, value):
    assert tc.cache_key(**KEY_ARGS) == tc.cache_key(**KEY_ARGS)
    assert tc.cache_key(**(KEY_ARGS | {field: value})) != tc.cache_key(**KEY_ARGS)


def test_the_model_files_identity_follows_a_rewrite(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a")
    before = tc.model_identity(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"ab")
    assert tc.model_identity(str(tmp_path)) != before
    assert tc.model_identity("org/hub-id") == []


def _check(**update):
    fields = {
        "verdict": "learnable",
        "reason": "r",
        "skill": "correct_answer",
        "fingerprint": "fp",
        "rows_kept": 10,
        "quarantined": {"duplicate": 1},
        "splits": {"train": 6, "val": 2, "holdout": 2},
        "model_path": "/m",
        "prompts": 2,
        "prompts_from_val": 2,
        "prompts_from_train": 0,
        "num_generations": 2,
        "temperature": 0.8,
        "max_completion_length": 16,
        "seed": 0,
        "samples": 4,
        "accuracy": 0.5,
        "accuracy_ci": (0.2, 0.8),
        "mixed_fraction": 0.5,
        "mixed_ci": (0.1, 0.9),
        "mixed_prompts": 1,
        "all_right_prompts": 0,
        "all_wrong_prompts": 1,
        "right_length_median": 3.0,
        "right_length_max": 4,
        "cut_share": 0.0,
        "wrong_samples": 2,
        "format_share": None,
        "load_seconds": 1.0,
        "generation_seconds": 2.0,
        "samples_per_second": 2.0,
        "tokens_per_second": 6.0,
        "estimate": tc.estimate_training(
            2.0, 2, {"groups_per_step": 1.0, "oversample": 1.0, "max_steps": 2, "num_train_epochs": 1.0}, 6
        ),
        "seconds": 3.0,
    }
    return tc.TaskCheck(**(fields | update))


def test_a_cache_entry_reads_back_and_a_corrupt_one_is_ignored_with_a_warning(tmp_path, caplog):
    path = tmp_path / "checks" / "k.json"
    assert tc.read_cached(path) is None
    tc.write_cached(path, _check())
    assert tc.read_cached(path) == _check()
    path.write_text('{"verdict": "learnable", "reas')  # cut short
    with caplog.at_level(logging.WARNING, logger="grpo_pipeline.tasks.check"):
        assert tc.read_cached(path) is None
    assert "ignoring the unreadable cache entry" in caplog.text
    path.write_text(json.dumps({"verdict": "maybe"}))  # valid JSON, not a check
    assert tc.read_cached(path) is None


def test_metrics_are_flat_floats_and_skip_what_was_not_measured():
    metrics = _check().metrics()
    assert metrics["task_check/accuracy"] == 0.5 and metrics["task_check/mixed_ci_high"] == 0.9
    assert "task_check/format_share" not in metrics  # None: nothing to log
    assert all(isinstance(v, float) for v in metrics.values())
    assert _check(verdict="too_hard").line().startswith("task check: too_hard: ")


def test_the_check_section_is_validated_and_named():
    cfg = load_config(None, ["check.prompts=8", "check.on_too_hard=warn"])
    assert (cfg.check.prompts, cfg.check.on_too_hard, cfg.check.enabled) == (8, "warn", True)
    with pytest.raises(ConfigError, match="check.on_too_hard"):
        load_config(None, ["check.on_too_hard=ignore"])
    with pytest.raises(ConfigError, match="check.prompts"):
        load_config(None, ["check.prompts=0"])
