"""bench.recipe_seeds --tiny on a task it writes itself: the generated data.source through the whole pipeline on a
tiny random model, a candidate's --set laid over the recipe, the skill and the format read apart from the run's
per-prompt tables, and a rerun that trains nothing."""

import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # `make test-slow`; test_bench runs the chain by default


def test_a_generated_task_runs_through_the_pipeline_and_its_skill_and_format_are_measured_apart(
    tmp_path, results, capsys
):
    from bench.recipe_seeds import TASKS, main
    from grpo_pipeline.tasks.data.splits import split_of

    work = tmp_path / "work"
    args = ["--tiny", "--tasks", "compare", "--seeds", "0", "--work", str(work), "--threads", "1"]
    args += ["--set", "train.grpo.learning_rate=1.0e-4"]  # a candidate recipe: the shipped one plus a change
    assert main(args) == 0
    saved = json.loads((results / "recipe_seeds_tiny.json").read_text())
    assert saved["sets"] == ["train.grpo.learning_rate=1.0e-4"] and list(saved["tasks"]) == ["compare"]
    compare = saved["tasks"]["compare"]
    run = compare["per_seed"]["0"]
    assert run["steps"] == 2 and run["overrides"][-2:] == ["train.grpo.learning_rate=1.0e-4", "train.grpo.seed=0"]
    task = TASKS["compare"]
    rows = [json.loads(line) for line in (work / "tiny" / "compare.jsonl").read_text().splitlines()]
    holdout = sum(split_of(r["question"], task.generated.holdout_share, 0.05) == "holdout" for r in rows)
    for role, reward in (("skill", "correct_answer"), ("format", "number_only")):
        figures = run[role]
        assert figures["reward"] == reward and figures["n"] == holdout > 0  # every holdout prompt, paired
        assert 0 <= figures["base"] <= 1 and 0 <= figures["trained"] <= 1
        assert figures["ci_low"] <= figures["gain"] <= figures["ci_high"]
        assert figures["gain"] == pytest.approx(figures["trained"] - figures["base"])
    assert compare["skill"]["seeds"] == 1 and compare["goals"]["skill_gain_every_seed"] == (run["skill"]["ci_low"] > 0)
    assert "demo_accuracy_50" not in compare["goals"]
    out = capsys.readouterr().out
    assert "accuracy (correct_answer)" in out and "format (number_only)" in out

    assert main(args) == 0  # resumed: the run is kept, nothing trains again
    assert "compare/0: kept from an earlier run" in capsys.readouterr().out
