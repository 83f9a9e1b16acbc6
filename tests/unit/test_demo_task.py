from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import DemoTaskConfig
from grpo_pipeline.tasks.data.demo_task import generate
from grpo_pipeline.tasks.data.splits import split_of
from grpo_pipeline.tasks.evaluate import score


def test_growing_the_task_never_moves_a_question_between_splits():
    small = {(a, b): split_of(f"{a}+{b}") for a in range(10) for b in range(10)}
    grown = {(a, b): split_of(f"{a}+{b}") for a in range(30) for b in range(30)}
    assert all(grown[k] == v for k, v in small.items())


def test_generation_is_deterministic_and_disjoint():
    cfg = DemoTaskConfig(max_operand=20, n_train=100, n_val=8, n_holdout=40)
    first, second = generate(cfg), generate(cfg)
    assert first == second
    keys = {s: {r["key"] for r in rows} for s, rows in first.items()}
    assert not keys["train"] & keys["holdout"] and not keys["val"] & keys["holdout"]
    assert all(r["answer"] == str(eval(r["key"])) for r in first["holdout"])


def test_score_sums_rewards_per_sample():
    rows = [{"answer": "7", "key": "3+4"}, {"answer": "9", "key": "4+5"}]
    result = score(rows, ["7", "4 + 5 = 9"], RewardSet(names=("correct_answer", "number_only")), [1, 5])
    assert [(r["total"], r["length"]) for r in result.rows] == [(2.0, 1), (1.0, 5)]  # "4 + 5 = 9": right, not bare
    assert result.reward == 1.5 and result.per_reward == {"correct_answer": 1.0, "number_only": 0.5}
