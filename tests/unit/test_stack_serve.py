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


def test_stack_env_names_the_request_log_the_router_writes(tmp_path):
    """`ab status|decide` in a shell that ran `eval "$(stack env)"` read the router's log, not an empty SQLite."""
    from grpo_pipeline.infra.services import database_uri
    from grpo_pipeline.tasks.serve.ab_log import LOG_URL_ENV, log_url

    stack = Stack(tmp_path)
    assert LOG_URL_ENV not in stack.env()
    pg = Service("postgres", 1, "postgresql://postgres:@/postgres?host=/tmp/pg", str(tmp_path), "", 0.0)
    stack.state["services"]["postgres"] = pg.to_dict()
    env = stack.env()
    assert env[LOG_URL_ENV] == database_uri(pg, "ab") == "postgresql+psycopg2://postgres:@/ab?host=/tmp/pg"
    assert log_url(tmp_path, env) == env[LOG_URL_ENV]


def test_serve_options_keep_the_venvs_python_and_find_a_shipped_recipe(tmp_path, monkeypatch):
    """A venv's python is a symlink to the base interpreter: resolved, it would run vLLM outside the venv that
    holds it (the router's engine then exits with `No module named 'vllm'`)."""
    import sys
    from pathlib import Path

    from grpo_pipeline.cli.stack import _serve_options

    monkeypatch.chdir(tmp_path)
    venv_python = tmp_path / ".venv-serve" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(sys.executable)
    options = _serve_options(Path("demo-cpu.yaml"))  # a shipped recipe, by name
    assert options.engine_python == str(venv_python)
    assert Path(options.config).is_file() and Path(options.config).is_absolute()


def test_a_taken_router_port_is_refused_naming_its_option_before_anything_starts(tmp_path):
    import socket

    from grpo_pipeline.infra.services import PortInUse
    from grpo_pipeline.infra.stack import ServeOptions

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stack = Stack(tmp_path / "stack", ports={"s3": 0, "mlflow": 0, "prefect": 0, "serve": port})
        with pytest.raises(PortInUse, match=f"Router port {port} is in use; choose another with --serve-port"):
            stack.up(["serve"], serve=ServeOptions(None, "/v/python"))
    assert stack.state["services"] == {}


def test_a_service_that_exits_at_start_is_reported_with_its_status_and_last_words(tmp_path):
    """What `stack up --serve` shows when the router refuses (exit 2: no champion yet) instead of "see the log"."""
    import sys

    from grpo_pipeline.infra import services
    from grpo_pipeline.infra.stack import ROUTER_REFUSED

    script = "import sys; print('no champion alias in the registry x'); sys.exit(2)"
    service = services.spawn("serve", [sys.executable, "-c", script], tmp_path)
    with pytest.raises(services.ServiceExited, match="(?s)exited with 2 .*no champion alias") as caught:
        services.wait_until(lambda: False, service, 60)
    assert caught.value.code == ROUTER_REFUSED


def test_the_routers_refusal_status_is_the_clis_input_error():
    from grpo_pipeline.cli import EXIT_CONFIG
    from grpo_pipeline.infra.stack import LOG_URL_ENV, ROUTER_REFUSED
    from grpo_pipeline.tasks.serve import ab_log

    assert ROUTER_REFUSED == EXIT_CONFIG and LOG_URL_ENV == ab_log.LOG_URL_ENV


def test_the_refusal_quotes_this_starts_output_not_an_earlier_ones(tmp_path):
    from grpo_pipeline.infra.services import log_tail

    log = tmp_path / "serve.log"
    log.write_text("the engine exited with 1 during start-up (yesterday)\n")
    before = log.stat().st_size
    with log.open("a") as f:
        f.write("no champion alias in the registry x\n")
    assert log_tail(log, 5, since=before) == "no champion alias in the registry x"
    assert log_tail(log, 5).startswith("the engine exited")


def test_up_serve_with_another_config_starts_the_router_again(tmp_path):
    """A second `stack up --serve` with another config or engine must not leave the first start's router serving
    while the state records the new options; the same options leave a healthy router alone."""
    import sys

    from grpo_pipeline.infra import services
    from grpo_pipeline.infra.stack import ServeOptions

    port = services.free_port()
    answers_health = (  # a process that answers /health as the router does once its engine is up
        "import http.server as h\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(200); self.end_headers()\n"
        f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    router = services.spawn("serve", [sys.executable, "-c", answers_health], tmp_path / "serve")
    router.url = f"http://127.0.0.1:{port}"
    try:
        services.wait_until(lambda: services.http_healthy(router), router, 60)
        stack = Stack(tmp_path / "stack")
        stack.state["services"]["serve"] = router.to_dict()
        stack.state["serve_options"] = ServeOptions("a.yaml", "/v/python").as_dict()
        assert not stack._to_start("serve", ServeOptions("a.yaml", "/v/python", startup_timeout_s=60))
        assert stack._to_start("serve", ServeOptions("b.yaml", "/v/python"))
        assert stack._to_start("serve", ServeOptions("a.yaml", "/other/python"))
        services.stop(router)
        assert stack._to_start("serve", ServeOptions("a.yaml", "/v/python"))  # gone: started again
    finally:
        services.stop(router)
