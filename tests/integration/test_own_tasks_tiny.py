"""bench.own_tasks --tiny: an example task, as a team writes it (its rows.jsonl and config.yaml), through
`grpo-pipeline task check` and the whole pipeline on a tiny random model, its skill chosen from its answers, the
check's verdict judged against what training did."""

import json

import pytest


@pytest.mark.slow  # `make test-slow`: a task check and a pipeline run, about 2 minutes on 2 cores
def test_an_example_task_runs_through_the_check_and_the_pipeline(tmp_path, results):
    from bench.own_tasks import main

    work = tmp_path / "work"
    assert main(["--tiny", "--tasks", "sentiment", "--seeds", "0", "--work", str(work)]) == 0
    saved = json.loads((results / "own_tasks_tiny.json").read_text())
    task = saved["tasks"]["sentiment"]
    run = task["per_seed"]["0"]
    assert run["skill"]["reward"] == "label" and run["skill_choice"]["reward"] == "label"  # chosen by its answers
    assert run["skill"]["n"] > 0 and run["steps"] == 2
    assert task["check"]["verdict"] in ("learnable", "too_hard", "already_solved", "format_first")
    gained = run["skill"]["ci_low"] > 0
    assert task["check_agrees"] == (
        task["check"]["verdict"] == "learnable" if gained else task["check"]["verdict"] != "learnable"
    )
    runs = json.loads((work / "tiny" / "runs.json").read_text())["runs"]
    assert set(runs) == {"sentiment/check", "sentiment/0"}  # kept at once, so a rerun trains nothing
