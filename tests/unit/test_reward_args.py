"""Reward arguments from the pipeline YAML (each `train.rewards` entry's `args`): typed in the config, checked against each
reward's own parameters before any work, carried in the job spec, bound by the evaluation as by the trainer."""

import pytest

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ConfigError, EvalConfig, load_config
from grpo_pipeline.tasks.evaluate import score
from grpo_pipeline.tasks.job import build_job_spec, check_rewards
from grpo_pipeline.trainer.spec import JobSpec

TAGGED = "<reasoning>16 - 3 - 4 = 9 eggs, 9 * 2 = 18</reasoning>\n<final>18</final>"


def test_a_yaml_file_sets_them_and_the_job_spec_carries_them(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("""
train:
  rewards:
    - {name: math_answer, args: {answer_tag: final}}
    - {name: think_format, weight: 0.2, args: {think_tag: reasoning, answer_tag: final}}
    - {name: overlong_penalty, args: {buffer: 64}}
""")
    cfg = load_config(path)
    assert cfg.train.reward_set().args == {
        "math_answer": {"answer_tag": "final"},
        "think_format": {"think_tag": "reasoning", "answer_tag": "final"},
        "overlong_penalty": {"buffer": 64},
    }
    check_rewards(cfg.train.reward_set(), cfg.evaluate)
    spec = build_job_spec(
        cfg.train, cfg.model, "m", {"train": tmp_path / "t.jsonl", "val": tmp_path / "v.jsonl"}, tmp_path / "run"
    )
    assert JobSpec.model_validate_json(spec.model_dump_json()).train.rewards == cfg.train.reward_set()


@pytest.mark.parametrize(
    ("override", "loose"),
    [
        ("train.reward_args={think_format: {think_tag: r}}", "train.reward_args"),
        ("train.reward_weights={number_only: 0.2}", "train.reward_weights"),
        ("train.grpo.reward_weights=[1.0, 0.2]", "train.grpo.reward_weights"),
    ],
)
def test_the_loose_reward_fields_are_refused_with_the_entry_form(override, loose):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert f"{loose}: a reward's weight and arguments are set in its own entry of train.rewards" in message
    assert "{name: number_only, weight: 0.2}" in message


def test_preflight_names_the_field_and_lists_the_valid_arguments():
    with pytest.raises(
        ConfigError,
        match=r"^train.rewards\[1\].args \(think_format\): reward 'think_format' takes no argument "
        r"'tag'; its arguments: think_tag='think', answer_tag='answer'$",
    ):
        check_rewards(
            RewardSet(names=("math_answer", "think_format"), args={"think_format": {"tag": "reasoning"}}), EvalConfig()
        )
    with pytest.raises(
        ConfigError,
        match=r"^train.rewards\[0\].args \(remote_verifier\): reward 'remote_verifier' needs the "
        r"argument url$",
    ):
        check_rewards(RewardSet(names=("remote_verifier",)), EvalConfig())
    check_rewards(
        RewardSet(
            names=("remote_verifier",), args={"remote_verifier": {"url": "http://127.0.0.1:9/score", "fallback": 0.0}}
        ),
        EvalConfig(),
    )
    with pytest.raises(ConfigError, match=r"^train.rewards: unknown reward 'think'"):
        check_rewards(RewardSet(names=("think",), args={"think": {"x": 1}}), EvalConfig())


def test_the_evaluation_scores_with_the_same_arguments_as_training():
    rows = [{"key": "k0", "prompt": "How many dollars?", "answer": "18"}]
    args = {"think_format": {"think_tag": "reasoning", "answer_tag": "final"}, "math_answer": {"answer_tag": "final"}}
    bound = score(rows, [TAGGED], RewardSet(names=("math_answer", "think_format"), args=args), [20])
    default = score(rows, [TAGGED], RewardSet(names=("math_answer", "think_format")), [20])
    assert bound.per_reward == {"math_answer": 1.0, "think_format": 1.0}
    assert default.per_reward["think_format"] == 0.0  # the default tags do not match: the arguments mattered


def test_the_data_stage_checks_references_with_the_answer_rewards_alone(tmp_path, tiny_model):
    """remote_verifier needs a url, which only the trainer and the evaluation bind: the data stage, which offers
    the references to answer-checking rewards only, must not need it."""
    import json
    import random

    from grpo_pipeline.configs.schema import DataConfig
    from grpo_pipeline.tasks.data.stage import build_dataset
    from tests.unit.test_data import question, read

    rng = random.Random(15)
    rows = [{"prompt": p, "answer": a} for p, a in (question(rng, i) for i in range(30))]
    rows.append({"prompt": question(rng, 99)[0], "answer": "forty-two"})
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    version = build_dataset(
        DataConfig(source=str(path)),
        tmp_path / "out",
        str(tiny_model),
        RewardSet(entries=["math_answer", {"name": "remote_verifier", "role": "shaping"}]),
    )
    assert [(q["row"]["answer"], q["reason"]) for q in read(version.quarantine)] == [
        ("forty-two", "answer_unverifiable")
    ]


def answer_below(completions, answer, *, limit: int) -> list[float]:
    """1.0 where the completion is the answer and the answer is below `limit` (a checker with a required
    argument, as a custom answer checker may have)."""
    from grpo_pipeline.trainer.rewards import completion_text

    return [float(completion_text(c).strip() == a and int(a) < limit) for c, a in zip(completions, answer, strict=True)]


def test_the_data_stage_binds_the_answer_checkers_arguments(tmp_path, tiny_model):
    """A checker's required argument comes from its train.rewards entry there too (without it the stage could not
    resolve the reward at all), and the configured value decides which references are quarantined."""
    import json
    import random

    from grpo_pipeline.configs.schema import DataConfig
    from grpo_pipeline.tasks.data.stage import build_dataset
    from tests.unit.test_data import question, read

    checker = f"{__name__}:answer_below"
    cfg = load_config(None, [f"train.rewards=[{{name: '{checker}', args: {{limit: 1000}}}}, number_only]"])
    check_rewards(cfg.train.reward_set(), cfg.evaluate)  # preflight passes it
    rng = random.Random(3)
    rows = [{"prompt": p, "answer": a} for p, a in (question(rng, i) for i in range(30))]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(source=str(path), max_dropped_fraction=1.0)

    def quarantined(args):
        version = build_dataset(
            data, tmp_path / "out", str(tiny_model), RewardSet(names=cfg.train.reward_set().names, args=args)
        )
        assert {q["reason"] for q in read(version.quarantine)} <= {"answer_unverifiable"}
        return sorted(q["row"]["answer"] for q in read(version.quarantine))

    at_1000 = quarantined(cfg.train.reward_set().args)
    assert at_1000 == sorted(r["answer"] for r in rows if int(r["answer"]) >= 1000) and at_1000
    # the same out_dir: another value is another version, not the one built before
    assert quarantined({checker: {"limit": 1500}}) == sorted(r["answer"] for r in rows if int(r["answer"]) >= 1500)
