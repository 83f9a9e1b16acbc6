"""bench.recipe_seeds' bookkeeping: a work folder resumes its own runs and refuses another recipe's, another
`--set`'s or another code version's; a recipe that cannot be judged is refused before any run; the skill and the
format are reported apart; the generated tasks hold a holdout large enough to judge."""

import json

import pytest

from bench import recipe_seeds
from bench.harness import keep_runs
from grpo_pipeline.configs.schema import ConfigError


def figures(base: float, trained: float, half_width: float, reward: str) -> dict:
    gain = trained - base
    return {"reward": reward, "base": base, "trained": trained, "gain": gain, "ci_low": gain - half_width,
            "ci_high": gain + half_width, "n": 120}  # fmt: skip


def finished(seed: int, trained: float, accuracy: float | None = None) -> dict:
    run = {"trained": trained, "base": 0.075, "gain": trained - 0.075, "ci_low": trained - 0.3, "promoted": True,
           "steps": 40, "wall_s": 540.0}  # fmt: skip
    if accuracy is not None:  # runs measured with the skill and the format apart
        run |= {
            "skill": figures(0.075, accuracy, 0.08, "correct_answer"),
            "format": figures(0.0, 1.0, 0.0, "number_only"),
        }
    return run


def test_a_folder_of_this_recipe_and_code_resumes_without_running_anything(tmp_path, results):
    work = tmp_path / "work"
    current = recipe_seeds.fingerprint(recipe_seeds.RECIPE.read_text(), tiny=False)
    runs = {f"demo/{s}": finished(s, 1.2 - s / 10, accuracy=0.6 - s / 10) for s in range(3)}
    keep_runs(work / "runs.json", {"fingerprint": current, "runs": runs})
    assert recipe_seeds.main(["--tasks", "demo", "--seeds", "0", "1", "2", "--work", str(work)]) == 0
    demo = json.loads((results / "recipe_seeds.json").read_text())["tasks"]["demo"]
    assert demo["worst"]["seed"] == 2 and demo["best"]["seed"] == 0
    assert isinstance(demo["gain_interval"], list) and demo["gain_interval"][0] < demo["mean_gain"]
    # the skill apart from the format: every seed's accuracy gain clears zero, but seed 2 stays under 50 %
    assert demo["skill"]["reward"] == "correct_answer" and demo["skill"]["seeds_above_zero"] == 3
    assert demo["skill"]["trained"] == {"0": 0.6, "1": 0.5, "2": pytest.approx(0.4)}
    assert demo["format"]["reward"] == "number_only" and demo["format"]["mean_gain"] == 1.0
    assert demo["goals"]["skill_gain_every_seed"] is True and demo["goals"]["demo_accuracy_50"] is False
    assert demo["minutes"] == {"mean": 9.0, "max": 9.0, "total": 27.0} and demo["steps"] == [40, 40, 40]


def test_a_format_only_gain_misses_the_skill_goal_on_an_untuned_task():
    """Subtraction as it was first measured: the format rose 1 % -> 100 %, the accuracy 3.9 % -> 4.4 % within noise."""
    runs = {s: finished(s, 1.04) for s in range(3)}
    for s in runs:
        runs[s] |= {
            "skill": figures(0.039, 0.044, 0.027, "correct_answer"),
            "format": figures(0.01, 1.0, 0.01, "number_only"),
        }
    s = recipe_seeds.summarize(runs, "subtract")
    assert s["goals"]["every_seed_promoted"] is True  # the gate on the total passed it
    assert s["goals"]["skill_gain_every_seed"] is False and s["skill"]["seeds_above_zero"] == 0
    assert "demo_accuracy_50" not in s["goals"]  # the demo's goal alone
    accuracy, fmt = recipe_seeds.table_rows(lambda _name: {"tasks": {"subtract": {"per_seed": runs}}})
    assert accuracy.benchmark.endswith("accuracy (correct_answer)") and fmt.benchmark.endswith("format (number_only)")
    assert accuracy.baseline == "base: 0.039" and accuracy.candidate == "trained: 0.044, 0.044, 0.044"
    assert "interval above 0 on 0/3 seeds: goal missed" in accuracy.verdict
    assert "9.0 min a run" in accuracy.verdict and "40 steps" in accuracy.verdict
    assert "not a goal" in fmt.verdict and "interval above 0 on 3/3 seeds" in fmt.verdict


def test_a_result_saved_before_the_skill_was_measured_apart_keeps_its_one_row():
    saved = {"tasks": {"demo": {"per_seed": {str(s): finished(s, 1.2 - s / 10) for s in range(3)}}}}
    (row,) = recipe_seeds.table_rows(lambda _name: saved)
    assert "skill and format not measured apart" in row.verdict and row.candidate == "trained: 1.200, 1.100, 1.000"


@pytest.mark.parametrize("other", ["code", "recipe", "set"])
def test_a_folder_of_another_recipe_or_code_version_is_refused(tmp_path, results, capsys, monkeypatch, other):
    work = tmp_path / "work"
    recipe_text = recipe_seeds.RECIPE.read_text()
    if other == "recipe":  # the runs were made with another train section
        made_with = recipe_seeds.fingerprint(recipe_text + "\n# another learning rate", tiny=False)
    elif other == "set":  # the same recipe with a change laid over it
        made_with = recipe_seeds.fingerprint(recipe_text, tiny=False, sets=["train.grpo.max_steps=80"])
    else:  # the same recipe, another version of the trainer
        code = tmp_path / "checkout"
        for entry in recipe_seeds.CODE:
            src = recipe_seeds.ROOT / entry
            (code / entry).parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                (code / entry).symlink_to(src)
            else:
                (code / entry).write_bytes(src.read_bytes() + b"\n# another version\n")
        made_with = recipe_seeds.fingerprint(recipe_text, tiny=False, root=code)
    keep_runs(work / "runs.json", {"fingerprint": made_with, "runs": {"demo/0": finished(0, 1.2)}})
    assert recipe_seeds.main(["--tasks", "demo", "--seeds", "0", "--work", str(work)]) == 2
    err = capsys.readouterr().err
    assert str(work) in err and "--fresh" in err
    assert json.loads((work / "runs.json").read_text())["fingerprint"] == made_with  # nothing overwritten
    assert not (results / "recipe_seeds.json").exists()


def test_a_bad_set_is_refused_before_any_run(tmp_path, results, capsys):
    work = tmp_path / "work"
    args = ["--tasks", "subtract", "demo", "--set", "train.grpo.max_step=80", "--work", str(work)]
    assert recipe_seeds.main(args) == 2
    err = capsys.readouterr().err
    assert "task subtract" in err and "max_step" in err and "max_steps" in err  # the key, and what was meant
    assert not (work / "runs.json").exists() and not (results / "recipe_seeds.json").exists()
    assert recipe_seeds.main(["--recipe", str(tmp_path / "none.yaml"), "--work", str(work)]) == 2
    assert "none.yaml: no such file" in capsys.readouterr().err


def test_a_skill_reward_the_evaluation_does_not_score_is_refused():
    """The demo recipe scores correct_answer and number_only: a task judged on math_answer there has no figures."""
    task = recipe_seeds.Task("arith", "a task", (0,), "math_answer", "number_only")
    with pytest.raises(ConfigError, match=r"task arith: its skill reward 'math_answer' is not scored.*correct_answer"):
        recipe_seeds.check_sets(task, recipe_seeds.RECIPE, [])
    for task in recipe_seeds.TASKS.values():  # each shipped task's skill and format are scored under the recipe
        if task.config is None:
            recipe_seeds.check_sets(task, recipe_seeds.RECIPE, [])


def test_the_skill_and_the_format_are_read_from_the_runs_per_prompt_tables(tmp_path):
    """The evaluate stages' tables in a real MLflow store (sqlite), as the pipeline logs them: the skill and the format
    paired per prompt; a summary whose means are not these tables' is refused, never mixed with another run's."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("bench", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment).info.run_id
    keys = [f"k{i}" for i in range(40)]
    scores = {  # base: 3 of 40 right, no bare numbers; trained: 20 right, all bare numbers
        "base_samples.json": ("evaluate-base", [float(i < 3) for i in range(40)], [0.0] * 40),
        "candidate_samples.json": ("evaluate-candidate", [float(i < 20) for i in range(40)], [1.0] * 40),
    }
    for table, (stage, accuracy, fmt) in scores.items():
        run = client.create_run(experiment, run_name=stage, tags={"mlflow.parentRunId": parent}).info.run_id
        client.log_table(run, {"key": keys, "correct_answer": accuracy, "number_only": fmt, "length": [2] * 40}, table)
    summary = {
        "mlflow": {"tracking_uri": uri, "run_id": parent, "experiment_id": experiment},
        "holdout": {"trained": {"correct_answer": 0.5, "number_only": 1.0}},
    }
    out = recipe_seeds.skill_and_format(summary, recipe_seeds.TASKS["compare"])
    skill, fmt = out["skill"], out["format"]
    assert (skill["reward"], skill["base"], skill["trained"], skill["n"]) == ("correct_answer", 0.075, 0.5, 40)
    assert 0 < skill["ci_low"] < skill["gain"] < skill["ci_high"]
    assert (fmt["reward"], fmt["gain"], fmt["ci_low"], fmt["ci_high"]) == ("number_only", 1.0, 1.0, 1.0)
    with pytest.raises(KeyError, match="no 'math_answer' column"):  # a task judged on a reward the run did not score
        recipe_seeds.skill_and_format(summary, recipe_seeds.TASKS["gsm8k"])
    summary["holdout"]["trained"]["correct_answer"] = 0.9  # another run's summary
    with pytest.raises(RuntimeError, match="per-prompt table"):
        recipe_seeds.skill_and_format(summary, recipe_seeds.TASKS["compare"])


@pytest.mark.parametrize("name", ["subtract", "compare", "sequence"])
def test_each_generated_task_is_large_enough_to_judge_and_has_no_duplicates(name):
    from grpo_pipeline.tasks.data.splits import split_of

    task = recipe_seeds.TASKS[name]
    rows = task.generated.rows(False)
    questions = [r["question"] for r in rows]
    assert len(set(questions)) == len(questions)
    assert all(r["answer"].lstrip("-").isdigit() for r in rows)  # what correct_answer and number_only check
    # the data stage splits by the key, the question here: the holdout as it draws it
    holdout = sum(split_of(q, task.generated.holdout_share, 0.05) == "holdout" for q in questions)
    assert holdout >= 200, f"{name}: {holdout} holdout prompts"
    tiny = task.generated.rows(True)
    assert tiny == rows[: len(tiny)]  # the tiny mode runs the first rows of the same task


def test_the_recipe_is_laid_over_another_task_without_its_rewards():
    recipe = {
        "train": {
            "rewards": ["number_only"],
            "grpo": {"seed": 0, "beta": 0.0},
            "lora": {"target_modules": "all-linear"},
        }
    }
    assert recipe_seeds.recipe_sets(recipe) == [
        "train.grpo.beta=0.0",
        "train.grpo.seed=0",
        "train.lora.target_modules=all-linear",
    ]
