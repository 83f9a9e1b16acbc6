"""The stores as the operator commands open them (`registry`, `rollback`, `promote`, `ab status|decide`): a
command that reads never creates a store, the registry's or the A/B request log's. On the embedded default
(`sqlite:///<data_dir>/mlflow.db`) MLflow makes the file and its tables on first use, and says so on stderr: in a
folder where nothing ran yet, a read found nothing and left an empty store behind, so that a later `run` with
another data_dir looked right there.

    >>> missing("sqlite:////no/such/dir/mlflow.db")
    'no registry yet at sqlite:////no/such/dir/mlflow.db: run `grpo-pipeline run` first'
    >>> missing("http://127.0.0.1:5000") is None  # a server: asking it creates nothing
    True
    >>> absent_file("sqlite:///no/such/requests.sqlite"), absent_file("postgresql://ab@127.0.0.1/ab")
    (PosixPath('no/such/requests.sqlite'), None)
"""

from __future__ import annotations

import os
from pathlib import Path

SQLITE = "sqlite:///"  # then the file's path: absolute (sqlite:////abs/mlflow.db) or relative to the working folder


def absent_file(url: str) -> Path | None:
    """The file a SQLite URL (MLflow's or SQLAlchemy's: the same form) names, when it does not exist yet: opening
    it would create it. None for a file that exists and for any other store (a server: asking it creates nothing)."""
    if not url.startswith(SQLITE) or (path := Path(url.removeprefix(SQLITE))).exists():
        return None
    return path


def missing(tracking_uri: str) -> str | None:
    """Why there is nothing to read yet, when the registry is a SQLite file that does not exist; else None."""
    if absent_file(tracking_uri) is None:
        return None
    return f"no registry yet at {tracking_uri}: run `grpo-pipeline run` first"


def mlflow_warnings_only() -> None:
    """MLflow's own INFO lines (a store's schema check and migrations) off a command's stderr, where the user has
    not chosen a level: read before MLflow is imported, which these commands do only when they open the store."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
