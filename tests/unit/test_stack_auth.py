"""The local stack's credentials, without starting a server: generated once into the 0600 state file, kept across
`Stack` objects (each command is a new process), handed out by `env()` only for servers started with auth, and a
server recorded without auth (started by a version before auth was on) is marked for a restart by `up`.
The servers themselves refusing requests without them: tests/integration/test_ops.py."""

import json
import os
import stat

from grpo_pipeline.infra import services
from grpo_pipeline.infra.services import MlflowAuth, Service
from grpo_pipeline.infra.stack import Stack


def _record(stack: Stack, name: str, url: str, auth: bool) -> None:
    """A service entry as `up` writes it (pid 1: alive, but never ours, so nothing is stopped or reached)."""
    service = Service(
        name, 1, url, str(stack.root), str(stack.root / f"{name}.log"), 0.0, extra={"auth": "basic"} if auth else {}
    )
    stack.state["services"][name] = service.to_dict()
    stack._save()


def test_credentials_are_generated_once_kept_private_and_differ_per_stack(tmp_path):
    first = Stack(tmp_path / "a")
    _record(first, "mlflow", "http://127.0.0.1:1", auth=True)
    state = json.loads((tmp_path / "a" / "state.json").read_text())
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "state.json").st_mode) == 0o600
    again = Stack(tmp_path / "a")  # another command reads the same credentials
    assert again.mlflow_auth == first.mlflow_auth and again.prefect_auth_string == first.prefect_auth_string
    assert state["mlflow_auth"]["password"] == first.mlflow_auth.password
    other = Stack(tmp_path / "b")
    assert {other.mlflow_auth.password, other.mlflow_auth.secret_key, other.prefect_auth_string}.isdisjoint(
        {first.mlflow_auth.password, first.mlflow_auth.secret_key, first.prefect_auth_string}
    )
    user, _, password = first.prefect_auth_string.partition(":")
    assert user and len(password) >= 32 and len(first.mlflow_auth.password) >= 32
    assert first.mlflow_auth.password not in repr(first.mlflow_auth)  # never in a traceback or a log line


def test_env_hands_out_the_credentials_of_servers_started_with_auth(tmp_path):
    stack = Stack(tmp_path)
    _record(stack, "mlflow", "http://127.0.0.1:1", auth=True)
    _record(stack, "prefect", "http://127.0.0.1:2/api", auth=True)
    env = stack.env()
    assert env["MLFLOW_TRACKING_USERNAME"] == stack.mlflow_auth.username == "admin"
    assert env["MLFLOW_TRACKING_PASSWORD"] == stack.mlflow_auth.password
    assert env["PREFECT_API_AUTH_STRING"] == stack.prefect_auth_string
    assert not stack._without_auth("mlflow") and not stack._without_auth("prefect")


def test_a_server_started_without_auth_is_restarted_and_gets_no_credentials(tmp_path):
    """A state file written before auth was on: the credentials are added, and `up` restarts the open servers."""
    stack = Stack(tmp_path)
    _record(stack, "mlflow", "http://127.0.0.1:1", auth=False)
    _record(stack, "prefect", "http://127.0.0.1:2/api", auth=False)
    state = json.loads((tmp_path / "state.json").read_text())
    del state["mlflow_auth"], state["prefect_auth_string"]
    (tmp_path / "state.json").write_text(json.dumps(state))

    old = Stack(tmp_path)
    assert old.mlflow_auth.password and old.prefect_auth_string  # generated for the restart
    assert old._without_auth("mlflow") and old._without_auth("prefect") and not old._without_auth("postgres")
    env = old.env()
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:1"
    assert not {"MLFLOW_TRACKING_PASSWORD", "PREFECT_API_AUTH_STRING"} & set(env)  # they would mean nothing yet


def test_the_auth_config_holds_no_secret():
    config = services.MLFLOW_AUTH_INI.format(database="/x/basic_auth.db")
    assert "default_permission = READ" in config and "sqlite:////x/basic_auth.db" in config
    assert "auth_cache_ttl_seconds = 300" in config  # else every request re-derives a scrypt hash
    assert "password" not in config.lower()
    auth = MlflowAuth.generate()
    assert auth.client_env() == {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": auth.password}
