"""The router under supervisord, as `stack up --serve` starts it (`services.start_supervised`), with a stand-in
program in its place: a real supervisord, a real process that answers /ready on a port, is killed and comes back,
or refuses to start (status 2) and is left stopped; stopping the record stops the program too."""

import os
import signal
import sys
import time

import pytest

from grpo_pipeline.cli.stack import status_table
from grpo_pipeline.infra import services
from tests.serve_world import wait_for

# answers /ready with 200 on the port it is given; exits 2 (the router's refusal) when told to
PROGRAM = """
import http.server as h, os, sys, time
if os.environ.get("STUB_REFUSE"):
    time.sleep(1.5)  # as the router, which refuses after its imports and checks: after supervisord's startsecs
    print("no champion alias in the registry m: run the pipeline until a version is promoted", flush=True)
    sys.exit(2)
class H(h.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
print("serving", flush=True)
h.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def supervised(tmp_path):
    started = []

    program = tmp_path / "program.py"
    program.write_text(PROGRAM)

    def start(env=None):
        port = services.free_port()
        command = [sys.executable, str(program), str(port)]
        service = services.start_supervised("serve", command, tmp_path / "serve", env or {}, settled=(2,))
        service.url = f"http://127.0.0.1:{port}"
        started.append(service)
        return service

    yield start
    for service in started:
        services.stop(service)


def running_pid(service) -> int:
    state = services.supervised_state(service)
    return state["pid"] if state and state["statename"] == "RUNNING" else 0


def test_a_killed_program_is_started_again_and_stopping_the_record_stops_it(supervised):
    service = supervised()
    wait_for(lambda: services.http_status(f"{service.url}/ready") == 200, 60, "the first start")
    first = wait_for(lambda: running_pid(service), 60, "the RUNNING state")
    os.kill(first, signal.SIGKILL)
    second = wait_for(lambda: (pid := running_pid(service)) != first and pid, 60, "the restart")
    wait_for(lambda: services.http_status(f"{service.url}/ready") == 200, 60, "the restarted program's answer")
    assert "serving\nserving" in open(service.log).read()  # one log across restarts
    services.stop(service)
    assert not services.alive(service)
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)


def test_a_refusal_is_not_restarted_and_says_why(supervised):
    service = supervised({"STUB_REFUSE": "1"})
    state = wait_for(
        lambda: (
            (s := services.supervised_state(service)) and s["exitstatus"] == 2 and s["statename"] != "RUNNING" and s
        ),
        60,
        "the refusal",
    )
    assert state["statename"] == "EXITED"
    time.sleep(2)  # not started again
    assert services.supervised_state(service)["statename"] == "EXITED"
    assert services.log_tail(service.log).count("no champion alias") == 1
    assert "no champion alias" in services.log_tail(service.log)


@pytest.fixture
def stack_with_stub_router(tmp_path, monkeypatch):
    """A Stack whose router command is the stand-in program (its other services recorded, not started: the
    router's start reads only their URLs)."""
    from grpo_pipeline.infra import stack as stack_module
    from grpo_pipeline.infra.stack import ServeOptions, Stack

    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    monkeypatch.setattr(
        stack_module, "router_command", lambda options, port, *a: [sys.executable, str(program), str(port)]
    )
    stack = Stack(tmp_path / "stack")
    for name in ("postgres", "mlflow"):
        record = services.Service(name, os.getpid(), "postgresql://u:@/postgres?host=/nowhere", str(tmp_path), "", 0.0)
        stack.state["services"][name] = record.to_dict()
    stack.state["serve_options"] = ServeOptions(None, sys.executable, startup_timeout_s=60).as_dict()
    yield stack
    if (service := stack.service("serve")) is not None:
        services.stop(service)


def test_the_stacks_router_comes_back_after_a_kill_and_status_follows_readiness(stack_with_stub_router, tmp_path):
    stack = stack_with_stub_router
    service = stack._start_router(tmp_path / "stack" / "serve", services.free_port(), stack._recorded("postgres"))
    stack.state["services"]["serve"] = service.to_dict()
    assert stack.status()["serve"]["healthy"]
    first = wait_for(lambda: running_pid(service), 60, "the RUNNING state")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: running_pid(service) not in (0, first), 60, "the restart")
    wait_for(lambda: stack.healthy("serve"), 60, "readiness after the restart")


def test_the_stacks_router_refusal_is_serve_refused_with_its_words_and_nothing_left_running(
    stack_with_stub_router, tmp_path, monkeypatch
):
    from grpo_pipeline.infra.stack import ServeRefused

    monkeypatch.setenv("STUB_REFUSE", "1")
    with pytest.raises(ServeRefused, match="no champion alias in the registry m") as caught:
        stack_with_stub_router._start_router(
            tmp_path / "stack" / "serve", services.free_port(), stack_with_stub_router._recorded("postgres")
        )
    assert "stack up --serve` again" in str(caught.value)
    assert not (tmp_path / "stack" / "serve" / "supervisord.pid").exists()  # supervisord stopped, and its program


# answers /health with what the router says of itself, and /ready 200 only while the file READY_FLAG names exists
STATEFUL = """
import http.server as h, json, os, sys
class H(h.BaseHTTPRequestHandler):
    def do_GET(self):
        ready = os.path.exists(os.environ["READY_FLAG"])
        if self.path == "/health":
            status, body = 200, {"status": "ok", "engine": "up" if ready else "starting", "restarts": 0}
        else:
            status = 200 if ready else 503
            body = {"status": "ready"} if ready else {"status": "not ready", "reason": "the engine is starting"}
        raw = json.dumps(body).encode()
        self.send_response(status); self.send_header("Content-Length", str(len(raw))); self.end_headers()
        self.wfile.write(raw)
    def log_message(self, *a):
        pass
h.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_stack_status_reports_the_routers_own_state_and_supervisords_restarts(tmp_path, monkeypatch):
    from grpo_pipeline.infra.stack import Stack

    program, flag = tmp_path / "stateful.py", tmp_path / "ready"
    program.write_text(STATEFUL)
    monkeypatch.setenv("READY_FLAG", str(flag))
    port = services.free_port()
    service = services.start_supervised(
        "serve", [sys.executable, str(program), str(port)], tmp_path / "serve", {}, settled=(2,)
    )
    service.url = f"http://127.0.0.1:{port}"
    stack = Stack(tmp_path / "stack")
    stack.state["services"]["serve"] = service.to_dict()
    try:
        starting = wait_for(lambda: (s := stack.status()["serve"])["engine"] and s, 60, "the router's answer")
        assert (starting["state"], starting["restarts"], starting["healthy"]) == ("starting", 0, False)
        assert starting["reason"] == "the engine is starting" and starting["router_pid"] not in (None, service.pid)
        flag.touch()
        up = wait_for(lambda: (s := stack.status()["serve"])["state"] == "up" and s, 60, "up")
        assert (up["restarts"], up["healthy"], up["engine"]) == (0, True, "up")
        flag.unlink()  # the next start is not ready at once: a restart under way
        os.kill(up["router_pid"], signal.SIGKILL)
        again = wait_for(lambda: (s := stack.status()["serve"])["restarts"] == 1 and s["engine"] and s, 60, "restart")
        assert again["state"] == "restarting" and again["router_pid"] != up["router_pid"], again
        flag.touch()
        assert wait_for(lambda: (s := stack.status()["serve"])["state"] == "up" and s, 60, "up again")["restarts"] == 1
        assert "\nthe router     up  " in status_table(stack.status())
    finally:
        services.stop(service)
    stopped = stack.status()["serve"]
    assert (stopped["state"], stopped["healthy"], stopped["router_pid"]) == ("stopped", False, None)
