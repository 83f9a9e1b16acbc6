"""Registered models' files on local disk, found through the registry the configuration names.

MLflow 3 resolves a `models:/` URI (a registered `models:/<name>/<version>` or `models:/<name>@<alias>`, and a
logged model's `models:/m-<id>`, the source of every version the pipeline registers) in the process's default
registry, `mlflow.get_registry_uri()`, whatever `tracking_uri=` or `registry_uri=` `download_artifacts` is given:
with nothing exported and no `mlflow.set_tracking_uri` in the process (the router, an operator command) that is
`sqlite:///mlflow.db` in the working folder, which it creates empty, and the model is "not found". So a `models:/`
URI is looked up here, with a client on the configured URI, and only the store location it names is downloaded.

    >>> location("runs:/0a1b/model", "sqlite:///unused.db"), location("/tmp/adapter", "sqlite:///unused.db")
    ('runs:/0a1b/model', '/tmp/adapter')
"""

from __future__ import annotations

from pathlib import Path

MODELS = "models:/"


def location(uri: str, tracking_uri: str) -> str:
    """Where the files of `uri` lie: a `models:/` URI (with or without a path inside the model) looked up in the
    registry and tracking store at `tracking_uri`; any other URI or path as it is."""
    if not uri.startswith(MODELS):
        return uri
    from mlflow import MlflowClient
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository
    from mlflow.store.artifact.utils.models import get_model_name_and_version
    from mlflow.utils.uri import append_to_uri_path

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    model, inner = ModelsArtifactRepository.split_models_uri(uri)
    found = get_model_name_and_version(client, model)  # (name, version), or (model_id,) for a logged model
    if len(found) == 1:
        root = client.get_logged_model(found[0]).artifact_location
    else:
        root = client.get_model_version_download_uri(*found)
    return append_to_uri_path(root, inner) if inner else root


def download(uri: str, dst: Path | str, tracking_uri: str) -> str:
    """The files of `uri` (models:/, runs:/, a store URI or a local path) downloaded into `dst`, every name
    resolved at `tracking_uri`; returns their local path."""
    import mlflow

    return mlflow.artifacts.download_artifacts(
        artifact_uri=location(uri, tracking_uri), dst_path=str(dst), tracking_uri=tracking_uri
    )
