"""bench.hpo_gain's bookkeeping and statistics, with stand-in arms: a partial work folder resumes with only what is
missing, a folder of another configuration is refused, and no interval is printed from fewer than 3 seeds."""

import json
import random

import pytest

from bench import hpo_gain


def _totals(level: float, seed: int, n: int = 20) -> list[float]:
    rng = random.Random(seed * 100 + int(level * 10))
    return [min(2.0, max(0.0, level + rng.choice((-0.5, 0.0, 0.5)))) for _ in range(n)]


@pytest.fixture
def stand_ins(monkeypatch):
    """Arms that return fixed figures at once (searched best, hand close, defaults at the base), and no model."""
    ran: list[str] = []

    def fixed(cfg, setup, folder):
        arm = folder.name.split("-s")[0]
        seed = cfg.train.grpo["seed"]
        ran.append(f"{arm}/{seed}")
        level = {"defaults": 0.1, "hand": 1.0}[arm]
        totals = _totals(level, seed)
        return {"holdout_reward": sum(totals) / len(totals), "holdout_totals": totals, "train_s": 100.0}

    def searched(start, setup, folder, seed):
        ran.append(f"searched/{seed}")
        totals = _totals(1.1, seed)
        return {
            "holdout_reward": sum(totals) / len(totals),
            "holdout_totals": totals,
            "train_s": 100.0,
            "search_s": 250.0,
            "search_over_training": 2.5,
            "search_steps_over_training": 1.5,
        }

    monkeypatch.setattr(hpo_gain, "base_model", lambda work, tiny: "m")
    monkeypatch.setattr(hpo_gain, "prepare", lambda task, cfg, work, tiny: {"holdout": work / "h.jsonl"})
    monkeypatch.setattr(hpo_gain, "library_defaults", lambda: {"train.grpo.learning_rate": 1e-6})

    class Scored:
        reward, n = 0.075, 20

    monkeypatch.setattr(hpo_gain, "holdout", lambda setup, adapter: Scored())
    monkeypatch.setattr(hpo_gain, "run_fixed", fixed)
    monkeypatch.setattr(hpo_gain, "run_searched", searched)
    return ran


def test_a_partial_work_folder_resumes_with_only_the_missing_runs(tmp_path, results, stand_ins):
    args = ["--seeds", "0", "1", "2", "--work", str(tmp_path / "work")]
    assert hpo_gain.main(args) == 0
    assert len(stand_ins) == 9
    runs_file = tmp_path / "work" / "demo" / "runs.json"
    kept = json.loads(runs_file.read_text())
    for arm in hpo_gain.ARMS:  # a run killed during seed 2: its runs were never kept
        del kept["runs"][f"{arm}/2"]
    runs_file.write_text(json.dumps(kept))
    stand_ins.clear()
    assert hpo_gain.main(args) == 0
    assert sorted(stand_ins) == ["defaults/2", "hand/2", "searched/2"]
    report = json.loads((results / "hpo_gain.json").read_text())
    assert report["status"] == "complete" and report["base_reward"] == 0.075
    goals = report["summary"]["goals"]
    assert goals == {
        "searched > defaults beyond noise": "met",
        "searched >= hand within noise or above": "met",
        "search cost <= 3 training runs": "met",
    }
    searched = report["summary"]["arms"]["searched"]
    assert searched["seeds"] == 3 and searched["low"] < searched["mean"] < searched["high"]
    assert report["summary"]["cost"]["median_runs"] == 2.5
    stand_ins.clear()
    assert hpo_gain.main([*args, "--report-only"]) == 0 and stand_ins == []


def test_a_work_folder_of_another_configuration_is_refused(tmp_path, results, stand_ins, capsys):
    work = tmp_path / "work"
    assert hpo_gain.main(["--seeds", "0", "--arms", "hand", "--work", str(work)]) == 0
    before = (work / "demo" / "runs.json").read_text()
    stand_ins.clear()
    # the same folder with longer trials: its runs were made by another search
    assert hpo_gain.main(["--seeds", "0", "1", "--trial-steps", "16", "--work", str(work)]) == 2
    err = capsys.readouterr().err
    assert str(work / "demo") in err and "--fresh" in err
    assert stand_ins == [] and (work / "demo" / "runs.json").read_text() == before
    assert hpo_gain.main(["--seeds", "0", "--arms", "hand", "--trial-steps", "16", "--fresh", "--work", str(work)]) == 0
    assert stand_ins == ["hand/0"]


def test_two_seeds_print_no_interval_and_judge_no_goal():
    """The earlier result printed a t interval of -4.67 to 6.03 for a 0..2 reward from two seeds."""
    runs = {
        f"{arm}/{seed}": {"holdout_reward": level, "holdout_totals": [level] * 10}
        for seed, (hand, searched) in enumerate(((0.258, 0.075), (1.100, 0.9)))
        for arm, level in (("hand", hand), ("searched", searched), ("defaults", 0.075))
    }
    summary = hpo_gain.summarize(runs, 0.075)
    assert summary["arms"]["hand"]["low"] is None
    assert summary["arms"]["hand"]["interval"] == "not printed: 2 seeds (3 needed)"
    assert summary["goals"]["searched >= hand within noise or above"] == "not judged: 2 seeds (3 needed)"
    assert summary["goals"]["search cost <= 3 training runs"] == "not run"
    rows = hpo_gain.table_rows(
        lambda name: {"status": "complete", "steps": 40, "summary": summary} if name == "hpo_gain" else None
    )
    assert all("–" not in row.baseline and "not judged" in row.note for row in rows)


def test_the_earlier_designs_result_is_shown_as_such_not_as_an_interval():
    earlier = {"summary": {"arms": {"hand": {"mean": 0.679, "low": -4.67, "high": 6.03, "n": 2}}}, "status": "partial"}
    (row,) = hpo_gain.table_rows(lambda name: earlier if name == "hpo_gain" else None)
    assert "earlier design" in row.note and "6.03" not in row.baseline + row.candidate + row.note


def test_from_trial_length_takes_the_chosen_schedule_or_says_why_not(tmp_path, results, stand_ins, capsys):
    results.mkdir()
    saved = {"tasks": {"demo": {"choice": {"steps": None, "reason": "no trial length clears the threshold"}}}}
    (results / "trial_length.json").write_text(json.dumps(saved))
    work = tmp_path / "work"
    assert hpo_gain.main(["--seeds", "0", "--from-trial-length", "--work", str(work)]) == 2
    assert "no trial length clears the threshold" in capsys.readouterr().err and stand_ins == []
    saved["tasks"]["demo"]["choice"] = {"steps": 16, "eval_every": 4, "reduction_factor": 2, "reason": "k=16"}
    (results / "trial_length.json").write_text(json.dumps(saved))
    assert hpo_gain.main(["--seeds", "0", "--arms", "hand", "--from-trial-length", "--work", str(work)]) == 0
    search = json.loads((results / "hpo_gain.json").read_text())["search"]
    assert (search["trial_steps"], search["eval_every"], search["reduction_factor"]) == (16, 4, 2)
