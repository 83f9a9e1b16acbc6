"""The registry against a real MLflow server (PostgreSQL backend, artifacts on S3): promote, reject,
rollback, an operator's forced promotion, two promotions racing, a held lock, and a server that is down."""

import os
import re
import socket
import threading

import mlflow
import pytest

from grpo_pipeline.infra.services import basic_auth_header
from grpo_pipeline.tasks.promote.registry import (
    CHALLENGER,
    CHAMPION,
    MERGED_VERSION_TAG,
    PREVIOUS,
    AliasMove,
    ChampionMoved,
    Registry,
    RegistryError,
    RegistryServiceError,
)
from grpo_pipeline.tasks.promote.registry_client import RestClient

pytestmark = pytest.mark.integration


@pytest.fixture
def registry(mlflow_server_uri, request):
    return Registry(mlflow.MlflowClient(mlflow_server_uri), f"reg-{request.node.name[:40]}")


def _candidate(registry: Registry, tmp_path, label: str) -> str:
    client = registry.client
    exp = client.get_experiment_by_name("registry-tests") or client.get_experiment(
        client.create_experiment("registry-tests")
    )
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
    assert (
        registry.client.get_model_version(registry.name, v2).tags["rolled_back_reason"] == "bad outputs in production"
    )

    v4 = _candidate(registry, tmp_path, "four")
    registry.settle(v4, decided_against=v1, promote=False, tags={"decision": "reject"})
    assert registry.aliases() == {CHAMPION: v1, CHALLENGER: v4, PREVIOUS: v2}
    moves = registry.force(v3, "hotfix approved by on-call")
    # only what the command says: v3 champion, the champion it replaced previous; the challenger stays
    assert registry.aliases() == {CHAMPION: v3, CHALLENGER: v4, PREVIOUS: v1}
    assert [(m.alias, m.before, m.version) for m in moves] == [(PREVIOUS, v2, v1), (CHAMPION, v1, v3)]
    tags = registry.client.get_model_version(registry.name, v3).tags
    assert tags["forced_reason"] == "hotfix approved by on-call" and tags["forced_by"]
    assert tags["decision"] == "reject"  # what the pipeline decided stays

    # The champion's adapter comes back from S3 through the server.
    source = registry.client.get_model_version(registry.name, v3).source
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=source, dst_path=str(tmp_path / "dl"), tracking_uri=registry.client.tracking_uri
    )
    assert (
        '"three"' in (tmp_path / "dl" / "adapter" / "adapter_config.json").read_text()
        or "three" in open(f"{local}/adapter_config.json").read()
    )


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

    from grpo_pipeline.tasks.report import artifact_url, plot_comparison

    stats = {"total": {"mean_diff": 0.4, "ci_low": 0.3, "ci_high": 0.5}}
    png = plot_comparison({"correct_answer": 0.2}, {"correct_answer": 0.6}, stats, tmp_path / "comparison.png")
    client = mlflow.MlflowClient(mlflow_server_uri)
    exp = client.get_experiment_by_name("report-tests") or client.get_experiment(
        client.create_experiment("report-tests")
    )
    run_id = client.create_run(exp.experiment_id).info.run_id
    client.log_artifact(run_id, str(png))
    # A browser logged in to MLflow sends its basic-auth credentials with the image request; so does this.
    login = f"{os.environ['MLFLOW_TRACKING_USERNAME']}:{os.environ['MLFLOW_TRACKING_PASSWORD']}"
    request = urllib.request.Request(
        artifact_url(mlflow_server_uri, run_id, "comparison.png"), headers=basic_auth_header(login)
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
    assert body.startswith(b"\x89PNG") and body == png.read_bytes()


def test_merged_aliases_move_with_the_adapters(registry, tmp_path):
    """A version with a merged companion: promotion, rollback and a forced promotion move both models'
    aliases, and a version without one takes the merged model's alias away rather than leave it stale."""
    client = registry.client
    versions = {}
    for label in ("m1", "m2"):
        adapter_version = _candidate(registry, tmp_path, label)
        run_id = client.get_model_version(registry.name, adapter_version).run_id
        merged = registry.register(f"runs:/{run_id}/merged", run_id, {}, name=registry.merged)
        registry.tag(adapter_version, {MERGED_VERSION_TAG: merged})
        versions[label] = (adapter_version, merged)
    (a1, m1), (a2, m2) = versions["m1"], versions["m2"]
    registry.settle(a1, decided_against=None, promote=True, tags={})
    moves = registry.settle(a2, decided_against=a1, promote=True, tags={})
    assert registry.aliases(registry.merged) == {CHAMPION: m2, CHALLENGER: None, PREVIOUS: m1}
    assert {(m.model, m.alias) for m in moves} == {
        (registry.name, CHAMPION),
        (registry.name, PREVIOUS),
        (registry.merged, CHAMPION),
        (registry.merged, PREVIOUS),
    }
    registry.rollback("merged regression")
    assert registry.aliases(registry.merged)[CHAMPION] == m1
    plain = _candidate(registry, tmp_path, "no-merge")
    registry.force(plain, "adapter-only hotfix")
    assert registry.aliases()[CHAMPION] == plain
    assert registry.aliases(registry.merged)[CHAMPION] is None  # no merged model of the champion: no alias


def test_the_rest_client_does_what_mlflows_client_does(registry, tmp_path):
    """The operator commands talk REST to the server; the same registry through it promotes and rolls back."""
    v1 = _candidate(registry, tmp_path, "r1")
    registry.settle(v1, decided_against=None, promote=True, tags={})
    v2 = _candidate(registry, tmp_path, "r2")
    registry.settle(v2, decided_against=v1, promote=True, tags={})
    rest = Registry(RestClient(registry.client.tracking_uri), registry.name)
    assert rest.aliases() == registry.aliases()
    moves = rest.rollback("via REST")
    assert [m.describe() for m in moves] == [
        f"{registry.name}@champion: {v2} -> {v1}",
        f"{registry.name}@previous-champion: {v1} -> {v2}",
    ]
    assert registry.aliases() == {CHAMPION: v1, CHALLENGER: None, PREVIOUS: v2}
    with pytest.raises(RegistryError, match="has no version 999"):
        rest.force("999", "no such version")
    assert rest.version_of(CHAMPION, name="no-such-model") is None
    with pytest.raises(RestClient.errors):
        Registry(RestClient("http://127.0.0.1:9"), registry.name).aliases()


class Counting:
    """A registry client that counts its attempts to take a lock (to create its model) and its looks at the queue."""

    def __init__(self, client):
        self.client, self.creates, self.looks = client, 0, 0

    def create_registered_model(self, *args, **kwargs):
        self.creates += 1
        assert self.creates <= 100, "still trying to take the lock"  # rather than wait out a long timeout
        return self.client.create_registered_model(*args, **kwargs)

    def search_model_versions(self, *args, **kwargs):
        self.looks += 1
        return self.client.search_model_versions(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.fixture
def closed_port():
    """A port on 127.0.0.1 where nothing listens: a stopped server's address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["rest", "mlflow"])
def test_an_unreachable_server_fails_the_lock_at_once_naming_its_url(kind, closed_port, monkeypatch):
    url = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's client would retry for minutes
    client = Counting(RestClient(url) if kind == "rest" else mlflow.MlflowClient(url))
    registry = Registry(client, "down", lock_timeout_s=3600)
    with pytest.raises(RegistryServiceError, match="cannot take the registry lock down.promotion-lock") as raised:
        with registry.lock():
            pytest.fail("the lock was taken on a server that does not answer")
    assert url in str(raised.value) and "is held" not in str(raised.value)
    assert client.creates == 1  # one attempt, no wait for the lock timeout
    with pytest.raises(RegistryServiceError, match=re.escape(url)):
        registry.rollback("the server is down")
    with pytest.raises(RegistryServiceError, match="cannot read version 3 of down"):
        registry.force("3", "the server is down")


def test_a_held_lock_is_waited_for_and_then_refused(registry):
    holder = Registry(mlflow.MlflowClient(registry.client.tracking_uri), registry.name)
    waiter = Registry(Counting(mlflow.MlflowClient(registry.client.tracking_uri)), registry.name, lock_timeout_s=1)
    with holder.lock():
        with pytest.raises(RegistryError, match=f"the registry lock {registry.name}.promotion-lock is held"):
            with waiter.lock():
                pytest.fail("two holders of one lock")
        assert waiter.client.looks > 1  # it kept waiting until the timeout
    with waiter.lock():  # released: the waiter takes it
        pass
    assert waiter._tickets() == []  # the waiter that gave up withdrew its ticket; each holder released its own


RACER = """
import json, sys, time
from grpo_pipeline.tasks.promote.registry import Registry
from grpo_pipeline.tasks.promote.registry_client import RestClient

registry = Registry(RestClient(sys.argv[1]), sys.argv[2], lock_timeout_s=120, stale_lock_s=60)
print(json.dumps({"ready": time.time()}), flush=True)
sys.stdin.readline()  # the start signal: both racers go at once
with registry.lock() as ticket:
    got = time.time()
    time.sleep(1.5)  # long enough that the other racer must wait
    print(json.dumps({"ticket": ticket.version, "got": got, "left": time.time()}), flush=True)
"""


def test_two_processes_racing_for_a_stale_lock_take_it_one_after_the_other(registry, tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from grpo_pipeline.tasks.promote.registry import LOCK_SOURCE, SEEN_TAG, TOKEN_TAG

    rest = Registry(RestClient(registry.client.tracking_uri), registry.name)
    with rest.lock():
        pass  # makes the lock's model
    dead = registry.client.create_model_version(rest.lock_name, LOCK_SOURCE, tags={TOKEN_TAG: "dead", SEEN_TAG: "0"})
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, registry.client.tracking_uri, registry.name],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for racer in racers:
        assert "ready" in racer.stdout.readline()
    for racer in racers:
        racer.stdin.write("go\n")
        racer.stdin.flush()
    held = []
    for racer in racers:
        out, _ = racer.communicate(timeout=120)
        assert racer.returncode == 0
        held.append(json.loads(out.strip().splitlines()[-1]))
    first, second = sorted(held, key=lambda h: h["got"])
    assert first["left"] <= second["got"]  # one holder at a time: the other waited
    assert first["ticket"] < second["ticket"] and int(dead.version) < first["ticket"]
    assert rest._tickets() == []  # the stale ticket broken, both released


def test_release_by_a_non_owner_leaves_the_lock_and_a_broken_holder_moves_nothing(registry, tmp_path):
    from grpo_pipeline.tasks.promote.registry import LockLost, Ticket

    v1 = _candidate(registry, tmp_path, "held")
    other = Registry(mlflow.MlflowClient(registry.client.tracking_uri), registry.name)
    with registry.lock() as ticket:
        other.release(Ticket(ticket.version, "not-the-owner", 0.0))  # same number, another token
        registry.check_holder(ticket)  # still held
        assert [t.version for t in other._tickets()] == [ticket.version]
        other._delete_ticket(ticket.version)  # as a waiter breaking it for stale would
        with pytest.raises(LockLost, match="was taken from ticket"):
            registry.apply([AliasMove(CHAMPION, v1)])
    assert registry.aliases()[CHAMPION] is None
