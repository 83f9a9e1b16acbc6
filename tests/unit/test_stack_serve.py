"""`grpo-pipeline stack up --serve`'s bookkeeping without starting anything: the router is started only when
asked, its client key is generated once and handed out by `stack env`, `status` shows it only once it runs, and a
missing engine is refused with exit 2 before any service starts. (The router itself: tests/integration/
test_serve_engine.py.)"""

import pytest
from typer.testing import CliRunner

from grpo_pipeline.cli import app
from grpo_pipeline.infra.services import Service, ServiceError
from grpo_pipeline.infra.stack import DEFAULT_UP, SERVICES, Stack


def test_the_router_is_not_started_by_default_and_stops_first():
    assert "serve" not in DEFAULT_UP and SERVICES[-1] == "serve"  # `down` stops in reverse: the router first


def test_the_client_key_is_generated_once_and_handed_out_with_the_url_once_the_router_runs(tmp_path):
    stack = Stack(tmp_path)
    assert "GRPO_SERVE_API_KEY" not in stack.env() and "serve" not in stack.status()
    service = Service("serve", 1, "http://127.0.0.1:8000", str(tmp_path), str(tmp_path / "serve.log"), 0.0)
    stack.state["services"]["serve"] = service.to_dict()
    stack._save()
    again = Stack(tmp_path)  # another command, the same key
    env = again.env()
    assert env["GRPO_SERVE_URL"] == "http://127.0.0.1:8000/v1"
    assert env["GRPO_SERVE_API_KEY"] == stack.serve_api_key and len(stack.serve_api_key) >= 32
    assert Stack(tmp_path / "other").serve_api_key != stack.serve_api_key
    assert "serve" in again.status()


def test_up_with_the_router_needs_its_options(tmp_path):
    with pytest.raises(ServiceError, match="needs its options"):
        Stack(tmp_path).up(["serve"])


def test_stack_up_serve_without_an_engine_exits_2_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .venv-serve here
    result = CliRunner().invoke(app, ["stack", "up", "--serve", "--dir", str(tmp_path / "stack")])
    assert result.exit_code == 2 and "make serve-env" in result.output
    assert not (tmp_path / "stack" / "state.json").exists()
