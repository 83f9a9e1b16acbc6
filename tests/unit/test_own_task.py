"""A team's own task through the data stage: text, label and JSON answers kept (each judged by the skill reward
`auto` chose for it), the columns a reward reads carried into the splits, and every reference a reward cannot
judge quarantined with its reason; a named skill reward that cannot judge the answers refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpo_pipeline.cli import app
from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.tasks.data.shape import choose_skill, task_rewards
from grpo_pipeline.tasks.data.stage import build_dataset
from grpo_pipeline.tasks.evaluate import score
from tests.unit.test_data import read

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("sentiment", "odd-word", "extract-json", "word-problems")


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def built(tmp_path: Path, source: Path, *sets: str):
    """The dataset a run builds for `source`, with the rewards the run resolves (`auto` chosen from the answers)."""
    cfg = task_rewards(
        load_config(
            None,
            [f"data.source={source}", "data.max_prompt_tokens=null", "data.max_dropped_fraction=1.0", *sets],
        )
    )
    return cfg, build_dataset(cfg.data, tmp_path / "out", None, cfg.train.reward_set())


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_task_is_kept_whole_and_judged_by_the_skill_its_answers_chose(tmp_path, name):
    cfg = task_rewards(load_config(ROOT / "examples" / name / "config.yaml", ["data.max_prompt_tokens=null"]))
    skill = cfg.train.reward_set().skill
    assert skill == {"sentiment": "label", "odd-word": "exact_match", "extract-json": "json_fields"}.get(
        name, "correct_answer"
    )
    assert next(e.chosen_by for e in cfg.train.rewards if e.role == "skill")  # the summary says why
    source = ROOT / cfg.data.source
    version = build_dataset(cfg.data.model_copy(update={"source": str(source)}), tmp_path, None, cfg.train.reward_set())
    assert version.report.dropped == {}, version.report.dropped  # templated prompts are no leak, words no error
    assert version.report.rows_kept == len(source.read_text().splitlines())
    rows = read(version.splits["holdout"])
    # the holdout's references, offered as completions, score 1 with the skill the run trains and gates on
    scored = score(rows, [r["answer"] for r in rows], cfg.train.reward_set(), [1] * len(rows), max_completion_length=16)
    assert scored.per_reward[skill] == 1.0
    if name == "extract-json":
        assert all(isinstance(json.loads(r["answer"]), dict) for r in rows)  # an object answer travels as its JSON
    if name == "sentiment":  # labels given once as the argument: no labels column beside it
        assert all("labels" not in r for r in rows)


def test_an_argument_holds_beside_a_column_of_nulls_and_is_refused_beside_a_column_of_values():
    from grpo_pipeline.trainer.rewards import RewardError, resolve_reward

    label = resolve_reward("label", {"labels": ["negative", "positive"]})
    assert label(["positive", "so: negative"], answer=["positive", "positive"], labels=[None, None]) == [1.0, 0.0]
    with pytest.raises(RewardError, match="both as an argument and as a data column"):
        label(["positive"], answer=["positive"], labels=[["positive", "neutral"]])


def test_the_columns_a_reward_reads_are_carried_under_its_names_and_mapped_from_the_sources(tmp_path):
    source = write(
        tmp_path / "capitals.jsonl",
        [
            {"q": f"Capital of country {i}?", "answer": f"City {i}", "also": [f"Town {i}"], "unused": "x" * 100}
            for i in range(40)
        ],
    )
    cfg, version = built(tmp_path, source, "data.prompt_column=q", "data.columns={aliases: also}")
    assert cfg.train.reward_set().skill == "exact_match"
    rows = read(version.splits["train"])
    assert all(r["aliases"] == [r["answer"].replace("City", "Town")] for r in rows)
    assert all("unused" not in r and "also" not in r for r in rows)  # only what a reward reads travels
    alias = rows[0]["aliases"][0]
    assert score(rows[:1], [alias], cfg.train.reward_set(), [2]).per_reward["exact_match"] == 1.0


def test_references_a_reward_cannot_judge_are_quarantined_with_the_reason_never_a_crash(tmp_path):
    rows = [{"prompt": f"Review {i}: it was fine", "answer": "positive" if i % 2 else "negative"} for i in range(40)]
    rows += [
        {"prompt": "Review x: meh", "answer": "maybe"},  # not among the labels
    ]
    source = write(tmp_path / "labels.jsonl", rows)
    _, version = built(tmp_path, source, "train.rewards=[{name: label, args: {labels: [negative, positive]}}]")
    quarantine = read(version.quarantine)
    why = {q["row"]["prompt"][-1]["content"]: (q["reason"], q["detail"]) for q in quarantine}
    assert why["Review x: meh"][0] == "answer_unverifiable"
    assert "'maybe' is not among the labels (negative, positive)" in why["Review x: meh"][1]
    assert version.report.rows_kept == 40


def test_a_json_reference_that_is_no_object_and_a_column_of_two_types_are_quarantined(tmp_path):
    rows = [{"prompt": f"Person {i}", "answer": {"name": f"P{i}", "age": i}} for i in range(30)]
    rows += [{"prompt": "Person list", "answer": "[1, 2]"}, {"prompt": "Person text", "answer": "Ann, 34"}]
    source = write(tmp_path / "people.jsonl", rows)
    _, version = built(tmp_path, source, "train.rewards=[json_fields]")
    why = {q["row"]["prompt"][-1]["content"]: q for q in read(version.quarantine)}
    assert set(why) == {"Person list", "Person text"}
    assert why["Person list"]["detail"] == "the answer is not a JSON object (it is a list)"
    assert all(
        q["reason"] == "answer_unverifiable" and "not JSON" in why["Person text"]["detail"] for q in why.values()
    )
    mixed = write(tmp_path / "mixed.jsonl", [{"prompt": f"Q{i}", "answer": "A", "aliases": ["B"]} for i in range(9)])
    with mixed.open("a") as f:
        f.write(json.dumps({"prompt": "Q odd", "answer": "A", "aliases": 7}) + "\n")
    _, version = built(tmp_path, mixed, "train.rewards=[exact_match]", "data.near_dup_threshold=null")
    (odd,) = read(version.quarantine)
    assert (
        odd["reason"] == "wrong_type" and "'aliases' is a number here and an array in the rows before" in odd["detail"]
    )


def test_the_skill_is_chosen_from_the_answers_and_a_named_one_that_cannot_judge_them_is_refused(tmp_path):
    words = write(tmp_path / "words.jsonl", [{"prompt": f"Q{i}", "answer": ["yes", "no"][i % 2]} for i in range(50)])
    cfg = task_rewards(load_config(ROOT / "configs" / "demo-cpu.yaml", [f"data.source={words}"]))
    (skill,) = (e for e in cfg.train.rewards if e.role == "skill")
    assert (skill.name, skill.args["labels"]) == ("label", ["no", "yes"])
    assert "2 distinct short answers" in (skill.chosen_by or "")
    assert "overlong_penalty" in cfg.train.reward_set().shaping  # the recipe's shaping stays
    assert (cfg.evaluate.accuracy_reward, cfg.evaluate.format_reward) == ("label", None)  # reported by the skill
    with pytest.raises(ConfigError, match=r"skill reward 'correct_answer' cannot judge .* label could"):
        task_rewards(load_config(None, [f"data.source={words}", "train.rewards=[correct_answer]"]))
    demo = load_config(ROOT / "configs" / "demo-cpu.yaml", [])
    assert demo.train.reward_set().skill == "correct_answer"  # the demo's integers, without reading any data
    assert choose_skill(["Paris", "Lyon"] * 3 + ["Nice"]).reward == "exact_match"  # free text repeated is no label set


def test_the_cli_refuses_a_skill_reward_that_cannot_judge_the_answers_before_any_work(tmp_path):
    words = write(tmp_path / "words.jsonl", [{"prompt": f"Q{i}", "answer": ["yes", "no"][i % 2]} for i in range(50)])
    result = CliRunner().invoke(
        app,
        ["data", "--json", "--set", f"data.source={words}", "--set", "train.rewards=[correct_answer]"]
        + ["--set", f"data_dir={tmp_path / 'grpo'}", "--set", "data.max_prompt_tokens=null"],
    )
    assert result.exit_code == 2, result.output
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert "'correct_answer' cannot judge" in failure["error"] and "label could" in failure["error"]
    assert not (tmp_path / "grpo" / "datasets").exists()  # nothing built


def test_every_example_file_is_what_its_generator_writes():
    from bench.own_tasks import TASKS, example_lines

    for example in TASKS.values():
        assert (example.folder / "rows.jsonl").read_text() == example_lines(example), example.name
        assert example.config.is_file()
