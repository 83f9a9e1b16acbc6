"""bench.trial_length's choice of the trial length and rungs from a correlation table (a small fake one), and its
correlation from per-configuration scores."""

import json

import pytest

from bench import trial_length
from bench.trial_length import Correlation, choose_schedule, correlation, table


def rows(*entries):
    """(k, rho, lower bound) -> Correlation rows over 8 configurations."""
    return [Correlation(k, 8, rho, low, None if low is None else min(1.0, rho + 0.2)) for k, rho, low in entries]


def test_the_shortest_length_that_clears_the_threshold_and_rungs_that_rank_above_chance():
    trial = rows((4, 0.40, -0.10), (8, 0.75, 0.62), (16, 0.92, 0.80))
    rung = rows((4, 0.55, 0.05), (8, 0.70, 0.30), (16, 0.85, 0.60))
    s = choose_schedule(trial, rung, final_steps=40)
    assert (s.steps, s.eval_every, s.reduction_factor, s.rungs) == (8, 4, 2, (4, 8))
    assert s.sets() == ["hpo.steps=8", "hpo.eval_every=4", "hpo.reduction_factor=2", "hpo.pruner=successive_halving"]
    assert "k=8" in s.reason and "first rung k=4" in s.reason


def test_a_stricter_threshold_asks_for_longer_trials_and_rungs_land_on_the_trial_length():
    trial = rows((4, 0.40, -0.10), (8, 0.75, 0.62), (16, 0.92, 0.80))
    rung = rows((4, 0.55, 0.05), (8, 0.70, 0.30))
    s = choose_schedule(trial, rung, final_steps=40, threshold=0.7)
    assert (s.steps, s.eval_every, s.rungs) == (16, 4, (4, 8, 16))


def test_rungs_no_better_than_chance_mean_no_pruning():
    trial = rows((4, 0.80, 0.65), (8, 0.9, 0.8))
    s = choose_schedule(trial, rows((4, 0.3, -0.4)), final_steps=40)
    assert (s.steps, s.eval_every, s.rungs) == (4, 4, (4,)) and "no pruning" in s.reason


def test_when_no_length_clears_the_threshold_no_length_is_chosen_and_the_reason_says_which_came_closest():
    s = choose_schedule(rows((4, 0.2, -0.5), (8, 0.5, 0.1), (16, 0.6, 0.3)), [], final_steps=40)
    assert s.steps is None and s.sets() == [] and s.rungs == ()
    assert "the best is k=16" in s.reason and "ranks configurations by noise" in s.reason


def test_lengths_beyond_the_final_training_and_rows_without_an_interval_are_not_chosen():
    trial = [Correlation(4, 3, 0.9, None, None, "3 configurations: no interval (4 needed)")] + rows((64, 0.95, 0.9))
    s = choose_schedule(trial, [], final_steps=40)
    assert s.steps is None and "no trial length has an interval" in s.reason


def test_the_table_correlates_each_score_at_each_k_with_the_final_reward():
    runs = {
        f"c{i}": {"greedy": {"4": g4, "8": g8}, "rung": {"4": r4}, "holdout_reward": final}
        for i, (g4, g8, r4, final) in enumerate(
            [
                (0.1, 0.1, 0.3, 0.1),
                (0.3, 0.2, 0.1, 0.2),
                (0.2, 0.4, 0.2, 0.5),
                (0.5, 0.6, 0.4, 0.7),
                (0.4, 0.9, 0.6, 0.9),
            ]
        )
    }
    runs["c9"] = {"greedy": {"4": 0.0}, "rung": {}}  # unfinished: left out
    t = table(runs, [4, 8])
    assert [c.k for c in t["trial"]] == [4, 8] and t["trial"][1].rho == pytest.approx(1.0)
    assert t["trial"][0].n == 5 and t["rung"][1].n == 0 and t["rung"][1].rho is None
    assert t["trial"][0].rho == pytest.approx(correlation(4, [0.1, 0.3, 0.2, 0.5, 0.4], [0.1, 0.2, 0.5, 0.7, 0.9]).rho)


def test_a_work_folder_resumes_its_configurations_and_refuses_another_ones(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    monkeypatch.setattr("bench.harness.RESULTS", results)
    work = tmp_path / "work"
    args = ["--tiny", "--configurations", "c1", "c6", "--work", str(work)]
    # a finished folder of this configuration: nothing runs, the report is rebuilt from it
    monkeypatch.setattr(trial_length, "run_configuration", lambda *a: pytest.fail("ran a kept configuration"))
    assert trial_length.main([*args, "--report-only"]) == 0
    current = json.loads((results / "trial_length_tiny.json").read_text())["tasks"]["demo"]["fingerprint"]
    kept = {
        "c1": {"greedy": {"1": 0.1}, "rung": {}, "holdout_reward": 0.2},
        "c6": {"greedy": {"1": 0.3}, "rung": {}, "holdout_reward": 0.4},
    }
    (work / "demo" / "tiny").mkdir(parents=True)
    (work / "demo" / "tiny" / "runs.json").write_text(json.dumps({"fingerprint": current, "runs": kept}))
    assert trial_length.main(args) == 0
    report = json.loads((results / "trial_length_tiny.json").read_text())["tasks"]["demo"]
    assert set(report["configurations"]) == {"c1", "c6"} and report["choice"]["steps"] is None
    assert trial_length.main([*args, "--ks", "1", "2"]) == 2  # other trial lengths: another configuration
    err = capsys.readouterr().err
    assert str(work / "demo" / "tiny") in err and "--fresh" in err
