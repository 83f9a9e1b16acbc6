"""bench.recipe_seeds' bookkeeping: a work folder resumes its own runs and refuses another recipe's or code's."""

import json

import pytest

from bench import recipe_seeds
from bench.harness import keep_runs


def finished(seed: int, trained: float) -> dict:
    return {"trained": trained, "base": 0.075, "gain": trained - 0.075, "ci_low": trained - 0.3, "promoted": True}


def test_a_folder_of_this_recipe_and_code_resumes_without_running_anything(tmp_path, results):
    work = tmp_path / "work"
    current = recipe_seeds.fingerprint(recipe_seeds.RECIPE.read_text(), tiny=False)
    keep_runs(
        work / "runs.json", {"fingerprint": current, "runs": {f"demo/{s}": finished(s, 1.2 - s / 10) for s in range(3)}}
    )
    assert recipe_seeds.main(["--tasks", "demo", "--seeds", "0", "1", "2", "--work", str(work)]) == 0
    demo = json.loads((results / "recipe_seeds.json").read_text())["tasks"]["demo"]
    assert demo["worst"]["seed"] == 2 and demo["best"]["seed"] == 0
    assert isinstance(demo["gain_interval"], list) and demo["gain_interval"][0] < demo["mean_gain"]


@pytest.mark.parametrize("other", ["code", "recipe"])
def test_a_folder_of_another_recipe_or_code_version_is_refused(tmp_path, results, capsys, monkeypatch, other):
    work = tmp_path / "work"
    recipe_text = recipe_seeds.RECIPE.read_text()
    if other == "recipe":  # the runs were made with another train section
        made_with = recipe_seeds.fingerprint(recipe_text + "\n# another learning rate", tiny=False)
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
