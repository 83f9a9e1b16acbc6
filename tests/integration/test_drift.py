"""The drift stage against a real MLflow registry (SQLite) and a registered champion adapter on the tiny random Llama:
no champion (not measured, with the reason), then today's new rows against the champion's lineage, the champion
evaluated by the pipeline's own evaluation on its holdout and on the new rows, the alert, and what the parent run
holds (issue #26, item 4)."""

import json

import mlflow
import pytest

from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.flows.stages.daily import drift_stage, record_seen
from grpo_pipeline.tasks.promote.registry import CHAMPION, Registry

pytestmark = pytest.mark.integration

REWARD = "tests.integration.drift_rewards:integer_answer"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _adapter(tiny_model, directory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"),
    )
    model.save_pretrained(directory)
    return directory


class _Dataset:
    def __init__(self, splits, fingerprint):
        self.splits, self.fingerprint = splits, fingerprint


def test_new_rows_against_the_champion_s_lineage(tmp_path, tiny_model):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    cfg = load_config(
        None,
        [
            f"data_dir={tmp_path}",
            f"tracking.mlflow_tracking_uri={uri}",
            f"model.base={tiny_model}",
            f"train.rewards=[{REWARD}]",
            "evaluate.max_new_tokens=2",
            "evaluate.accuracy_reward=null",
            "evaluate.format_reward=null",
            "data.drift_alert=0.5",
        ],
    )
    registry = Registry(mlflow.MlflowClient(uri), "drift")
    seen = [
        {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1), "key": f"s{i}"}
        for i in range(24)
    ]
    new = [
        {
            "prompt": [{"role": "user", "content": f"Describe, in a few words, the colour of object {i}. " * 3}],
            "answer": "blue",
            "key": f"n{i}",
        }
        for i in range(12)
    ]
    judged = [
        {"prompt": [{"role": "user", "content": f"What is {i} + 2?"}], "answer": str(i + 2), "key": f"h{i}"}
        for i in range(6)
    ]
    # two new rows landed in today's holdout: not the holdout the champion was judged on
    holdout = _write(
        tmp_path / "holdout.jsonl",
        judged
        + [{"prompt": [{"role": "user", "content": f"Colour {i}?"}], "answer": "red", "key": f"h{i}"} for i in (6, 7)],
    )
    today = _Dataset({"train": _write(tmp_path / "today.jsonl", seen + new), "holdout": holdout}, "fp2")

    with mlflow.start_run() as parent:  # no champion yet
        drift = drift_stage(cfg, registry, today, tmp_path / "run0", parent.info.run_id)
    assert drift.skipped_reason.startswith("no champion yet") and drift.reward is None
    assert mlflow.get_run(parent.info.run_id).data.tags["drift_skipped_reason"] == drift.skipped_reason

    # the champion trained on the 24 seen rows and 2 that have left the source since
    day1 = _write(tmp_path / "day1.jsonl", [*seen, {"key": "gone1"}, {"key": "gone2"}])
    with mlflow.start_run() as run:
        tags = {
            "base_config": str(tiny_model),
            "quantization": "none",
            **record_seen(None, {"train": day1, "holdout": _write(tmp_path / "hold1.jsonl", judged)}),
        }
        version = registry.register(str(_adapter(tiny_model, tmp_path / "adapter")), run.info.run_id, tags)
    registry.client.set_registered_model_alias("drift", CHAMPION, version)

    with mlflow.start_run() as parent:
        drift = drift_stage(cfg, registry, today, tmp_path / "run1", parent.info.run_id)
    assert (drift.champion, drift.new_rows, drift.seen_rows, drift.seen_missing) == (version, 12, 24, 2)
    assert drift.lengths.shifted and drift.lengths.new_mean > 3 * drift.lengths.seen_mean
    assert drift.answer_types.shifted and (drift.answer_types.new["text"], drift.answer_types.seen["integer"]) == (1, 1)
    # scored by the evaluation code: every answer of the holdout it was judged on is an integer (1.0), every new one
    # text (0.0); the two new holdout rows (0.0) are left out of its holdout reward
    r = drift.reward
    assert (r.holdout_reward, r.new_reward, r.drop, r.holdout_rows, r.new_rows_scored) == (1.0, 0.0, 1.0, 6, 12)
    assert drift.alert and "beyond data.drift_alert=0.5" in drift.alert_reason

    logged = mlflow.get_run(parent.info.run_id)
    assert logged.data.tags["drift_alert"] == "true" and "drop of 1.000" in logged.data.tags["drift_alert_reason"]
    assert logged.data.metrics["drift/champion_reward_drop"] == 1.0 and logged.data.metrics["drift/new_rows"] == 12
    assert {"drift.json", "drift.md", "drift.png"} <= {
        a.path for a in mlflow.MlflowClient().list_artifacts(parent.info.run_id)
    }
    children = {
        c.info.run_name: c
        for c in mlflow.search_runs(
            filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'", output_format="list"
        )
    }
    assert children["evaluate-champion"].data.metrics["reward"] == 0.75  # the whole holdout: the later stage reuses it
    assert children["drift"].data.metrics["reward"] == 0.0
    markdown = mlflow.artifacts.load_text(f"runs:/{parent.info.run_id}/drift.md")
    assert f"## Drift since champion v{version}" in markdown and "**shifted**" in markdown
