"""Drift of today's new rows from the champion's (issue #26, item 4): the statistics on two row sets, the alert, the
report's section, and `data.drift_alert` refused at load when out of range."""

import numpy as np
import pytest

from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.tasks.data.drift import (
    assess,
    drift_metrics,
    length_shift,
    not_measured,
    reward_drop,
    split_rows,
)
from grpo_pipeline.tasks.data.stage import CORRECT_ANSWER, config_hash, dataset_key
from grpo_pipeline.tasks.report import drift_lines


def _rows(prefix, lengths, answers):
    return [
        {"key": f"{prefix}{i}", "prompt": [{"role": "user", "content": "x" * n}], "answer": a}
        for i, (n, a) in enumerate(zip(lengths, answers, strict=True))
    ]


def _lengths(mean, n, seed):
    return [max(1, int(v)) for v in np.random.default_rng(seed).normal(mean, 10, n)]


def test_a_shifted_length_distribution_flags_and_a_like_one_does_not():
    seen = _lengths(60, 400, seed=1)
    assert not length_shift(_lengths(60, 300, seed=2), seen).shifted  # another sample of the same distribution
    shifted = length_shift(_lengths(75, 300, seed=3), seen)
    assert shifted.shifted and shifted.p_value < 0.01 and 10 < shifted.new_mean - shifted.seen_mean < 20
    # significant but tiny: a 1-character shift over many rows is not worth a flag
    tiny = length_shift(_lengths(61, 20000, seed=4), _lengths(60, 20000, seed=5))
    assert tiny.p_value < 0.01 and not tiny.shifted


def test_answer_type_shares_of_the_new_and_the_seen_rows():
    seen = _rows("s", [10] * 20, ["12"] * 18 + ["1.5", "3/4"])
    new = _rows("n", [10] * 10, ["7", "-1,200", "0.25", "seven", "n/a", "x=3", "1e3", "4/5", "8", "nine"])
    rows = split_rows(seen + new, {f"s{i}" for i in range(20)}, salt="fp")
    drift = assess("3", rows, None, threshold=0.1)
    a = drift.answer_types
    assert a.new == {"integer": 0.3, "decimal": 0.2, "fraction": 0.1, "text": 0.4}
    assert a.seen == {"integer": 0.9, "decimal": 0.05, "fraction": 0.05, "text": 0.0}
    assert (a.numeric_new, a.numeric_seen) == (pytest.approx(0.6), 1.0) and a.distance == pytest.approx(0.6)
    assert a.shifted and drift.shifted == ["answer type"]
    assert not drift.alert and drift.reward is None and "reward was not measured" in drift.notes[0]


def test_the_scored_sample_is_bounded_reproducible_and_new_only():
    rows = _rows("s", [5] * 50, ["1"] * 50) + _rows("n", [9] * 300, ["2"] * 300)
    seen = {f"s{i}" for i in range(50)}
    out = split_rows(rows, seen, salt="fp1", limit=40)
    assert (len(out.new), len(out.seen), len(out.sample)) == (300, 50, 40)
    assert all(r["key"].startswith("n") for r in out.sample)
    assert split_rows(rows[::-1], seen, salt="fp1", limit=40).sample == out.sample[::-1]  # the rows' order aside
    assert split_rows(rows, seen, salt="fp2", limit=40).sample != out.sample  # another dataset, another sample


def test_the_alert_fires_past_the_threshold_only():
    same = split_rows(
        _rows("s", [5] * 10, ["1"] * 10) + _rows("n", [5] * 10, ["1"] * 10), {f"s{i}" for i in range(10)}, "f"
    )
    drop = reward_drop([1.0, 1.0, 1.0, 0.0] * 25, [1.0, 0.0] * 50)  # 0.75 -> 0.5
    assert drop.drop == pytest.approx(0.25) and drop.ci_low < 0.25 < drop.ci_high
    alerted = assess("4", same, drop, threshold=0.2)
    assert alerted.alert and alerted.alert_reason.startswith("champion v4 scores 0.500 on 100 new rows against 0.750")
    assert not assess("4", same, drop, threshold=0.3).alert
    assert not assess("4", same, drop, threshold=None).alert  # off: measured, never alerted
    metrics = drift_metrics(alerted)
    assert metrics["drift/alert"] == 1.0 and metrics["drift/champion_reward_drop"] == pytest.approx(0.25)
    assert metrics["drift/prompt_chars_shifted"] == 0.0
    section = "\n".join(drift_lines(alerted))
    assert "**Alert**: champion v4" in section and "**beyond** data.drift_alert=0.2" in section


def test_nothing_to_compare_is_said_not_guessed():
    skipped = not_measured("no champion yet: nothing to compare today's rows with")
    assert drift_metrics(skipped) == {} and not skipped.alert
    assert drift_lines(skipped)[2] == "Not measured: no champion yet: nothing to compare today's rows with."
    # the champion's rows have all left the source: the reward is still compared, the rows are not
    gone = split_rows(_rows("n", [5] * 4, ["1"] * 4), {"s1", "s2"}, "f")
    drift = assess("2", gone, reward_drop([1.0, 0.0], [0.0, 0.0]), threshold=None)
    assert drift.lengths is None and drift.answer_types is None and drift.seen_missing == 2
    assert "none of the 2 rows champion v2 trained on" in drift.notes[0]


@pytest.mark.parametrize(
    "value, message",
    [
        ("-0.1", "data.drift_alert: Input should be greater than or equal to 0"),
        ("nan", "data.drift_alert: Input should be a finite number"),
        ("much", "data.drift_alert: Input should be a valid number"),
    ],
)
def test_a_drift_alert_out_of_range_is_refused_at_load(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"data.drift_alert={value}"])


def test_the_alert_threshold_neither_retrains_nor_rebuilds_the_data():
    on = load_config(None, ["data.drift_alert=0.1"])
    assert config_hash(on) == config_hash(load_config(None))  # so data.skip_unchanged still skips
    assert dataset_key(on.data, None, CORRECT_ANSWER) == dataset_key(load_config(None).data, None, CORRECT_ANSWER)


def test_the_decision_report_is_marked_and_shows_the_drift_section():
    from markdown_it import MarkdownIt

    from grpo_pipeline.configs.rewards import RewardSet
    from grpo_pipeline.tasks.evaluate import score
    from grpo_pipeline.tasks.promote.decide import PromotionDecision
    from grpo_pipeline.tasks.promote.serving import ServingCheck
    from grpo_pipeline.tasks.report import render_markdown
    from grpo_pipeline.tasks.summary import Holdout, RegistryOutcome

    rows = [{"key": "q1", "prompt": "What is 2 + 2?", "answer": "4"}]
    result = score(rows, ["4"], RewardSet(names=("correct_answer",)), [1])
    check = ServingCheck(model_uri="models:/m/5", prompts=1, matched=1, passed=True, seconds=1.0)
    registry = RegistryOutcome(
        model="m",
        candidate_version="5",
        decided_against="4",
        moves=[],
        aliases={"champion": "4"},
        base_model="org/base",
        serving_check=check,
    )
    rows = split_rows(
        _rows("s", [10] * 30, ["1"] * 30) + _rows("n", [40] * 30, ["x"] * 30), {f"s{i}" for i in range(30)}, "f"
    )
    drift = assess("4", rows, reward_drop([1.0] * 20 + [0.0] * 10, [1.0] * 5 + [0.0] * 25), threshold=0.1)
    markdown = render_markdown(
        Holdout.of(result, result, result, "correct_answer"),
        PromotionDecision(promote=True, reasons=["gain"], stats={}),
        registry,
        drift=drift,
    )
    assert markdown.splitlines()[5].startswith("**Drift alert**: champion v4 scores 0.167 on 30 new rows")
    page = MarkdownIt("commonmark").enable("table").render(markdown)
    assert "<td>prompt characters, mean (median)</td>\n<td>10.0 (10)</td>\n<td>40.0 (40)</td>" in page
    assert "<td>answers: text</td>\n<td>0.0%</td>\n<td>100.0%</td>" in page
    quiet = render_markdown(
        Holdout.of(result, result, result, "correct_answer"),
        PromotionDecision(promote=True, reasons=["gain"], stats={}),
        registry,
        drift=not_measured("no champion yet"),
    )
    assert "Drift alert" not in quiet and "Not measured: no champion yet." in quiet


def test_a_drop_past_the_threshold_within_noise_is_noted_not_alerted():
    same = split_rows(
        _rows("s", [5] * 10, ["1"] * 10) + _rows("n", [5] * 10, ["1"] * 10), {f"s{i}" for i in range(10)}, "f"
    )
    # 0.6 -> 0.4 on 10 rows each: a drop of 0.2, past 0.1, but its interval reaches well below 0
    noisy = reward_drop([1.0] * 6 + [0.0] * 4, [1.0] * 4 + [0.0] * 6)
    assert noisy.drop == pytest.approx(0.2) and noisy.ci_low < 0
    drift = assess("4", same, noisy, threshold=0.1)
    assert not drift.alert and drift.alert_reason is None
    assert any(
        n.startswith("no alert: the drop of 0.200 is past data.drift_alert=0.1 but within sampling noise")
        for n in drift.notes
    )
    # every row the same on each side: the difference is exact, so past the threshold it alerts
    assert assess("4", same, reward_drop([1.0] * 5, [0.0] * 5), threshold=0.1).alert
    # one row a side tells nothing
    assert not assess("4", same, reward_drop([1.0], [0.0]), threshold=0.1).alert
