"""bench.lora_vs_full's rules on fake results: the plateau, the rate chosen on validation only, the gap's interval,
the fairness checks that withhold the verdict, and the refusals of bad input."""

import json

import numpy as np
import pytest

from bench.lora_vs_full import (
    MIN_HOLDOUT,
    choose_rate,
    fair_rows,
    fairness_problems,
    gap_interval,
    main,
    min_holdout,
    next_rate_out,
    plateau,
    resolves,
    skill_reward,
    step_cuts,
    summarise_task,
    table_rows,
    task_rows,
)

FAIR_RATES = {"full": [1e-5, 3e-5, 1e-4], "lora": [1e-4, 3e-4, 1e-3]}


class Sealed(dict):
    """A run whose holdout must not be read."""

    def __getitem__(self, key):
        if key == "holdout":
            raise AssertionError("the holdout was read to choose a learning rate")
        return super().__getitem__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default


def test_the_rate_is_chosen_on_validation_and_the_holdout_is_never_read():
    def run(lr, val_skill):
        return Sealed(learning_rate=lr, validation={"skill": val_skill, "total": 1.0 + val_skill}, holdout={})

    assert choose_rate([run(1e-4, 0.3), run(3e-4, 0.5), run(1e-3, 0.4)]) == 3e-4
    # the holdout would pick 1e-3; validation picks 3e-4 and the holdout is not consulted
    runs = [dict(r, holdout={"skill": [h]}) for r, h in zip([run(3e-4, 0.5), run(1e-3, 0.4)], [0.1, 0.9], strict=True)]
    assert choose_rate(runs) == 3e-4
    with pytest.raises(ValueError, match="no runs"):
        choose_rate([])


def test_a_curve_still_rising_is_no_plateau_and_noise_around_a_level_is_one():
    rng = np.random.default_rng(0)
    rising = [[1.0] * (20 + 12 * k) + [0.0] * (100 - 20 - 12 * k) for k in range(6)]
    assert plateau(rising) is None
    # a level of 40 % with prompts flipping at random between evaluations: no gain beyond noise
    level = [list((rng.random(100) < 0.4).astype(float)) for _ in range(5)]
    assert plateau(level) == 2
    # one evaluation lower by chance does not hide a rise that goes on
    assert plateau([rising[0], rising[2], rising[1], rising[4], rising[5]]) is None


def test_the_gap_interval_narrows_with_the_holdout_and_says_when_it_resolves_3_from_10():
    rng = np.random.default_rng(3)
    full = (rng.random((3, 1000)) < 0.6).astype(float)
    arm = full * (rng.random((3, 1000)) > 0.05)  # a 5 % gap
    wide, narrow = gap_interval(full[:, :100], arm[:, :100]), gap_interval(full, arm)
    assert narrow["high_pct"] - narrow["low_pct"] < wide["high_pct"] - wide["low_pct"]
    assert resolves(narrow["low_pct"], narrow["high_pct"]) and not resolves(wide["low_pct"], wide["high_pct"])
    assert narrow["low_pct"] < 5 < narrow["high_pct"] and "bootstrap" in narrow["method"]
    with pytest.raises(ValueError, match="paired"):
        gap_interval(full, arm[:, :10])


def test_one_rate_few_seeds_a_small_holdout_or_a_short_cap_is_not_fair():
    assert fairness_problems(FAIR_RATES, [0, 1, 2], MIN_HOLDOUT, 80) == []
    problems = fairness_problems({"full": [3e-5, 3e-5, 3e-5], "lora": FAIR_RATES["lora"]}, [0, 1, 1, 1], 100, 200)
    assert [p.split(" ")[0] for p in problems] == ["full", "2", "a"]  # a repeated rate or seed counts once


def _run(arm, lr, seed, val_skill, holdout_skill, curve_skill, prompts=200):
    """A kept run as train_run writes it; holdout skill per prompt: the first share of prompts right."""
    right = int(holdout_skill * prompts)
    skill = [1.0] * right + [0.0] * (prompts - right)
    return {
        "task": "demo",
        "arm": arm,
        "learning_rate": lr,
        "seed": seed,
        "steps": 8 * (len(curve_skill) - 1),
        "stopped": "plateau",
        "cpu_s": 100.0,
        "seconds": 600.0,
        "eval_share": 0.4,
        "trainable_params": 1000 if arm == "full" else 10,
        "cuts": ["prefill_once"],
        "curve": [
            {"step": 8 * i, "train_s": 10.0 * i, "train_cpu_s": 20.0 * i, "skill": s, "total": 1 + s}
            for i, s in enumerate(curve_skill)
        ],
        "validation": {"skill": val_skill, "total": 1 + val_skill, "last": {"total": [1.0] * 10}},
        "holdout": {"skill": skill, "total": [1 + x for x in skill]},
    }


BASES = {
    "none": {
        "validation": {"total": [1.0] * 5 + [0.0] * 5},
        "holdout": {"skill": [1.0] * 20 + [0.0] * 180, "total": [0.0] * 200},
    },
    "nf4": {"validation": {"total": [0.0] * 10}, "holdout": {"skill": [1.0] * 10 + [0.0] * 190, "total": [0.0] * 200}},
}


def _fake_runs():
    runs = [
        _run("full", 1e-5, 0, 0.40, 0.90, [0.1, 0.3, 0.4]),
        _run("full", 3e-5, 0, 0.60, 0.50, [0.1, 0.5, 0.6]),  # best on validation, worse on the holdout
        _run("lora", 1e-4, 0, 0.50, 0.50, [0.1, 0.2, 0.5]),
        _run("lora", 3e-4, 0, 0.55, 0.45, [0.1, 0.58, 0.55]),
        _run("qlora", 3e-4, 0, 0.50, 0.40, [0.05, 0.3, 0.5]),
    ]
    for seed in (1, 2):
        runs += [
            _run("full", 3e-5, seed, 0.60, 0.50, [0.1, 0.5, 0.6]),
            _run("lora", 3e-4, seed, 0.55, 0.45, [0.1, 0.58, 0.55]),
        ]
    return runs


def test_the_summary_compares_each_arm_at_its_validation_rate_and_withholds_the_verdict_when_not_fair():
    fair = summarise_task(_fake_runs(), BASES, ["full", "lora", "qlora"], [0, 1, 2], [])
    full, lora, qlora = (fair["arms"][a] for a in ("full", "lora", "qlora"))
    assert (full["learning_rate"], lora["learning_rate"]) == (3e-5, 3e-4)  # validation's picks, not the holdout's
    assert all(p["gained_over_base"] for p in lora["per_seed"])
    assert full["holdout_skill"] == pytest.approx(0.5) and lora["holdout_skill"] == pytest.approx(0.45)
    assert lora["gap_skill"]["gap_pct"] == pytest.approx(10.0) and lora["verdict"] == "missed"
    assert qlora["gap_skill"]["gap_pct"] == pytest.approx(20.0)
    assert qlora["verdict"] == "not judged: 1 seed (figures only)"  # QLoRA at LoRA's rate, one seed: no verdict
    # 95 % of full's plateau validation skill (0.6) is 0.57: LoRA gets there at its second evaluation, QLoRA never
    assert lora["time_to_95"]["skill"]["step"] == 8 and lora["time_to_95"]["skill"]["train_cpu_s"] == 20.0
    assert qlora["time_to_95"]["skill"]["step"] is None and qlora["time_to_95"]["skill"]["reached"] == "0 of 1"
    assert fair["nf4_base"]["fp32"]["skill"] == pytest.approx(0.1) and fair["nf4_base"]["nf4"]["skill"] == 0.05
    assert fair["nf4_base"]["loss"]["skill"]["gap_pct"] == pytest.approx(50.0)

    unfair = summarise_task(_fake_runs(), BASES, ["full", "lora", "qlora"], [0, 1, 2], ["1 seed (0): ..."])
    assert unfair["fair"] is False and unfair["arms"]["lora"]["verdict"].startswith("not fair: 1 seed")
    result = {"tasks": {"demo": unfair}}
    rows = fair_rows(result)
    assert rows and all("not fair" in r.benchmark and r.note == "not fair" for r in rows if "gap" in r.benchmark)
    assert len(table_rows({"lora_vs_full_fair": result}.get)) == len(rows)  # no earlier results saved here


def test_every_arm_runs_the_trainers_step_cuts_as_the_task_config_switches_them_and_full_merges_nothing():
    """The cuts go to the pipeline's own trainer class (StepTrainer) as the config's switches: unset runs a cut where
    it applies, false leaves TRL's path; full fine-tuning has no adapter to merge."""
    import dataclasses

    from grpo_pipeline.configs.schema import TrainConfig

    train = TrainConfig(skip_zero_advantage=False)
    full, full_names = step_cuts(train, "full")
    lora, lora_names = step_cuts(train, "lora")
    assert full.merged_generation is False and lora.merged_generation is None  # None: where it can apply
    assert full.skip_zero_advantage is False and full.share_prompt_forward is None
    assert "merged_generation" in lora_names and "merged_generation" not in full_names
    assert "skip_zero_advantage" not in full_names and "share_prompt_forward" in full_names
    assert full.curriculum is None and full.dynamic_sampling is None  # the same prompts for every arm
    assert dataclasses.replace(lora, merged_generation=False) == full


def test_the_skill_reward_is_named_per_task():
    assert (skill_reward("demo"), skill_reward("gsm8k")) == ("correct_answer", "math_answer")


def test_gsm8k_rows_keep_every_test_question_out_of_training(tmp_path):
    def problem(*calcs):
        return {"answer": " ".join(f"<<{c}>>" for c in calcs) + " #### 1"}

    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps(problem(f"{a}+{b}={a + b}")) + "\n" for a in range(12) for b in range(12))
    )
    (tmp_path / "test.jsonl").write_text(json.dumps(problem("3+4=7", "48/2=24")) + "\n")
    settings = {"gsm8k_max_operand": 50, "validation": 10, "holdout": 1000, "overrides": []}
    rows = task_rows("gsm8k", settings, tmp_path)
    keys = {split: {r["key"] for r in rows[split]} for split in rows}
    assert keys["holdout"] == {"3 + 4", "48 / 2"} and not keys["holdout"] & (keys["train"] | keys["val"])
    assert len(keys["val"]) == 10 and not keys["val"] & keys["train"] and len(keys["train"]) == 144 - 1 - 10
    assert rows["holdout"][0]["prompt"][0]["content"] == "What is 3 + 4? Reply with just the number."


def test_bad_arms_and_a_bad_override_exit_2_naming_them(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--arms", "lora,qlora", "--work", str(tmp_path)])
    assert exc.value.code == 2 and "full (the baseline)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--set", "train.grpo.no_such_field=1", "--work", str(tmp_path / "new")])
    assert exc.value.code == 2 and "no_such_field" in capsys.readouterr().err


def test_a_rate_chosen_at_its_grids_edge_gets_the_next_one_out_and_the_holdout_follows_the_task():
    assert next_rate_out([1e-4, 3e-4, 1e-3], 1e-3) == pytest.approx(3.33e-3)  # the best was the highest
    assert next_rate_out([1e-4, 3e-4, 1e-3], 1e-4) == pytest.approx(3.33e-5)
    assert next_rate_out([1e-4, 3e-4, 1e-3], 3e-4) is None  # inside the grid: nothing to add
    assert min_holdout("demo") < MIN_HOLDOUT == min_holdout("gsm8k")  # a more accurate task needs fewer prompts
