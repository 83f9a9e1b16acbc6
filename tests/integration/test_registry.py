"""The registry against a real MLflow server (PostgreSQL backend, artifacts on S3): promote, reject,
rollback, an operator's forced promotion, and two promotions racing."""

import threading

import mlflow
import pytest

from tasks.registry import CHALLENGER, CHAMPION, PREVIOUS, ChampionMoved, Registry, RegistryError

pytestmark = pytest.mark.integration


@pytest.fixture
def registry(mlflow_server_uri, request):
    return Registry(mlflow.MlflowClient(mlflow_server_uri), f"reg-{request.node.name[:40]}")


def _candidate(registry: Registry, tmp_path, label: str) -> str:
    client = registry.client
    exp = client.get_experiment_by_name("registry-tests") or client.get_experiment(
        client.create_experiment("registry-tests"))
    run_id = client.create_run(exp.experiment_id, run_name=label).info.run_id
    adapter = tmp_path / label
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(f'{{"label": "{label}"}}')
    client.log_artifacts(run_id, str(adapter), "adapter")
    return registry.register(f"runs:/{run_id}/adapter", run_id, {"base_model": "tiny"})


def test_promote_reject_rollback_and_force(registry, tmp_path):
    v1 = _candidate(registry, tmp_path, "one")
    registry.settle(v1, decided_against=None, promote=True, tags={"decision": "promote"})
    v2 = _candidate(registry, tmp_path, "two")
    registry.settle(v2, decided_against=v1, promote=True, tags={"decision": "promote"})
    assert registry.aliases() == {CHAMPION: v2, CHALLENGER: None, PREVIOUS: v1}

    v3 = _candidate(registry, tmp_path, "three")
    registry.settle(v3, decided_against=v2, promote=False, tags={"decision": "reject"})
    assert registry.aliases() == {CHAMPION: v2, CHALLENGER: v3, PREVIOUS: v1}
    assert registry.client.get_model_version(registry.name, v3).tags["decision"] == "reject"

    registry.rollback("bad outputs in production")
    assert registry.aliases()[CHAMPION] == v1 and registry.aliases()[PREVIOUS] == v2
    assert registry.client.get_model_version(registry.name, v2).tags["rolled_back_reason"] == "bad outputs in production"

    registry.force(v3, "hotfix approved by on-call")
    assert registry.aliases()[CHAMPION] == v3
    assert registry.client.get_model_version(registry.name, v3).tags["forced_reason"] == "hotfix approved by on-call"

    # The champion's adapter comes back from S3 through the server.
    source = registry.client.get_model_version(registry.name, v3).source
    local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp_path / "dl"),
                                                tracking_uri=registry.client.tracking_uri)
    assert '"three"' in (tmp_path / "dl" / "adapter" / "adapter_config.json").read_text() or "three" in open(
        f"{local}/adapter_config.json").read()


def test_rollback_without_a_previous_champion_is_refused(registry, tmp_path):
    v1 = _candidate(registry, tmp_path, "only")
    registry.settle(v1, decided_against=None, promote=True, tags={})
    with pytest.raises(RegistryError, match="no previous champion"):
        registry.rollback("nothing to go back to")


def test_two_promotions_racing_leave_exactly_one_champion(registry, tmp_path):
    v1 = _candidate(registry, tmp_path, "base")
    registry.settle(v1, decided_against=None, promote=True, tags={})
    racers = [_candidate(registry, tmp_path, f"racer{i}") for i in range(2)]
    outcomes: dict[str, str] = {}
    start = threading.Barrier(2)

    def race(version: str) -> None:
        mine = Registry(mlflow.MlflowClient(registry.client.tracking_uri), registry.name)
        start.wait()
        try:
            mine.settle(version, decided_against=v1, promote=True, tags={"decision": "promote"})
            outcomes[version] = "promoted"
        except ChampionMoved:
            outcomes[version] = "moved"

    threads = [threading.Thread(target=race, args=(v,)) for v in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes.values()) == ["moved", "promoted"]
    winner = next(v for v, o in outcomes.items() if o == "promoted")
    assert registry.aliases() == {CHAMPION: winner, CHALLENGER: None, PREVIOUS: v1}


def test_report_chart_is_served_at_the_url_given_to_the_prefect_ui(mlflow_server_uri, tmp_path):
    """The flow hands Prefect an image URL; the MLflow server must answer it with the PNG (from S3)."""
    import urllib.request

    from tasks.report import artifact_url, plot_comparison

    stats = {"total": {"mean_diff": 0.4, "ci_low": 0.3, "ci_high": 0.5}}
    png = plot_comparison({"correct_answer": 0.2}, {"correct_answer": 0.6}, stats, tmp_path / "comparison.png")
    client = mlflow.MlflowClient(mlflow_server_uri)
    exp = client.get_experiment_by_name("report-tests") or client.get_experiment(client.create_experiment("report-tests"))
    run_id = client.create_run(exp.experiment_id).info.run_id
    client.log_artifact(run_id, str(png))
    with urllib.request.urlopen(artifact_url(mlflow_server_uri, run_id, "comparison.png"), timeout=30) as response:
        body = response.read()
    assert body.startswith(b"\x89PNG") and body == png.read_bytes()
