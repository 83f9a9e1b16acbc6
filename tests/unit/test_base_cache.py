"""The base a registered adapter names (`runs:/<id>/model`), downloaded once per content hash into
`$GRPO_MODEL_CACHE` by one function: the portable champion's (`serving_model.local_base`, which a logged model
runs where the project is not installed), which the router calls with its registry's tracking URI, so both find
the same copy."""

import shutil

import mlflow
import pytest

from grpo_pipeline.tasks.promote import serving_model
from grpo_pipeline.tasks.serve import adapters


@pytest.fixture
def base_run(tmp_path):
    """(tracking URI, runs:/ URI) of a base copied into a SQLite store's artifacts, as `base_reference` copies it."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(store)
    experiment = client.create_experiment("bases", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment)
    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    client.log_artifacts(run.info.run_id, str(model), "model")
    client.set_terminated(run.info.run_id)
    return store, f"runs:/{run.info.run_id}/model"


def test_the_router_and_a_loaded_model_share_one_download_per_hash(tmp_path, monkeypatch, base_run):
    store, reference = base_run
    cache = tmp_path / "cache"
    monkeypatch.setenv("GRPO_MODEL_CACHE", str(cache))
    # this process's own MLflow is elsewhere: the router reads the base from the registry it was told of
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    served = adapters.local_base(reference, "sha-of-base", store)
    assert served == str(cache / "sha-of-base") and (cache / "sha-of-base" / "config.json").is_file()
    assert [p.name for p in cache.iterdir()] == ["sha-of-base"]  # no staging folder left behind
    shutil.rmtree(tmp_path / "artifacts")  # a second download would fail now: the copy is what answers
    assert serving_model.local_base(reference, "sha-of-base") == served
    assert (
        serving_model.local_base("HuggingFaceTB/SmolLM2-135M-Instruct", None) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def test_a_failed_download_leaves_nothing_in_the_cache(tmp_path, monkeypatch, base_run):
    store, reference = base_run
    monkeypatch.setenv("GRPO_MODEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(Exception, match="missing"):
        serving_model.local_base(reference.replace("/model", "/missing"), "sha-of-base", store)
    assert list((tmp_path / "cache").iterdir()) == []
