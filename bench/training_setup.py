"""What the training benchmarks that drive the trainer directly share (`bench.checkpoint_overhead`,
`bench.distributed_scaling`): the demo configuration, a scratch folder, the model (SmolLM2-135M, or a tiny
random Llama with --tiny), the demo task's splits, job specs for the trainer alone, and emptying an S3
checkpoint store between runs, so a resumable trainer never picks up the last run's checkpoints."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.harness import ROOT
from grpo_pipeline.configs.schema import PipelineConfig, load_config
from grpo_pipeline.tasks.data.demo_task import generate
from grpo_pipeline.tasks.data.splits import write_splits
from grpo_pipeline.tasks.job import build_job_spec
from grpo_pipeline.tasks.model import ensure_demo_model
from grpo_pipeline.trainer.checkpoints import S3Store
from tests.tiny_model import create_random_model

DEMO = ROOT / "configs" / "demo-cpu.yaml"
BUCKET = "bench"  # the benchmarks' SeaweedFS bucket


@dataclass
class TrainingSetup:
    demo: PipelineConfig
    work: Path
    model: Path
    splits: dict[str, Path]
    suffix: str  # "_tiny" under --tiny: its results are saved apart and not tabled

    def spec_file(self, name: str, *overrides: str, endpoint: str | None = None) -> Path:
        """`<work>/<name>.json`: the demo config with `overrides` as a job spec for the trainer alone (no
        MLflow), working in `<work>/<name>`; with `endpoint`, checkpointing to s3://bench/<name> there."""
        extra = [f"train.s3_endpoint_url={endpoint}"] if endpoint else []
        cfg = load_config(DEMO, [*extra, *overrides])
        spec = build_job_spec(cfg.train, cfg.model, str(self.model), self.splits, self.work / name)
        update: dict = {"mlflow_tracking_uri": None}
        if endpoint:
            update["checkpoint_uri"] = f"s3://{BUCKET}/{name}"
        return spec.model_copy(update=update).write(self.work / f"{name}.json")

    def store(self, name: str, endpoint: str) -> S3Store:
        """The S3 checkpoint store of the spec `name` (written with `endpoint`)."""
        return S3Store(f"s3://{BUCKET}/{name}", endpoint_url=endpoint)


def training_setup(args: argparse.Namespace, prefix: str) -> TrainingSetup:
    """The model, splits and a fresh scratch folder (`prefix`...) for `bench.harness.training_bench_args`."""
    demo = load_config(DEMO)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    model = create_random_model(work / "tiny") if args.tiny else ensure_demo_model(demo.data_dir / "models")
    splits = write_splits(generate(demo.data.demo), work / "data")
    return TrainingSetup(demo, work, Path(model), splits, "_tiny" if args.tiny else "")


def clear_store(store: S3Store) -> None:
    """Delete every object under the store's prefix: the next run starts without checkpoints."""
    for key in store._keys(store.prefix + "/"):
        store.s3.delete_object(Bucket=store.bucket, Key=key)
