"""Daily retraining: what is new since the champion. A hash of the configuration as it decides what trains
(`config_hash`), why a run may end after the data stage (`unchanged_reason`), the keys a split file holds
(`split_keys`), and the train split of an incremental run (`incremental_split`); docs/operations.md tells how a run
uses them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from grpo_pipeline.configs.schema import PipelineConfig
from grpo_pipeline.tasks.data.splits import incremental_rows, jsonl_line

# What a configuration hash leaves out: where and how a run happens, not what it trains (docs/operations.md).
IDENTITY_FIELDS: dict[str, Any] = {
    "data_dir": True,
    "tracking": True,
    "deploy": True,
    "plan": True,
    "data": {"skip_unchanged": True, "drift_alert": True},
    "train": {
        "launcher": True,
        "sky": True,
        "checkpoint_uri": True,
        "s3_endpoint_url": True,
        "max_restarts": True,
        "rewards": {"__all__": {"chosen_by": True}},  # how `auto` was chosen (sample counts), not what was chosen
    },
}


SEEN_KEYS_FILE = "seen_keys.json"  # the train keys a registered version's lineage trained on (its register run)


HOLDOUT_KEYS_FILE = "holdout_keys.json"  # the holdout keys a registered version was judged on


def config_hash(cfg: PipelineConfig) -> str:
    """A hash of the configuration as it decides what trains and how the candidate is judged: every field but
    the run's identity and placement (`IDENTITY_FIELDS`: data_dir, tracking, deploy, plan, the launcher and
    the checkpoint store, data.skip_unchanged and data.drift_alert). Two runs with the same hash on the same rows train the same way.

    >>> from grpo_pipeline.configs.schema import load_config
    >>> config_hash(load_config(None, ["tracking.experiment=x", "train.launcher=sky"])) == config_hash(load_config(None))
    True
    >>> config_hash(load_config(None, ["train.grpo.learning_rate=1e-4"])) == config_hash(load_config(None))
    False
    """
    tree = cfg.model_dump(mode="json", exclude=IDENTITY_FIELDS)
    return hashlib.sha256(orjson.dumps(tree, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def split_keys(path: Path) -> list[str]:
    """The keys of a split file's rows, in order."""
    with Path(path).open("rb") as f:
        return [orjson.loads(line)["key"] for line in f if line.strip()]


def unchanged_reason(
    champion: str, tags: Mapping[str, str], fingerprint: str, cfg_hash: str, new_rows: int | None
) -> str | None:
    """Why a run may end after the data stage: the champion (version `champion`, its model-version `tags`) was
    trained with this configuration on these rows, or on a lineage that saw every train row there is now
    (`new_rows` 0; None when the lineage is unknown). None: something changed, so the run trains.

    >>> tags = {"dataset_fingerprint": "f1", "config_hash": "c1"}
    >>> unchanged_reason("3", tags, "f1", "c1", None)
    'champion v3 was trained on this dataset (fingerprint f1) with this configuration (hash c1): no new rows, nothing to train'
    >>> unchanged_reason("3", tags, "f1", "c2", None) is None, unchanged_reason("3", tags, "f2", "c1", 5) is None
    (True, True)
    """
    if tags.get("config_hash") != cfg_hash:
        return None
    if tags.get("dataset_fingerprint") == fingerprint:
        return (
            f"champion v{champion} was trained on this dataset (fingerprint {fingerprint}) with this configuration "
            f"(hash {cfg_hash}): no new rows, nothing to train"
        )
    if new_rows == 0:
        return (
            f"no train row of dataset {fingerprint} is new since champion v{champion} (its lineage trained on all "
            f"of them) and the configuration is the same (hash {cfg_hash}): nothing to train"
        )
    return None


def incremental_split(
    train: Path, seen: set[str], replay_fraction: float, salt: str, out: Path
) -> tuple[Path, int, int]:
    """`data.incremental`: the train split's new rows plus `replay_fraction` of the seen ones
    (`grpo_pipeline.tasks.data.splits.incremental_rows`, sampled by `salt`, the dataset's fingerprint), written to `out`; the version
    itself stays whole. Returns (path, new, replayed)."""
    with Path(train).open("rb") as f:
        rows = [orjson.loads(line) for line in f if line.strip()]
    picked, new, replayed = incremental_rows(rows, seen, replay_fraction, salt)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"".join(jsonl_line(r) for r in picked))
    return out, new, replayed
