"""Every `models:/` read goes through the registry the configuration names, on the embedded default too (MLflow in
the SQLite file under data_dir, as after `make demo`, with nothing exported): the router's adapter download
(`grpo-pipeline serve`), a warm start's and the champion's download of a version's `models:/m-<id>` source. MLflow's
own lookup asks its default registry (an empty mlflow.db it creates in the working folder) and finds nothing."""

import json
from pathlib import Path

import mlflow
import pytest

from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.flows.warm_start import fetch_adapter
from grpo_pipeline.tasks.promote.download import download
from grpo_pipeline.tasks.promote.registry import CHAMPION, Registry
from grpo_pipeline.tasks.promote.registry_client import open_client
from grpo_pipeline.tasks.serve.adapters import resolve

NAME = "grpo-adapter"


@pytest.fixture
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A version registered as the pipeline registers one (its source a logged model's models:/m-<id>) in the
    SQLite store of `data_dir`, and the configuration a shell with nothing exported loads, from another folder."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        monkeypatch.delenv(name, raising=False)
    data_dir = tmp_path / "project" / ".grpo"
    data_dir.mkdir(parents=True)
    cfg = load_config(None, [f"data_dir={data_dir}", f"tracking.registered_model={NAME}"])
    assert cfg.mlflow_uri == f"sqlite:///{(data_dir / 'mlflow.db').resolve()}"  # the embedded default
    # registering needs the tracking store too (MLflow reads the logged model there): the pipeline's run has it set
    monkeypatch.setenv("MLFLOW_TRACKING_URI", cfg.mlflow_uri)
    client = mlflow.MlflowClient(cfg.mlflow_uri)
    experiment = client.create_experiment("e", artifact_location=(data_dir / "mlartifacts").as_uri())
    run = client.create_run(experiment)
    logged = client.create_logged_model(experiment, name="adapter", source_run_id=run.info.run_id)
    model = tmp_path / "model"
    (model / "artifacts" / "adapter").mkdir(parents=True)
    (model / "MLmodel").write_text("flavors:\n  python_function:\n    config: {base: org/base}\n")
    adapter = {"base_model_name_or_path": "org/base", "r": 4, "target_modules": ["q_proj", "v_proj"]}
    (model / "artifacts" / "adapter" / "adapter_config.json").write_text(json.dumps(adapter))
    client.log_model_artifacts(logged.model_id, str(model))
    client.create_registered_model(NAME)
    version = client.create_model_version(
        NAME, source=f"models:/{logged.model_id}", run_id=run.info.run_id, model_id=logged.model_id
    )
    client.set_registered_model_alias(NAME, CHAMPION, version.version)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # from here on, nothing exported
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    return cfg, version, work


def test_serve_downloads_the_champion_from_the_configured_registry(embedded):
    cfg, version, work = embedded
    registry = Registry(open_client(cfg.mlflow_uri), cfg.tracking.registered_model)  # as `serve` builds it
    adapter = resolve(registry, CHAMPION, cfg.mlflow_uri, cfg.data_dir / "serve" / "adapters")
    assert adapter is not None
    assert (adapter.version, adapter.base, adapter.rank) == (str(version.version), "org/base", 4)
    assert (adapter.path / "adapter_config.json").is_file()
    assert not (work / "mlflow.db").exists()  # MLflow's default registry was never asked


def test_a_versions_logged_model_source_is_read_from_the_configured_store(embedded, tmp_path):
    cfg, version, work = embedded
    assert version.source.startswith("models:/m-")
    adapter = fetch_adapter(version.source, tmp_path / "warm", "model.init_adapter=champion", cfg.mlflow_uri)
    assert json.loads((Path(adapter) / "adapter_config.json").read_text())["r"] == 4
    inner = download(f"models:/{NAME}@{CHAMPION}/artifacts/adapter", tmp_path / "inner", cfg.mlflow_uri)
    assert (Path(inner) / "adapter_config.json").is_file()  # a path inside the model, by alias
    assert not (work / "mlflow.db").exists()
