"""Operations against the local stack (real PostgreSQL, S3, MLflow and Prefect servers): `grpo-pipeline deploy`
registers the three deployments, the concurrency limits collide as stated, a run of `manual` completes on a
process worker with its MLflow run on the server and its artifacts in S3, secrets in the worker's
environment end up nowhere, secrets in a form's overrides or a config file are refused before any work and
end up nowhere, and a failed run reaches the notification block."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import mlflow
import psutil
import pytest
import yaml

from grpo_pipeline.infra import services
from grpo_pipeline.infra.stack import Stack
from tests.conftest import TINY_TRAIN

pytestmark = pytest.mark.integration

# Fake credentials the worker holds while it runs the flow; none may appear in anything the run leaves.
# (The worker's MLflow password and Prefect auth string are the stack's real ones, which its servers check:
# the leak test looks for those too.)
SENTINELS = {
    "HF_TOKEN": "hf_grpoSentinelToken0a1b2c3d",
    "WANDB_API_KEY": "grpo-sentinel-wandb-key-5d6c",
}
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@contextmanager
def prefect_api(env: dict[str, str]):
    """This process's Prefect client pointed at the stack's server, with the auth string it demands."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings(
        {PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}
    ):
        yield


@pytest.fixture(scope="module")
def stack(local_stack, mlflow_server_uri) -> Stack:
    """Every service of the stack; through `mlflow_server_uri`, so this process's MLflow clients hold the
    admin's credentials."""
    local_stack.up()
    return local_stack


@pytest.fixture(scope="module")
def env(stack, tmp_path_factory) -> dict[str, str]:
    """What a user's shell has after `eval "$(grpo-pipeline stack env)"`."""
    return {
        **os.environ,
        **stack.env(),
        "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home")),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


class Hook(BaseHTTPRequestHandler):
    received: list[bytes] = []

    def do_POST(self):  # http.server's name for a POST handler
        Hook.received.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def webhook():
    """A notification receiver on loopback, standing in for Slack or a pager."""
    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook"
    server.shutdown()


@pytest.fixture(scope="module")
def ops_yaml(tmp_path_factory, tiny_model) -> Path:
    work = tmp_path_factory.mktemp("ops")
    cfg = {
        "data_dir": str(work / "data"),
        "data": {"demo": {"max_operand": 9, "n_train": 32, "n_val": 4, "n_holdout": 6}},
        "model": {"base": str(tiny_model)},
        "train": {"checkpoint_every": 1, "checkpoint_uri": "s3://ckpt/ops", "grpo": {"max_steps": 2}},
        "evaluate": {"max_new_tokens": 6, "batch_size": 4},
        "tracking": {"experiment": "ops", "registered_model": "ops-adapter"},
        "check": {"enabled": False},  # a random model's task is too_hard; these tests are about the deployments
    }
    path = work / "ops.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def deployed(stack, env, ops_yaml, webhook):
    """`grpo-pipeline deploy`, as a user runs it, with a webhook notification block made beforehand."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    with prefect_api(env):
        CustomWebhookNotificationBlock(
            name="grpo-ops", url=webhook, json_data={"text": "{{subject}}\n{{body}}"}, allow_private_urls=True
        ).save("grpo-ops", overwrite=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_pipeline.cli",
            "deploy",
            "--config",
            str(ops_yaml),
            *sum((["--set", o] for o in TINY_TRAIN), []),
            "--schedule-hour",
            "2",
            "--timezone",
            "Europe/Berlin",
            "--notify-block",
            "custom-webhook/grpo-ops",
        ],
        env=env,
        cwd=Path(__file__).resolve().parents[2],  # the checkout: the worker runs the flows there (its pull step)
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def worker(deployed, env, tmp_path_factory):
    """A process worker holding the sentinels in its environment, as a production worker holds credentials."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    worker_env = {**env, **SENTINELS, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "grpo-process"],
            env=worker_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    yield proc, log
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_deploy_registers_the_four_deployments(deployed, env, ops_yaml):
    deployments = deployed["deployments"]
    assert set(deployments) == {"daily-retrain", "manual", "ci", "ab-decide/hourly"}
    hourly = deployments["ab-decide/hourly"]
    assert hourly["schedules"] == [{"cron": "0 * * * *", "timezone": "UTC", "active": True}]
    assert (hourly["concurrency_limit"], hourly["collision_strategy"]) == (1, "CANCEL_NEW")
    daily, manual, ci = deployments["daily-retrain"], deployments["manual"], deployments["ci"]
    assert daily["schedules"] == [{"cron": "0 2 * * *", "timezone": "Europe/Berlin", "active": True}]
    assert (daily["concurrency_limit"], daily["collision_strategy"]) == (1, "CANCEL_NEW")
    assert (manual["concurrency_limit"], manual["collision_strategy"]) == (1, "ENQUEUE")
    assert manual["schedules"] == [] and ci["schedules"] == [] and ci["concurrency_limit"] is None
    assert deployed["work_pool"] == {"name": "grpo-process", "type": "process", "run_may_set": []}
    assert daily["parameters"]["config_path"] == str(ops_yaml)  # outside the project: an absolute path
    assert "train.grpo.max_steps=4" in ci["parameters"]["overrides"]  # ci keeps its own smoke settings

    from prefect.automations import Automation
    from prefect.client.orchestration import get_client

    with prefect_api(env), get_client(sync_client=True) as client:
        d = client.read_deployment_by_name("grpo-pipeline/manual")
        assert d.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(Path(__file__).resolve().parents[2])}}
        ]
        # The UI renders this schema as the run form: every parameter typed and described.
        properties = d.parameter_openapi_schema["properties"]
        assert {"config_path", "overrides"} <= set(properties)
        for name, prop in properties.items():
            assert prop.get("description"), f"parameter {name} has no description for the UI form"
            assert "anyOf" in prop or "type" in prop, name
        automation = Automation.read(name="grpo-pipeline-failed")
    assert automation.enabled and {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"} <= automation.trigger.expect
    assert str(automation.actions[0].block_document_id)


def test_collisions_follow_each_deployments_strategy(deployed, env):
    """A second run asking for the only slot: daily-retrain cancels it, manual makes it wait."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Pending, Scheduled
    from prefect.types._datetime import now

    outcome = {}
    with prefect_api(env), get_client(sync_client=True) as client:
        for name in ("daily-retrain", "manual"):
            deployment = client.read_deployment_by_name(f"grpo-pipeline/{name}")
            # Scheduled a day ahead, so no worker picks them up; Pending is where a worker takes the slot.
            runs = [
                client.create_flow_run_from_deployment(
                    deployment.id, state=Scheduled(scheduled_time=now("UTC") + timedelta(days=1))
                )
                for _ in range(2)
            ]
            try:
                first = client.set_flow_run_state(runs[0].id, Pending())
                second = client.set_flow_run_state(runs[1].id, Pending())
                assert first.state.is_pending()
                outcome[name] = (second.status.value, second.state.name)
                client.set_flow_run_state(runs[0].id, Cancelled())  # frees the slot for the tests below
            finally:
                for run in runs:
                    client.delete_flow_run(run.id)
    assert outcome == {"daily-retrain": ("REJECT", "Cancelled"), "manual": ("REJECT", "AwaitingConcurrencySlot")}


def test_a_run_cannot_choose_what_the_worker_executes(deployed, env):
    """The pool `deploy` creates fixes command, env and working_dir: a run asking for any of them is refused when
    it is created (a form's or an API caller's job variables would otherwise run code on the worker)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.states import Scheduled
    from prefect.types._datetime import now

    with prefect_api(env), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("grpo-pipeline/manual")
        for variables in (
            {"command": "touch /tmp/owned"},
            {"env": {"LD_PRELOAD": "/tmp/owned.so"}},
            {"working_dir": "/tmp"},
        ):
            with pytest.raises(PrefectHTTPStatusError, match="422"):
                client.create_flow_run_from_deployment(
                    deployment.id,
                    job_variables=variables,
                    state=Scheduled(scheduled_time=now("UTC") + timedelta(days=1)),
                )
        runs = client.read_flow_runs(limit=200)
    assert not any((r.job_variables or {}).keys() & {"command", "env", "working_dir"} for r in runs)


@pytest.fixture(scope="module")
def manual_run(worker, env):
    """One run of the manual deployment, on the worker, with the form's parameters."""
    from prefect.deployments import run_deployment

    with prefect_api(env):
        flow_run = run_deployment(
            "grpo-pipeline/manual", parameters={"launcher": "local"}, timeout=900, poll_interval=3
        )
    return flow_run


def test_manual_run_completes_on_the_worker_into_mlflow_and_s3(manual_run, stack, worker):
    proc, log = worker
    assert manual_run.state.is_completed(), f"{manual_run.state}\n{log.read_text()[-4000:]}"
    assert manual_run.parameters["launcher"] == "local"

    client = mlflow.MlflowClient(stack.env()["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("ops")
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert {"data", "model", "train", "evaluate-base", "evaluate-candidate", "decide"} <= set(children)
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:")  # served by the MLflow server
    train = children["train"]
    assert train.data.params["max_steps"] == "2"
    adapter = [f.path for f in client.list_artifacts(train.info.run_id, "adapter")]
    assert "adapter/adapter_model.safetensors" in adapter
    assert not [p for p in adapter if p.endswith(PICKLES)], adapter  # safetensors and JSON only

    s3 = services.s3_client(stack.service("s3").url, *stack.credentials)
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="ckpt")
        for o in page.get("Contents", [])
    ]
    prefix = f"mlflow/{experiment.experiment_id}/{train.info.run_id}/artifacts/adapter/"
    assert f"{prefix}adapter_model.safetensors" in keys
    assert any(
        k.startswith(f"mlflow/{experiment.experiment_id}/{parent.info.run_id}/artifacts/summary.json") for k in keys
    )
    assert any(k.startswith("ops/") and k.endswith("final/manifest.json") for k in keys)  # checkpoints in S3 too


def _flow_run_logs(env: dict[str, str], flow_run_id) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    lines, offset = [], 0
    with prefect_api(env), get_client(sync_client=True) as client:
        while batch := client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=offset
        ):
            lines += [log.message for log in batch]
            offset += len(batch)
    return "\n".join(lines)


def test_secrets_in_the_environment_leave_no_trace(manual_run, stack, worker, env, ops_yaml, tmp_path):
    proc, log = worker
    secrets = {
        **SENTINELS,
        "AWS_SECRET_ACCESS_KEY": stack.credentials[1],
        "MLFLOW_TRACKING_PASSWORD": stack.mlflow_auth.password,
        "PREFECT_API_AUTH_STRING": stack.prefect_auth_string.partition(":")[2],
    }  # its password half
    held = psutil.Process(proc.pid).environ()
    assert all(held.get(k) == v for k, v in SENTINELS.items())  # the worker (and so the flow run) had them
    assert held.get("MLFLOW_TRACKING_PASSWORD") == secrets["MLFLOW_TRACKING_PASSWORD"]

    places: dict[str, bytes] = {}
    client = mlflow.MlflowClient(stack.env()["MLFLOW_TRACKING_URI"])
    for run in client.search_runs([client.get_experiment_by_name("ops").experiment_id]):
        places[f"mlflow params/tags of {run.info.run_name}"] = json.dumps(
            [run.data.params, run.data.tags, run.info.run_name]
        ).encode()
        dst = mlflow.artifacts.download_artifacts(
            run_id=run.info.run_id,
            dst_path=str(tmp_path / run.info.run_id),
            tracking_uri=stack.env()["MLFLOW_TRACKING_URI"],
        )
        for file in Path(dst).rglob("*"):
            if file.is_file():
                places[f"mlflow artifact {file.relative_to(tmp_path)}"] = file.read_bytes()
    for mv in client.search_model_versions("name = 'ops-adapter'"):
        places[f"model version {mv.version} tags"] = json.dumps(mv.tags).encode()
    s3 = services.s3_client(stack.service("s3").url, *stack.credentials)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="ckpt"):
        for obj in page.get("Contents", []):
            places[f"s3://ckpt/{obj['Key']}"] = s3.get_object(Bucket="ckpt", Key=obj["Key"])["Body"].read()
    places["prefect flow run logs"] = _flow_run_logs(env, manual_run.id).encode()
    places["prefect flow run parameters"] = json.dumps(manual_run.parameters).encode()
    places["worker output"] = log.read_bytes()
    for file in Path(yaml.safe_load(ops_yaml.read_text())["data_dir"]).rglob("*.log"):  # the trainer's log
        places[f"log file {file}"] = file.read_bytes()
    for file in Path(env["PREFECT_HOME"]).rglob("*"):  # persisted task results, the worker's settings
        if file.is_file():
            places[f"prefect home {file.name}"] = file.read_bytes()

    assert len(places) > 20 and places["prefect flow run logs"]  # the scan looked at real material
    leaks = [
        (where, name) for where, blob in places.items() for name, value in secrets.items() if value.encode() in blob
    ]
    assert not leaks


# A secret a trigger types into the form, or places in a config file it names; the worker's own stay in SENTINELS.
FORM_SECRET = "hf_grpoSentinelFormToken0a1b2c3d4e5f6a7b8c9d"


@pytest.fixture(scope="module")
def refused_runs(deployed, worker, env, stack, tmp_path_factory):
    """A trigger's asks that carry a secret: in a form's overrides (a credential field, a field the deployment
    allows, a verifier header) or in a config file the run names. Each is a flow run of `ci` on the worker, all
    queued at once (the worker starts them side by side; none of them trains). -> ({what: (finished flow run,
    the message its refusal must give)}, the MLflow runs that appeared meanwhile)."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    leaky = tmp_path_factory.mktemp("leaky") / "leaky.yaml"
    leaky.write_text(yaml.safe_dump({"train": {"grpo": {"hub_token": FORM_SECRET}}}))
    asks = {
        "a credential field": (
            {"overrides": [f"train.grpo.hub_token={FORM_SECRET}"]},
            "train.grpo.hub_token: carries a credential",
        ),
        "an allowed field": (
            {"overrides": [f"train.grpo.learning_rate={FORM_SECRET}"]},
            "train.grpo.learning_rate holds a credential",
        ),
        "a header": (
            {
                "overrides": [
                    "train.rewards=[correct_answer, {name: remote_verifier, role: shaping, args: "
                    f"{{headers: {{Authorization: Bearer {FORM_SECRET}}}}}}}]"
                ]
            },
            "train.rewards: loads code on the worker",
        ),
        "a config file": ({"config_path": str(leaky)}, "config_path: this deployment runs"),
    }
    client = mlflow.MlflowClient(stack.env()["MLFLOW_TRACKING_URI"])
    experiments = [e.experiment_id for e in client.search_experiments()]
    before = {r.info.run_id for r in client.search_runs(experiments)}
    with prefect_api(env):
        queued = {
            what: run_deployment("grpo-pipeline/ci", parameters=parameters, timeout=0)
            for what, (parameters, _) in asks.items()
        }
        deadline = time.monotonic() + 600
        with get_client(sync_client=True) as prefect:
            while True:
                runs = {what: prefect.read_flow_run(run.id) for what, run in queued.items()}
                if all(run.state.is_final() for run in runs.values()):
                    break
                assert time.monotonic() < deadline, {what: run.state for what, run in runs.items()}
                time.sleep(2)
    appeared = {r.info.run_id for r in client.search_runs(experiments)} - before
    return {what: (run, asks[what][1]) for what, run in runs.items()}, appeared


def test_secrets_in_a_config_or_a_forms_overrides_are_refused_and_leave_no_trace(refused_runs, worker, env, stack):
    """Each ask fails the run before any work: no MLflow run, and the secret is in no log and no S3 object. Only
    the flow run's own parameters hold it, as the trigger sent them."""
    proc, log = worker
    runs, appeared = refused_runs
    for what, (run, says) in runs.items():
        assert run.state.is_failed(), (what, run.state)
        assert says in run.state.message, (what, run.state.message)
        assert FORM_SECRET not in run.state.message, what
    assert not appeared  # no MLflow run, no work

    places = {f"prefect logs of {what}": _flow_run_logs(env, run.id) for what, (run, _) in runs.items()}
    places["worker output"] = log.read_text(errors="replace")
    s3 = services.s3_client(stack.service("s3").url, *stack.credentials)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="ckpt"):
        for obj in page.get("Contents", []):
            places[f"s3://ckpt/{obj['Key']}"] = (
                s3.get_object(Bucket="ckpt", Key=obj["Key"])["Body"].read().decode(errors="replace")
            )
    assert all(places[f"prefect logs of {what}"] for what in runs)  # the scan looked at real logs
    assert not [where for where, text in places.items() if FORM_SECRET in text]


def test_a_failed_run_notifies_the_block(refused_runs):
    """The failure automation tells the notification block (here a webhook on loopback) about a failed run: the
    run that named a config file the deployment does not run, refused by the trigger policy before it is read."""
    failed, _ = refused_runs[0]["a config file"]
    assert failed.state.is_failed(), failed.state
    deadline = time.monotonic() + 90
    while not any(failed.name.encode() in body for body in Hook.received) and time.monotonic() < deadline:
        time.sleep(1)
    message = next((json.loads(body)["text"] for body in Hook.received if failed.name.encode() in body), None)
    assert message is not None, f"no notification for {failed.name}; got {Hook.received}"
    assert "Failed" in message and "config_path: this deployment runs" in message
    assert FORM_SECRET not in message  # the notification repeats the refusal, not the secret


def _status(url: str, login: str | None = None, body: dict | None = None) -> int | None:
    """The HTTP status of a GET (or, with `body`, a JSON POST), with HTTP Basic `login` ("user:password") or none."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **(services.basic_auth_header(login) if login else {})}
    request = urllib.request.Request(url, headers=headers, data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_stack_cli_reports_health_and_exports(stack):
    status = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "stack", "status", "--json", "--dir", str(stack.root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert all(s["healthy"] for s in json.loads(status.stdout).values())  # health needs no credentials
    exports = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "stack", "env", "--dir", str(stack.root)],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.splitlines()
    assert f"export MLFLOW_TRACKING_URI={stack.service('mlflow').url}" in exports
    assert f"export PREFECT_API_URL={stack.service('prefect').url}" in exports
    auth = stack.mlflow_auth
    assert f"export MLFLOW_TRACKING_USERNAME={auth.username}" in exports
    assert f"export MLFLOW_TRACKING_PASSWORD={auth.password}" in exports
    assert f"export PREFECT_API_AUTH_STRING={stack.prefect_auth_string}" in exports
    assert oct((stack.root / "state.json").stat().st_mode)[-3:] == "600"  # it holds the stack's credentials


def test_the_stacks_servers_refuse_requests_without_credentials(stack):
    """Any local user reaches a loopback port: MLflow's and Prefect's APIs (and MLflow's UI and artifacts)
    answer 401 without the credentials of `stack env` or with wrong ones, and serve with them."""
    mlflow_url, prefect_url = stack.service("mlflow").url, stack.service("prefect").url
    admin = f"{stack.mlflow_auth.username}:{stack.mlflow_auth.password}"
    for path in (
        "/api/2.0/mlflow/experiments/search?max_results=1",
        "/api/2.0/mlflow/registered-models/search?max_results=1",
        "/api/2.0/mlflow-artifacts/artifacts",
        "/",
    ):
        assert _status(mlflow_url + path) == 401, path
        assert _status(mlflow_url + path, f"{stack.mlflow_auth.username}:wrong-password") == 401, path
    assert _status(mlflow_url + "/api/2.0/mlflow/experiments/search?max_results=1", admin) == 200
    assert _status(mlflow_url + "/api/2.0/mlflow/registered-models/search?max_results=1", admin) == 200

    for path, body in (("/admin/version", None), ("/deployments/filter", {}), ("/flow_runs/filter", {})):
        assert _status(prefect_url + path, body=body) == 401, path
        assert _status(prefect_url + path, "grpo:wrong-password", body) == 401, path
        assert _status(prefect_url + path, stack.prefect_auth_string, body) == 200, path
    assert _status(f"{mlflow_url}/health") == _status(f"{prefect_url}/health") == 200  # probes stay open

    # Prefect's own client, as a worker builds it from the environment, is let in only with the auth string.
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: prefect_url}, restore_defaults={PREFECT_API_AUTH_STRING}),
        get_client(sync_client=True) as client,
    ):
        with pytest.raises(PrefectHTTPStatusError, match="401"):
            client.read_deployments(limit=1)
    with prefect_api(stack.env()), get_client(sync_client=True) as client:
        client.read_deployments(limit=1)


@pytest.mark.slow  # make test-slow: a stack of its own, up, killed, restarted (31 s)
def test_a_dead_service_is_restarted_on_its_port_and_down_stops_it(tmp_path):
    stack = Stack(tmp_path / "stack", ports={"s3": 0})
    first = stack.up(["s3"])["s3"]
    try:
        assert stack.healthy("s3")
        os.kill(first.pid, signal.SIGKILL)
        psutil.Process(first.pid).wait(10)
        assert not stack.healthy("s3") and stack.status()["s3"]["running"] is False
        second = Stack(tmp_path / "stack").up(["s3"])["s3"]  # another process's view: from the state file
        assert second.pid != first.pid and second.url == first.url  # same port: clients keep working
    finally:
        Stack(tmp_path / "stack").down()
    assert not services.alive(second)
    assert Stack(tmp_path / "stack").status()["s3"] == {
        "healthy": False,
        "running": False,
        "url": None,
        "pid": None,
        "log": None,
    }
