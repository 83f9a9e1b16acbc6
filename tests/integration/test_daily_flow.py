"""Daily retraining end to end (issue #26): three days of `grpo-pipeline run --json` on a JSONL source that grows,
real GRPO steps on the tiny random Llama, one MLflow registry (SQLite) across the days.

Day 1 trains from the base. Day 2 has rows appended: it continues day 1's champion (its adapter's weights, not a
fresh adapter), trains on the new train rows plus the replay share (counted in the summary), compares on the same
holdout rows (day 1's plus the new ones whose key lands there, counted), and registers a version whose parent is
day 1's. Day 3 has nothing new: skipped, nothing trained, exit 0.

A random model's rewards are about 0 whatever it starts from, so "its first logged reward is near day 1's last,
not the base's" cannot tell the two apart here; what day 2 started from is checked on the weights instead: day 1
takes 8 steps from a zero lora_B, day 2 one step from day 1's, so day 2's lora_B lies much nearer day 1's than a
fresh adapter's could. The reward is the completion's length (`daily_rewards`), so every step has a gradient.
"""

import json
import os
from pathlib import Path

import pytest

from grpo_pipeline.tasks.data.demo_task import make_row
from grpo_pipeline.tasks.data.splits import split_of
from tests.integration.test_flow import _cli, tiny_yaml  # noqa: F401  (tiny_yaml: the fixture)

pytestmark = pytest.mark.integration

LENIENT = ["promote.min_effect=-10", "promote.reward_tolerance=10", "promote.guardrails={}"]
REWARD = "tests.integration.daily_rewards:completion_length"  # gives the random model's groups a gradient
DAILY = ["model.init_adapter=champion", "data.incremental=true", "data.replay_fraction=0.5", "data.skip_unchanged=true"]


def _sets(*assignments):
    return [arg for a in assignments for arg in ("--set", a)]


def _lora_b(adapter_dir):
    from safetensors.torch import load_file

    weights = load_file(f"{adapter_dir}/adapter_model.safetensors")
    return {k: v for k, v in weights.items() if "lora_B" in k}


def _distance(a, b):
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5


@pytest.mark.slow
def test_three_days_warm_start_incremental_then_skipped(tmp_path, tiny_yaml):  # noqa: F811
    pairs = [(a, b) for a in range(10) for b in range(10)]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(make_row(a, b)) + "\n" for a, b in pairs[:60]))
    common = [f"data.source={source}", "data.key_column=key", "promote.min_samples=1", f"train.rewards=[{REWARD}]"]
    common += LENIENT
    root = str(Path(__file__).resolve().parents[2])  # the reward's module, for the CLI and the trainer it starts
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    home = {"cwd": tmp_path, "prefect_home": tmp_path / "prefect", "extra_env": env}
    split = {f"{a}+{b}": split_of(f"{a}+{b}", 0.3, 0.1) for a, b in pairs}

    day1 = _cli("run", "--config", str(tiny_yaml), "--json", *_sets(*common, "train.grpo.max_steps=8"), **home)
    assert day1.returncode == 0, day1.stderr[-3000:]
    one = json.loads(day1.stdout)
    v1 = one["registry"]["candidate_version"]
    assert one["warm_start"] is None and one["registry"]["aliases"]["champion"] == v1

    # day 2: 40 rows appended to the same file
    with source.open("a") as f:
        f.write("".join(json.dumps(make_row(a, b)) + "\n" for a, b in pairs[60:]))
    day2_sets = _sets(*common, *DAILY, "train.grpo.max_steps=1")
    day2 = _cli("run", "--config", str(tiny_yaml), "--json", *day2_sets, **home)
    assert day2.returncode == 0, day2.stderr[-3000:]
    two = json.loads(day2.stdout)
    new_train = sum(split[f"{a}+{b}"] == "train" for a, b in pairs[60:])
    new_holdout = sum(split[f"{a}+{b}"] == "holdout" for a, b in pairs[60:])
    seen = sum(split[f"{a}+{b}"] == "train" for a, b in pairs[:60])
    assert two["warm_start"]["version"] == v1 and two["warm_start"]["uri"] == f"models:/grpo-adapter/{v1}"
    rows = two["rows"]
    assert (rows["incremental"], rows["new"], rows["seen_before"], rows["new_holdout"]) == (
        True,
        new_train,
        seen,
        new_holdout,
    )
    assert 0 < rows["replayed"] < seen  # half of the seen rows, sampled
    # the same holdout rows as day 1's, and the new ones whose key lands there; the champion judged on them too
    assert two["holdout"]["n"] == one["holdout"]["n"] + new_holdout
    assert two["holdout"]["champion_reward"] is not None and two["registry"]["decided_against"] == v1
    v2 = two["registry"]["candidate_version"]
    assert two["registry"]["aliases"]["champion"] == v2
    import mlflow

    tags = mlflow.MlflowClient(two["mlflow"]["tracking_uri"]).get_model_version("grpo-adapter", v2).tags
    assert tags["parent_version"] == v1 and tags["init_adapter"] == f"models:/grpo-adapter/{v1}"
    # continued day 1's adapter: one Adam step (about lr per weight) away from it, while day 1's is eight steps away
    # from a fresh one (zero lora_B); a day 2 from scratch would lie about as far from day 1's as day 1's from zero
    b1, b2 = _lora_b(one["train"]["adapter_dir"]), _lora_b(two["train"]["adapter_dir"])
    zero = {k: v * 0 for k, v in b1.items()}
    assert 0 < _distance(b2, b1) < 0.5 * _distance(b1, zero)

    day3 = _cli("run", "--config", str(tiny_yaml), "--json", *day2_sets, **home)
    assert day3.returncode == 0, day3.stderr[-3000:]
    three = json.loads(day3.stdout)
    reason = three["skipped_reason"]
    assert three["status"] == "skipped" and f"champion v{v2}" in reason and "nothing to train" in reason
    assert three["train"] is None and three["registry"] is None
