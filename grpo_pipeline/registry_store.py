"""The registry as the operator commands open it (`registry`, `rollback`, `promote`, `ab status|decide`): a
command that reads never creates a store. On the embedded default (`sqlite:///<data_dir>/mlflow.db`) MLflow
makes the file and its tables on first use, and says so on stderr: in a folder where nothing ran yet, a read
found nothing and left an empty store behind, so that a later `run` with another data_dir looked right there.

    >>> missing("sqlite:////no/such/dir/mlflow.db")
    'no registry yet at sqlite:////no/such/dir/mlflow.db: run `grpo-pipeline run` first'
    >>> missing("http://127.0.0.1:5000") is None  # a server: asking it creates nothing
    True
"""

from __future__ import annotations

import os
from pathlib import Path

SQLITE = "sqlite:///"  # then the file's path: absolute (sqlite:////abs/mlflow.db) or relative to the working folder


def missing(tracking_uri: str) -> str | None:
    """Why there is nothing to read yet, when the registry is a SQLite file that does not exist; else None."""
    if not tracking_uri.startswith(SQLITE) or Path(tracking_uri.removeprefix(SQLITE)).exists():
        return None
    return f"no registry yet at {tracking_uri}: run `grpo-pipeline run` first"


def quiet_mlflow() -> None:
    """MLflow's own INFO lines (a store's schema check and migrations) off a command's stderr, where the user has
    not chosen a level: read before MLflow is imported, which these commands do only when they open the store."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
