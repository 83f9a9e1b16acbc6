"""`grpo-pipeline deploy` as a team runs it: the wheel installed into a clean environment (nothing of the checkout
importable), started from an unrelated folder, against a real Prefect server (the local stack's). A refusal
(a notification block that does not exist) comes before anything is created or registered; the deployments
then name the flows by module path, work in that folder and run a shipped recipe from the installed package;
and a run of one, on a process worker of that environment, is refused by the trigger policy with its message
logged once, plainly, without a traceback."""

import json
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from grpo_pipeline.flows.deploy import AB_ENTRYPOINT, DAILY, PIPELINE_ENTRYPOINT
from tests.wheel import build_wheel, clean_venv

# slow: 1.5 minutes on a quiet-ish 2-core machine (the stack's PostgreSQL and Prefect, the wheel, two deploys), and
# 2 more for the worker's run; up to 14 in all under heavy load
pytestmark = [pytest.mark.integration, pytest.mark.slow]

POOL = "grpo-wheel"  # a pool of this module's own: another module's deployments of the same server use theirs


@contextmanager
def prefect_api(env: dict[str, str]):
    """This process's Prefect client pointed at the stack's server, with the auth string it demands."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings(
        {PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}
    ):
        yield


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a clean venv holding the wheel alone."""
    work = tmp_path_factory.mktemp("wheel")
    return clean_venv(work / "venv", build_wheel(work))


@pytest.fixture(scope="module")
def team(local_stack, installed, tmp_path_factory) -> dict:
    """An unrelated folder (a team's own repository) and the environment a shell there has: the stack's Prefect
    server, nothing of the checkout on PYTHONPATH."""
    local_stack.up(["prefect"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        **local_stack.env(),
        "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home")),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    return {"folder": tmp_path_factory.mktemp("team-repo"), "env": env, "python": installed}


def _deploy(team: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(team["python"].parent / "grpo-pipeline"), "deploy", "--pool", POOL, *args],
        cwd=team["folder"],
        env=team["env"],
        capture_output=True,
        text=True,
        timeout=900,
    )


def _ours(env: dict[str, str]) -> tuple[list, bool]:
    """The deployments on the server that use this module's pool, and whether the pool exists."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with prefect_api(env), get_client(sync_client=True) as client:
        deployments = [d for d in client.read_deployments() if d.work_pool_name == POOL]
        try:
            client.read_work_pool(POOL)
            pool = True
        except ObjectNotFound:
            pool = False
    return deployments, pool


@pytest.fixture(scope="module")
def deployed(team) -> dict:
    """A refused `deploy` (no such notification block), then the real one, both from the team's folder."""
    refused = _deploy(team, "--notify-block", "slack-webhook/nope")
    before = _ours(team["env"])
    proc = _deploy(team)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {"refused": refused, "before": before, "summary": json.loads(proc.stdout)}


def test_a_missing_notification_block_is_refused_before_anything_is_registered(deployed):
    refused = deployed["refused"]
    assert refused.returncode == 2, refused.stderr[-3000:]
    failure = json.loads(refused.stdout.strip().splitlines()[-1])
    assert failure["exit_code"] == 2 and "no notification block 'slack-webhook/nope'" in failure["error"]
    assert "prefect block create slack-webhook" in failure["error"]  # the fix
    assert deployed["before"] == ([], False)  # no deployment registered, no pool created


def test_the_wheel_deploys_from_another_folder(deployed, team, installed):
    from prefect.client.orchestration import get_client

    summary = deployed["summary"]
    assert set(summary["deployments"]) == {DAILY, "manual", "ci", "ab-decide/hourly"}
    site = Path(
        subprocess.run(
            [str(installed), "-c", "import grpo_pipeline, os; print(os.path.dirname(grpo_pipeline.__file__))"],
            cwd=team["folder"],  # `-c` puts the working folder first on sys.path: the checkout's would shadow it
            env=team["env"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.strip()
    )
    assert site.is_relative_to(installed.parent.parent)  # the wheel's copy, in the clean venv
    with prefect_api(team["env"]), get_client(sync_client=True) as client:
        for name in ("grpo-pipeline/manual", "grpo-pipeline/daily-retrain", "grpo-pipeline/ci", "ab-decide/hourly"):
            d = client.read_deployment_by_name(name)
            assert d.entrypoint == (AB_ENTRYPOINT if name.startswith("ab-") else PIPELINE_ENTRYPOINT), name
            assert d.work_pool_name == POOL
            # a process worker works in the folder deploy ran from
            ((step, settings),) = (d.pull_steps or [{}])[0].items()
            assert step == "prefect.deployments.steps.set_working_directory" and len(d.pull_steps or []) == 1
            assert Path(settings["directory"]).resolve() == team["folder"].resolve()
            # the shipped recipe, where the wheel installed it: the team's folder has no configs/
            recipe = "daily-cpu.yaml" if name.endswith(DAILY) else "demo-cpu.yaml"  # the daily builds on yesterday
            assert d.parameters["config_path"] == str(site / "configs" / recipe), name
            assert {"config_path", "overrides"} <= set(d.parameter_openapi_schema["properties"])
    # the entrypoint as a worker of that environment loads it, in that folder: the flow from the wheel, no fallback
    probe = (
        "from prefect.flows import load_flow_from_entrypoint; import sys, inspect; "
        f"f = load_flow_from_entrypoint({PIPELINE_ENTRYPOINT!r}, use_placeholder_flow=False); "
        "print(inspect.getfile(f.fn))"
    )
    loaded = subprocess.run(
        [str(installed), "-c", probe], cwd=team["folder"], env=team["env"], capture_output=True, text=True, timeout=300
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert Path(loaded.stdout.strip().splitlines()[-1]) == site / "flows" / "pipeline.py"
    assert not (team["folder"] / ".grpo").exists()  # deploy leaves nothing in the folder


@pytest.fixture(scope="module")
def worker(deployed, team, tmp_path_factory):
    """A process worker of the clean environment, started in the team's folder."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(team["python"]), "-m", "prefect", "worker", "start", "--pool", POOL],
            cwd=team["folder"],
            env={**team["env"], "PREFECT_WORKER_QUERY_SECONDS": "2"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    yield log
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_refused_run_logs_its_message_once_without_a_traceback(worker, team):
    """The worker loads the flow from the wheel and the trigger policy refuses the form's override: the run fails
    with the refusal as its state message (what the notification sends) and the log says it once, plainly."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    with prefect_api(team["env"]):
        run = run_deployment(
            "grpo-pipeline/manual", parameters={"overrides": ["data_dir=/tmp/elsewhere"]}, timeout=600, poll_interval=2
        )
        # the engine sends its log in batches, after the state: read until its last line, "Finished in state ..."
        deadline, logs = time.monotonic() + 180, []
        while time.monotonic() < deadline and not any(m.startswith("Finished in state") for m in logs):
            time.sleep(1)
            with get_client(sync_client=True) as client:
                logs = [
                    log.message
                    for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=200)
                ]
    assert run.state.is_failed(), f"{run.state}\n{worker.read_text()[-4000:]}"
    assert "data_dir: reads or writes a path" in run.state.message
    text = "\n".join(logs)
    assert "Traceback" not in text, text
    refusals = [m for m in logs if m.startswith("refused: a run triggered through the deployment grpo-pipeline/manual")]
    assert len(refusals) == 1 and "data_dir: reads or writes a path" in refusals[0], text
    assert not (team["folder"] / ".grpo").exists()  # refused before any work
