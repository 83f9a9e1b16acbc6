"""Every pipeline config in configs/ loads and plans; the reasoning recipes train on GSM8K with the reasoning rewards,
and their evaluation reads as far as their training writes."""

from pathlib import Path

import pytest

from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.tasks.plan import plan_run
from grpo_pipeline.trainer.rewards import check_columns, resolve_rewards

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "gpus.yaml")
REASONING = [p for p in RECIPES if p.name.startswith("gsm8k-") and "cpu" not in p.name] + [
    CONFIGS / "qwen2.5-7b-qlora.yaml"
]
# What the data stage writes for every row (tasks/data/stage.py): the columns a reward may ask for.
ROW_COLUMNS = ["prompt", "answer", "key"]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_plans(path):
    cfg = load_config(path)
    gpu = cfg.model.base != "smollm2-135m-instruct"
    if gpu:  # a GPU recipe is priced against the catalogue, as `grpo-pipeline plan --set train.launcher=sky` does
        cfg = load_config(path, ["train.launcher=sky"] if cfg.train.launcher != "sky" else [])
    plan = plan_run(cfg.model, cfg.train, cfg.plan)
    assert plan.settings.count >= 1
    if gpu:
        assert plan.estimate.usd > 0


@pytest.mark.parametrize("path", REASONING, ids=lambda p: p.name)
def test_reasoning_recipes(path):
    cfg = load_config(path)
    assert cfg.data.source == "openai/gsm8k" and cfg.data.answer_extraction == "gsm8k"
    assert "<think>" in cfg.data.system_prompt and "<answer>" in cfg.data.system_prompt
    assert cfg.train.reward_set().names[:2] == ("math_answer", "think_format")
    assert (cfg.evaluate.accuracy_reward, cfg.evaluate.format_reward) == ("math_answer", "think_format")
    length = cfg.train.grpo["max_completion_length"]
    assert length >= 512 and cfg.evaluate.max_new_tokens == length  # room to reason; the penalty's limit is the same
    assert cfg.train.grpo["loss_type"] in ("dapo", "dr_grpo", "grpo")
    assert cfg.train.reward_set().skill == "math_answer" and cfg.train.reward_set().weights[1] == 0.2
    check_columns(cfg.train.reward_set().names, ROW_COLUMNS)
    resolve_rewards(cfg.train.reward_set().names, max_completion_length=length)


def test_the_demo_stays_the_default():
    cfg = load_config(None)  # no YAML: the demo's task and model, and its one reward, the skill
    assert cfg.data.source is None and cfg.model.base == "smollm2-135m-instruct"
    rewards = cfg.train.reward_set()
    assert rewards.names == ("correct_answer",) and rewards.weights == (1.0,)
    assert rewards.skill == "correct_answer" and rewards.shaping == ()
    assert cfg.evaluate.format_reward == "number_only"  # the format is still reported, apart from the skill


def test_real_data_cpu_recipe_reads_the_prepared_slice():
    cfg = load_config(CONFIGS / "gsm8k-calc-cpu.yaml")
    assert cfg.data.source.endswith("gsm8k-calc/train.jsonl") and cfg.data.eval_sources[0].endswith("test.jsonl")
    assert cfg.train.reward_set().names == ("math_answer",) and cfg.train.reward_set().skill == "math_answer"
    check_columns(cfg.train.reward_set().names, ROW_COLUMNS)
