"""Daily retraining against a real MLflow registry (SQLite): the lineage's seen keys a version records, the skip
decision read back from the champion, the incremental split from them, and an unknown runs:/ URI (issue #26)."""

import json
from types import SimpleNamespace

import mlflow
import pytest

from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.flows.stages.daily import (
    HOLDOUT_TAG,
    record_seen,
    seen_keys,
    train_rows_stage,
    unchanged_stage,
)
from grpo_pipeline.flows.warm_start import warm_start_stage
from grpo_pipeline.tasks.data.stage import config_hash
from grpo_pipeline.tasks.promote.registry import CHAMPION, Registry

pytestmark = pytest.mark.integration


def _write(path, keys):
    path.write_text("".join(json.dumps({"prompt": f"q {k}", "answer": "1", "key": k}) + "\n" for k in keys))
    return path


def test_a_champion_s_lineage_decides_skip_and_what_is_new(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    registry = Registry(mlflow.MlflowClient(uri), "daily")
    cfg = load_config(
        None,
        [f"data_dir={tmp_path}", "model.init_adapter=champion", "data.incremental=true", "data.replay_fraction=0.5"],
    )
    day1 = _write(tmp_path / "day1.jsonl", [f"k{i}" for i in range(10)])
    hold1 = _write(tmp_path / "hold1.jsonl", ["h0", "h1"])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with mlflow.start_run() as run:  # day 1's register run
        tags = {
            "dataset_fingerprint": "fp1",
            "config_hash": config_hash(cfg),
            **record_seen(None, {"train": day1, "holdout": hold1}),
        }
        version = registry.register(str(adapter), run.info.run_id, tags)
    registry.client.set_registered_model_alias("daily", CHAMPION, version)
    assert seen_keys(registry, "daily", version) == {f"k{i}" for i in range(10)}

    # day 3 of the story: the same rows (another fingerprint: only a holdout row came) and configuration
    same = SimpleNamespace(splits={"train": day1}, fingerprint="fp2")
    assert "no train row of dataset fp2 is new since champion v1" in unchanged_stage(registry, same, config_hash(cfg))
    # day 2: rows appended: trains on the 4 new ones and half of the 10 seen
    day2 = _write(tmp_path / "day2.jsonl", [f"k{i}" for i in range(14)])
    grown = SimpleNamespace(
        splits={"train": day2, "holdout": _write(tmp_path / "hold2.jsonl", ["h0", "h1", "h2"])}, fingerprint="fp3"
    )
    assert unchanged_stage(registry, grown, config_hash(cfg)) is None
    with mlflow.start_run():
        splits, rows = train_rows_stage(
            cfg,
            grown,
            seen_keys(registry, "daily", version),
            tmp_path / "run",
            seen_keys(registry, "daily", version, tag=HOLDOUT_TAG),
        )
    assert (rows.new, rows.replayed, rows.seen_before, rows.lineage_known, rows.new_holdout) == (4, 5, 10, True, 1)
    assert splits["holdout"] == grown.splits["holdout"] and splits["train"] != day2
    assert unchanged_stage(registry, same, "another-hash") is None  # a changed configuration trains

    with pytest.raises(ConfigError, match=r"model.init_adapter=runs:/0123abcd/adapter: nothing to download"):
        warm_start_stage(
            load_config(None, [f"data_dir={tmp_path}", "model.init_adapter=runs:/0123abcd/adapter"]),
            registry,
            tmp_path / "run",
        )
