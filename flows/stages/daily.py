"""Daily retraining (docs/operations.md): the keys a registered version's lineage trained on and was judged on
(`seen_keys`, `record_seen`), the skip when nothing is new since the champion (`unchanged_stage`), the split of new
and replayed rows (`train_rows_stage`), and how today's new rows differ from the champion's (`drift_stage`)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow

from grpo_pipeline.configs.schema import PipelineConfig
from grpo_pipeline.flows.artifacts import show_image, show_markdown
from grpo_pipeline.flows.runs import stage_run
from grpo_pipeline.flows.stages import active_run_id
from grpo_pipeline.flows.stages.evaluate import champion_model, champion_stage
from grpo_pipeline.tasks.data.drift import (
    Drift,
    NewAndSeen,
    assess,
    drift_metrics,
    judged_scores,
    not_measured,
    plot_drift,
    reward_drop,
    split_rows,
)
from grpo_pipeline.tasks.data.stage import (
    HOLDOUT_KEYS_FILE,
    SEEN_KEYS_FILE,
    DatasetVersion,
    incremental_split,
    jsonl_line,
    split_keys,
    unchanged_reason,
)
from grpo_pipeline.tasks.promote.registry import CHAMPION, Registry
from grpo_pipeline.tasks.report import artifact_url, drift_lines
from grpo_pipeline.tasks.summary import TrainRows

HOLDOUT_TAG = "holdout_keys"


def seen_keys(registry: Registry, model: str | None, version: str | None, tag: str = "seen_keys") -> set[str] | None:
    """The train keys version `version`'s lineage trained on (its `seen_keys` tag's artifact), or with
    `tag=HOLDOUT_TAG` the holdout keys it was judged on; None when it recorded none."""
    if not version:
        return None
    uri = registry.client.get_model_version(model or registry.name, version).tags.get(tag)
    if not uri:
        return None
    return set(json.loads(Path(mlflow.artifacts.download_artifacts(artifact_uri=uri)).read_text()))


def record_seen(seen: set[str] | None, splits: dict[str, Path]) -> dict[str, str]:
    """Into the active (register) run: the keys this candidate's lineage has trained on (the parent's and its own
    train rows) and the holdout keys it was judged on; returns the version's tags pointing at them, which the
    next run reads (what is new, what is new in the holdout)."""
    run_id = active_run_id()
    # mlflow's log_dict writes any JSON value (json.dump); its annotation says dict
    mlflow.log_dict(sorted((seen or set()) | set(split_keys(splits["train"]))), SEEN_KEYS_FILE)  # type: ignore[arg-type]
    mlflow.log_dict(split_keys(splits["holdout"]), HOLDOUT_KEYS_FILE)  # type: ignore[arg-type]
    return {"seen_keys": f"runs:/{run_id}/{SEEN_KEYS_FILE}", HOLDOUT_TAG: f"runs:/{run_id}/{HOLDOUT_KEYS_FILE}"}


def unchanged_stage(registry: Registry, dataset: DatasetVersion, cfg_hash: str) -> str | None:
    """Why nothing needs training (`grpo_pipeline.tasks.data.stage.unchanged_reason` against the champion), or None."""
    champion = registry.version_of(CHAMPION)
    if champion is None:
        return None
    tags = registry.client.get_model_version(registry.name, champion).tags
    seen = seen_keys(registry, registry.name, champion)
    new = None if seen is None else sum(k not in seen for k in split_keys(dataset.splits["train"]))
    return unchanged_reason(champion, tags, dataset.fingerprint, cfg_hash, new)


def train_rows_stage(
    cfg: PipelineConfig,
    dataset: DatasetVersion,
    seen: set[str] | None,
    run_dir: Path,
    holdout_before: set[str] | None = None,
) -> tuple[dict[str, Path], TrainRows]:
    """The splits training uses: with `data.incremental`, a train split of the new rows plus the replayed share
    (written under the run directory; val and holdout are the version's own, the same rows every day); and how
    many of each it holds, with the holdout rows the parent was not judged on (`holdout_before`: its holdout)."""
    splits = dict(dataset.splits)
    new_holdout = (
        None if holdout_before is None else sum(k not in holdout_before for k in split_keys(splits["holdout"]))
    )
    keys = split_keys(splits["train"])
    before = sum(k in seen for k in keys) if seen else 0
    new, replayed = len(keys) - before, before  # a full train split: every row seen before is replayed
    if cfg.data.incremental:
        splits["train"], new, replayed = incremental_split(
            splits["train"],
            seen or set(),
            cfg.data.replay_fraction,
            dataset.fingerprint,
            run_dir / "data" / "train.jsonl",
        )
    rows = TrainRows(
        incremental=cfg.data.incremental,
        new=new,
        replayed=replayed,
        seen_before=before,
        lineage_known=seen is not None,
        new_holdout=new_holdout,
    )
    mlflow.log_metrics(
        {
            "rows/new": rows.new,
            "rows/replayed": rows.replayed,
            "rows/seen_before": rows.seen_before,
            **({"rows/new_holdout": new_holdout} if new_holdout is not None else {}),
        }
    )
    return splits, rows


def drift_stage(
    cfg: PipelineConfig,
    registry: Registry,
    dataset: DatasetVersion,
    run_dir: Path,
    parent_run_id: str,
) -> Drift:
    """How today's new train rows differ from the champion's (`grpo_pipeline.tasks.data.drift`: the rows whose keys its
    version's `seen_keys` holds): prompt length, answer type, and its reward on a sample of the new rows against its
    holdout reward (the holdout in the `evaluate-champion` stage run, whose later call is then this one's cached
    result; the new rows in the `drift` stage run). Logged into the parent run (`log_drift`); not measured, with the
    reason, when there is no champion, it recorded no lineage, or no row is new."""
    champion = registry.version_of(CHAMPION)
    seen = seen_keys(registry, registry.name, champion) if champion else None
    rows = None
    if champion is None:
        drift = not_measured("no champion yet: nothing to compare today's rows with (the first promoted run makes one)")
    elif seen is None:
        drift = not_measured(
            f"champion v{champion} recorded no trained rows (no seen_keys tag: registered before lineage was kept)",
            champion,
        )
    else:
        with Path(dataset.splits["train"]).open(encoding="utf-8") as f:  # only a newline ends a row (read_jsonl)
            rows = split_rows((json.loads(line) for line in f if line.strip()), seen, dataset.fingerprint)
        if not len(rows.new):
            drift = not_measured(f"no train row is new since champion v{champion}", champion)
        else:
            fetched = champion_model(cfg, registry, champion, run_dir)
            with stage_run(parent_run_id, "evaluate-champion"):
                on_holdout = champion_stage(
                    cfg, registry, champion, dataset.splits["holdout"], run_dir, fetched=fetched
                )
            sample = run_dir / "drift" / "new_rows.jsonl"
            sample.parent.mkdir(parents=True, exist_ok=True)
            sample.write_bytes(b"".join(jsonl_line(r) for r in rows.sample))
            with stage_run(parent_run_id, "drift"):
                on_new = champion_stage(
                    cfg, registry, champion, sample, run_dir, name="champion_new_rows", fetched=fetched
                )
            judged = seen_keys(registry, registry.name, champion, tag=HOLDOUT_TAG)
            skill = cfg.train.reward_set().skill  # a format holds on any row: the skill says what drifted
            reward = reward_drop(judged_scores(on_holdout.rows, judged, skill), [r[skill] for r in on_new.rows], skill)
            drift = assess(champion, rows, reward, cfg.data.drift_alert)
    log_drift(drift, rows, cfg.mlflow_uri, run_dir)
    return drift


def log_drift(drift: Drift, rows: NewAndSeen | None, tracking_uri: str, run_dir: Path) -> None:
    """Into the active (parent) run: the `drift/` metrics, the tag `drift_alert` (true/false; with
    `drift_alert_reason`) or `drift_skipped_reason`, drift.json, drift.md and drift.png; in the Prefect UI, the
    markdown artifact `grpo-drift` (the chart inside when MLflow serves it by URL) and the image `grpo-drift-chart`."""
    print(f"drift: {drift.skipped_reason or drift.alert_reason or 'measured, no alert'}")
    if drift.skipped_reason:
        mlflow.set_tag("drift_skipped_reason", drift.skipped_reason[:5000])
    else:
        mlflow.log_metrics(drift_metrics(drift))
        mlflow.set_tags(
            {
                "drift_alert": str(drift.alert).lower(),
                **({"drift_alert_reason": drift.alert_reason[:5000]} if drift.alert_reason else {}),
            }
        )
    mlflow.log_dict(drift.model_dump(mode="json"), "drift.json")
    markdown, url = "\n".join(drift_lines(drift)), None
    if rows is not None and not drift.skipped_reason:
        mlflow.log_artifact(str(plot_drift(drift, rows, run_dir / "drift.png")))
        url = artifact_url(tracking_uri, active_run_id(), "drift.png")
    if url:  # the Prefect UI loads images by URL; an MLflow server serves its artifacts by URL
        markdown += f"\n![drift since champion v{drift.champion}]({url})\n"
        show_image(url, key="grpo-drift-chart", description="today's new rows against the champion's")
    mlflow.log_text(markdown, "drift.md")
    show_markdown(markdown, key="grpo-drift", description="today's new rows against the champion's")
