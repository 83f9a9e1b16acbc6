"""SkyPilot task YAMLs and the spec -> sky.Task conversion, checked with SkyPilot's own parser in SkyPilot's own
environment (.venv-sky), driven from this one."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_pipeline.configs.schema import ModelConfig, SkyConfig, TrainConfig
from grpo_pipeline.infra.launch.skypilot import (
    PROJECT_ROOT,
    SkyError,
    SkyPreflightError,
    build_task,
    node_spec,
    parse_task,
    sky_python,
    write_job_dir,
)
from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.spec import JobSpec


@pytest.mark.parametrize("path", sorted((PROJECT_ROOT / "sky").glob("*.yaml")), ids=lambda p: p.name)
def test_every_sky_yaml_parses_and_runs_the_trainer(path):
    task = parse_task(yaml.safe_load(path.read_text()))
    assert all(r.use_spot for r in task.resources)
    assert "python -m grpo_pipeline.trainer" in task.run and "--spec /grpo/job/job.json" in task.run
    assert path.read_text().startswith("# "), "each YAML starts with what it is for"
    assert "sky jobs launch sky/" in path.read_text()


def _spec(tmp_path, model_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    return JobSpec(
        model_path=str(model_path),
        model=model_load(ModelConfig()),
        train=train_settings(TrainConfig()),
        train_file=str(data),
        work_dir=str(tmp_path / "w"),
        checkpoint_uri="s3://bucket/run",
        adapter_dir=str(tmp_path / "a"),
        mlflow_tracking_uri="http://mlflow:5000",
        mlflow_run_id="abc",
    )


def test_spec_to_task_sets_spot_recovery_mounts_envs_and_secrets(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    spec = _spec(tmp_path, model)
    job_dir = write_job_dir(spec, tmp_path / "job")
    cfg = SkyConfig(accelerators=["A100-80GB:1", "L40S:1"])
    task = build_task(
        spec, job_dir, cfg, max_restarts=5, environ={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    )

    assert [dict(r.accelerators) for r in task.resources] == [{"A100-80GB": 1}, {"L40S": 1}]
    assert all(r.use_spot and r.job_recovery["max_restarts_on_errors"] == 5 for r in task.resources)
    assert all(r.job_recovery["recover_on_exit_codes"] == [75] for r in task.resources)
    assert task.envs["JOB_DIR"] == str(job_dir.resolve())
    assert task.file_mounts == {"/grpo/job": str(job_dir.resolve()), "/grpo/model": str(model.resolve())}
    assert task.secrets == {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}

    shipped = JobSpec.read(job_dir / "job.json")
    assert shipped.model_path == "/grpo/model" and shipped.train_file == "/grpo/job/data/train.jsonl"
    assert shipped.mlflow_run_id == "abc"  # a recovered job continues the same MLflow run
    assert (job_dir / "data" / "train.jsonl").read_text() == Path(spec.train_file).read_text()


def test_on_demand_and_hub_model(tmp_path):
    spec = _spec(tmp_path, "Qwen/Qwen2.5-7B-Instruct")
    task = build_task(spec, write_job_dir(spec, tmp_path / "job"), SkyConfig(use_spot=False), 3, environ={})
    assert not any(r.use_spot for r in task.resources)
    assert "/grpo/model" not in task.file_mounts
    assert node_spec(spec).model_path == "Qwen/Qwen2.5-7B-Instruct"
    base = yaml.safe_load((PROJECT_ROOT / "sky" / "train.yaml").read_text())
    assert [dict(r.accelerators) for r in task.resources] == [
        {k: int(v)} for a in base["resources"]["ordered"] for k, v in [a["accelerators"].split(":")]
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.launcher=sky"], "set train.checkpoint_uri=s3://bucket/prefix"),
        (["train.launcher=sky", "train.checkpoint_uri=s3://b/r"], "set tracking.mlflow_tracking_uri=http(s)://"),
    ],
)
def test_preflight_names_what_a_managed_job_needs(overrides, message):
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.infra.launch.skypilot import SkyPreflightError, check_sky

    cfg = load_config(None, overrides)
    with pytest.raises(SkyPreflightError) as err:
        check_sky(cfg.train, cfg.mlflow_uri)
    assert message in str(err.value)


def test_streamed_log_text_reaches_the_callback_line_by_line():
    from grpo_pipeline.infra.launch.skypilot import _Lines

    lines = []
    stream = _Lines(lines.append)
    stream.write("{'loss': 0.1}\n{'lo")
    stream.write("ss': 0.2}\r\npartial")
    assert lines == ["{'loss': 0.1}", "{'loss': 0.2}"]


def _distributed(tmp_path, **distributed):
    spec = _spec(tmp_path, "Qwen/Qwen2.5-7B-Instruct")
    return spec.model_copy(
        update={
            "train": spec.train.model_copy(
                update={"distributed": spec.train.distributed.model_copy(update=distributed)}
            )
        }
    )


def test_several_nodes_and_gpus_reach_the_task_and_its_run_command(tmp_path):
    spec = _distributed(tmp_path, nodes=2, processes_per_node=8)
    task = build_task(spec, write_job_dir(spec, tmp_path / "job"), SkyConfig(), 3, environ={})
    assert task.num_nodes == 2
    # the YAML's options, each asking for the 8 GPUs a node's 8 processes need
    assert [dict(r.accelerators) for r in task.resources] == [{"H100": 8}, {"A100-80GB": 8}, {"L40S": 8}]
    assert all(r.job_recovery["recover_on_exit_codes"] == [75] for r in task.resources)
    for var in ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE"):
        assert f'"${var}"' in task.run
    assert "python -m grpo_pipeline.trainer.launch --spec /grpo/job/job.json" in task.run
    assert JobSpec.read(tmp_path / "job" / "job.json").train.distributed.nodes == 2


def test_a_dedicated_vllm_node_is_one_more_node(tmp_path):
    spec = _distributed(tmp_path, nodes=2, vllm_server_node=True)
    spec = spec.model_copy(
        update={"train": spec.train.model_copy(update={"grpo": {"use_vllm": True, "vllm_mode": "server"}})}
    )
    task = build_task(spec, write_job_dir(spec, tmp_path / "job"), SkyConfig(accelerators=["H100:8"]), 3, environ={})
    assert task.num_nodes == 3
    assert [dict(r.accelerators) for r in task.resources] == [{"H100": 8}]


def test_a_plan_of_two_gpus_asks_for_two_and_launches_two_processes(tmp_path):
    """apply_plan's accelerator options (GPU:count) and strategy reach the task unchanged."""
    spec = _distributed(tmp_path, strategy="fsdp")
    task = build_task(
        spec, write_job_dir(spec, tmp_path / "job"), SkyConfig(accelerators=["A100-80GB:2"]), 3, environ={}
    )
    assert [dict(r.accelerators) for r in task.resources] == [{"A100-80GB": 2}]
    assert task.num_nodes == 1


def test_skypilot_lives_apart_and_each_environment_is_consistent():
    """The training stack's environment has no SkyPilot (its click pin would hold huggingface-hub back), and
    `pip check` passes in both environments."""
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("skypilot")
    for python in (sys.executable, sky_python()):
        check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True)
        assert check.returncode == 0, (python, check.stdout + check.stderr)


def test_a_task_skypilot_rejects_fails_with_skypilots_reason(tmp_path):
    spec = _spec(tmp_path, "Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(SkyError, match="num_nodes"):
        parse_task({"name": "x", "run": "true", "num_nodes": "two"})
    assert build_task(spec, write_job_dir(spec, tmp_path / "job"), SkyConfig(), 3, environ={}).num_nodes == 1


def test_a_missing_skypilot_environment_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_SKY_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(SkyPreflightError, match="make install"):
        parse_task({"name": "x", "run": "true"})


def test_a_warm_start_reaches_the_node_through_the_store_with_its_hashes_pinned(tmp_path):
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.trainer.checkpoints import adapter_files

    adapter = tmp_path / "champion-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 4}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    spec = _spec(tmp_path, "Qwen/Qwen2.5-7B-Instruct").model_copy(update={"init_adapter": str(adapter)})
    job_dir = write_job_dir(spec, tmp_path / "job")
    task = build_task(spec, job_dir, SkyConfig(), 3, environ={})

    # nothing of this machine's disk but the job folder is mounted: the adapter goes through the run's store
    assert task.file_mounts == {"/grpo/job": str(job_dir.resolve())}
    shipped = JobSpec.read(job_dir / "job.json")
    assert shipped.init_adapter == "s3://bucket/run/init-adapter"
    assert shipped.init_adapter_files == adapter_files(adapter)
    assert set(shipped.init_adapter_files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert load_config(None, ["model.init_adapter=champion", "train.launcher=sky"]).train.launcher == "sky"


def test_without_a_warm_start_the_node_spec_pins_no_adapter(tmp_path):
    shipped = node_spec(_spec(tmp_path, "Qwen/Qwen2.5-7B-Instruct"))
    assert shipped.init_adapter is None and shipped.init_adapter_files is None
