"""`grpo-pipeline stack up --serve` as a user walks it, with a real champion: the stack (PostgreSQL, S3, MLflow,
Prefect) started by the CLI into a folder of its own, `stack up --serve` refused with exit 2 while the registry
has no champion, tiny adapters registered into the stack's MLflow by the pipeline's own functions and made
champion by `grpo-pipeline promote --force`, then the router and its vLLM CPU engine (from `.venv-serve`, built
by `make serve-env`) answering `/v1/models`, `/v1/chat/completions` (by HTTP and by the `openai` client of the
engine's venv) and `/v1/feedback` with the key `stack env` prints, `ab status` reading that request log, a
challenger registered while it serves picked up without a restart, and `stack down` stopping the router and its
engine. One engine start-up (minutes on two cores): slow."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlflow
import pytest
import yaml

from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.infra import services
from grpo_pipeline.tasks.promote import serving
from grpo_pipeline.tasks.promote.registry import CHALLENGER, AliasMove, Registry
from tests.engine_python import ENGINE_PYTHON, engine_gone, skip_without_engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = "stack-walk-adapter"
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]

skip_without_engine()


def cli(*args: str, env: dict[str, str], timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def parse_exports(text: str) -> dict[str, str]:
    """What `eval "$(grpo-pipeline stack env)"` puts in a shell."""
    out = {}
    for line in text.splitlines():
        (assignment,) = shlex.split(line.removeprefix("export "))
        key, _, value = assignment.partition("=")
        out[key] = value
    return out


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """`stack up` on free ports into a folder of its own; `stack down` at the end, whatever happened."""
    root = tmp_path_factory.mktemp("stack-walk")
    base_env = {
        **os.environ,
        "GRPO_MODEL_CACHE": str(root / "model-cache"),  # the router's copy of the base, not the user's home
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }
    stack_dir = str(root / "stack")
    ports = [
        "--s3-port",
        str(services.free_port_pair()),
        "--mlflow-port",
        str(services.free_port()),
        "--prefect-port",
        str(services.free_port()),
    ]
    config = root / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tracking": {"registered_model": NAME},
                "promote": {"mode": "canary"},
                "ab": {
                    "challenger_fraction": 0.5,
                    "serve": {
                        "engine_python": str(ENGINE_PYTHON),
                        "max_model_len": 256,
                        "max_lora_rank": 8,
                        "poll_s": 2,
                    },
                },
            }
        )
    )
    try:
        up = cli("stack", "up", "--dir", stack_dir, *ports, env=base_env)
        assert up.returncode == 0, up.stderr[-3000:]
        env = {**base_env, **parse_exports(cli("stack", "env", "--dir", stack_dir, env=base_env).stdout)}
        yield {"root": root, "dir": stack_dir, "env": env, "config": str(config), "versions": []}
    finally:
        down = cli("stack", "down", "--dir", stack_dir, env=base_env)
        assert down.returncode == 0, down.stderr[-3000:]


def register(walk, n: int) -> str:
    """A tiny random adapter logged and registered as the pipeline's promote stage does (the base copied to the
    stack's artifact store once per content hash); returns its version."""
    from tests.tiny_model import create_random_adapter, create_random_model

    root, env = walk["root"], walk["env"]
    base = root / "base"
    if not (base / "config.json").is_file():
        create_random_model(base, hidden_size=256, seed=0)  # head_dim 64: what the CPU attention kernels take
    with pytest.MonkeyPatch.context() as mp:  # this process as a shell after `eval "$(stack env)"`
        for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            mp.setenv(key, env[key])
        mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
        client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
        found = client.get_experiment_by_name(serving.BASE_EXPERIMENT)
        base_exp = found.experiment_id if found else client.create_experiment(serving.BASE_EXPERIMENT)
        mlflow.set_experiment("stack-walk")
        reference = serving.base_reference(client, str(base), base_exp, "tiny")
        adapter = create_random_adapter(base, root / f"adapter-{n}", seed=10 + n)
        cfg = load_config(None, ["evaluate.max_new_tokens=4"])
        with mlflow.start_run() as run:
            model_uri, model_id = serving.log_adapter_model(
                str(adapter), reference, cfg.model, cfg.evaluate, "What is 1 + 1?", root / f"work-{n}"
            )
        version = Registry(client, NAME).register(
            model_uri, run.info.run_id, {"base_model": reference.reference}, model_id=model_id
        )
    walk["versions"].append(version)
    return version


def serve_up(walk) -> subprocess.CompletedProcess:
    # --serve-port 0: a free port, as the other services' 0 (not the default 8000, which may be taken)
    return cli(
        "stack", "up", "--dir", walk["dir"], "--serve", "--serve-config", walk["config"], "--serve-port", "0",
        env=walk["env"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def serving_stack(walk):
    """The walk up to a serving router: refused without a champion, then champion v1 and `stack up --serve`."""
    refused = serve_up(walk)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "no champion alias in the registry" in refused.stderr and "stack up --serve` again" in refused.stderr
    status = json.loads(cli("stack", "status", "--json", "--dir", walk["dir"], env=walk["env"]).stdout)
    assert "serve" not in status and all(s["healthy"] for s in status.values())  # the rest still runs

    v1 = register(walk, 1)
    promoted = cli(
        "promote", "--force", "--version", v1, "--reason", "the walk's champion", "--config", walk["config"],
        env=walk["env"],
    )  # fmt: skip
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    up = serve_up(walk)
    assert up.returncode == 0, up.stderr[-3000:] + (Path(walk["dir"]) / "serve" / "serve.log").read_text()[-3000:]
    env = {**walk["env"], **parse_exports(cli("stack", "env", "--dir", walk["dir"], env=walk["env"]).stdout)}
    walk["env"] = env
    client = httpx.Client(
        base_url=env["GRPO_SERVE_URL"], headers={"Authorization": f"Bearer {env['GRPO_SERVE_API_KEY']}"}, timeout=120
    )
    yield client
    client.close()


def ask(client: httpx.Client, user: str) -> httpx.Response:
    return client.post("/chat/completions", json={"messages": PROMPT, "max_tokens": 6, "temperature": 0, "user": user})


def test_the_champion_answers_with_the_key_stack_env_prints(serving_stack, walk):
    (v1,) = walk["versions"]
    assert not walk["env"]["GRPO_SERVE_URL"].startswith("http://127.0.0.1:8000/")  # --serve-port 0 took a free one
    assert httpx.get(f"{walk['env']['GRPO_SERVE_URL']}/models").status_code == 401  # no key, no answer
    models = serving_stack.get("/models").json()["data"]
    assert [(m["id"], m["version"]) for m in models] == [("champion", v1)]
    answer = ask(serving_stack, "alice")
    assert answer.status_code == 200, answer.text
    assert (answer.headers["X-GRPO-Arm"], answer.headers["X-GRPO-Version"]) == ("champion", v1)
    assert answer.json()["model"] == f"champion-v{v1}" and answer.json()["choices"][0]["message"]["content"]
    feedback = serving_stack.post("/feedback", json={"id": answer.json()["id"], "score": 1.0})
    assert feedback.status_code == 200 and feedback.json()["status"] == "stored"
    assert serving_stack.post("/feedback", json={"id": "no-such-id", "score": 1.0}).status_code == 404

    status = cli("ab", "status", "--json", "--config", walk["config"], env=walk["env"])
    assert status.returncode == 0, status.stderr[-3000:]
    counts = json.loads(status.stdout)["log"]["champion"][v1]
    assert counts["requests"] >= 1 and counts["feedback"] == 1  # the router's log, as the stack's shell sees it


def test_the_openai_client_of_the_docs_gets_the_arm_and_the_id(serving_stack, walk):
    script = """
import os
from openai import OpenAI
client = OpenAI(base_url=os.environ["GRPO_SERVE_URL"], api_key=os.environ["GRPO_SERVE_API_KEY"])
raw = client.chat.completions.with_raw_response.create(
    model="champion", messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=6, user="alice")
answer = raw.parse()
print(raw.headers["X-GRPO-Arm"], raw.headers["X-GRPO-Version"], answer.model, answer.id)
"""
    if subprocess.run([str(ENGINE_PYTHON), "-c", "import openai"], capture_output=True).returncode:
        pytest.skip(f"no openai client in {ENGINE_PYTHON} (vLLM installs it)")
    run = subprocess.run([str(ENGINE_PYTHON), "-c", script], env=walk["env"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    arm, version, model, request_id = run.stdout.split()
    assert (arm, model) == ("champion", f"champion-v{version}") and request_id.startswith("grpo-")


def test_a_challenger_registered_while_it_serves_is_picked_up(serving_stack, walk):
    v2 = register(walk, 2)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            mp.setenv(key, walk["env"][key])
        Registry(mlflow.MlflowClient(walk["env"]["MLFLOW_TRACKING_URI"]), NAME).apply([AliasMove(CHALLENGER, v2)])
    deadline = time.monotonic() + 120  # poll_s=2; the adapter's download and load
    while time.monotonic() < deadline:
        if ("challenger", v2) in [(m["id"], m["version"]) for m in serving_stack.get("/models").json()["data"]]:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the router did not pick up challenger v{v2}")
    arms = {ask(serving_stack, f"user-{i}").headers["X-GRPO-Arm"] for i in range(40)}
    assert arms == {"champion", "challenger"}  # half the users, by hash: 40 users all on one arm is 2**-39


def test_stack_down_stops_the_router_and_its_engine(serving_stack, walk):
    log = (Path(walk["dir"]) / "serve" / "serve.log").read_text()
    engine_url = log.split("starting the engine")[1].split(" on ")[1].split()[0]
    assert httpx.get(f"{engine_url}/v1/models").status_code == 401  # up, and asking for the router's key
    down = cli("stack", "down", "--dir", walk["dir"], env=walk["env"])
    assert down.returncode == 0 and "serve" in down.stderr
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{walk['env']['GRPO_SERVE_URL']}/models", timeout=5)
    assert engine_gone(engine_url, 60), f"the engine at {engine_url} outlived `stack down`"
