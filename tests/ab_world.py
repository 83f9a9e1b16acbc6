"""The A/B "world" the decision's tests share: a SQLite MLflow registry with versions 1 (champion) and 2
(challenger) of `ab-test`, a request log filled with both arms' requests and scores, and the settings that let
a decision come from that much data (used by the `ab` CLI tests and the `ab-decide` flow tests)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mlflow

from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION
from grpo_pipeline.tasks.serve.ab_log import RequestLog, RequestRow

NAME = "ab-test"


def make_registry(folder: Path, empty_db: Path | None = None) -> tuple[str, mlflow.MlflowClient]:
    """(tracking URI, client) of a registry in `folder` holding champion 1 and challenger 2. `empty_db`: an MLflow
    database whose tables exist already, copied (its migrations take seconds)."""
    if empty_db is not None:
        shutil.copy(empty_db, folder / "mlflow.db")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    client.create_registered_model(NAME)
    for _ in range(2):
        client.create_model_version(NAME, source=str(folder))
    client.set_registered_model_alias(NAME, CHAMPION, "1")
    client.set_registered_model_alias(NAME, CHALLENGER, "2")
    return uri, client


def overrides(uri: str) -> list[str]:
    """The config overrides the tests decide under: this registry, 40 samples suffice, a canary running."""
    return [
        f"tracking.mlflow_tracking_uri={uri}",
        f"tracking.registered_model={NAME}",
        "ab.min_samples=40",
        "ab.guardrails.min_requests=40",
        "promote.mode=canary",
    ]


def fill(
    log: RequestLog,
    challenger_score: float,
    challenger_latency: float = 0.2,
    per_arm: int = 50,
    step: timedelta = timedelta(seconds=1),
) -> None:
    """Both arms answered, alternately, from two hours ago (one request each `step`); the champion's
    thumbs-up rate is 50 %, the challenger's every score is `challenger_score`."""
    start = datetime.now(UTC) - timedelta(hours=2)
    for i in range(2 * per_arm):
        arm, version = ("challenger", "2") if i % 2 else ("champion", "1")
        log.record(
            RequestRow(
                id=f"r{i}",
                arm=arm,
                version=version,
                prompt_tokens=9,
                completion_tokens=30,
                latency_s=challenger_latency if arm == "challenger" else 0.2,
                error=False,
                created_at=start + i * step,
            )
        )
        log.feedback(f"r{i}", challenger_score if arm == "challenger" else float(i // 2 % 2))
