"""Plan = launch: a plan that does not fit one GPU becomes train.distributed and the SkyPilot task's GPU request,
and the node launcher then starts that many processes with the planned strategy."""

import subprocess
import sys

import pytest

from grpo_pipeline.configs.schema import TrainConfig, load_config
from grpo_pipeline.infra.launch.skypilot import build_task, write_job_dir
from grpo_pipeline.tasks.job import build_job_spec
from grpo_pipeline.tasks.plan import PlanError, load_catalog, load_model_config
from grpo_pipeline.tasks.plan.stage import apply_plan, plan_for_config
from grpo_pipeline.trainer.spec import JobSpec


def _sections(cfg):
    """What the planner's stage functions take of a PipelineConfig."""
    return cfg.model, cfg.train, cfg.plan


def test_a_70b_bf16_lora_plan_asks_for_several_gpus_and_launches_one_process_on_each(tmp_path):
    cfg = load_config(
        None,
        [
            "model.base=llama-3.1-70b",
            "model.compute_dtype=bfloat16",
            "train.launcher=sky",
            "train.checkpoint_uri=s3://b/p",
            "train.grpo.max_steps=100",
        ],
    )
    plan = plan_for_config(cfg.model, cfg.train, cfg.plan, load_model_config(cfg.model.base)[1], cfg.model.base)
    count, strategy = plan.settings.count, plan.settings.strategy
    assert count > 1 and strategy == "fsdp"  # 70B weights do not fit one GPU: sharded over several
    planned = apply_plan(cfg, plan)
    TrainConfig.model_validate(planned.train.model_dump())  # the planned section is a valid launch
    assert (planned.train.distributed.strategy, planned.train.distributed.processes_per_node) == (strategy, count)
    assert all(a.endswith(f":{count}") for a in planned.train.sky.accelerators)

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    spec = build_job_spec(
        planned.train,
        planned.model,
        "meta-llama/Llama-3.1-70B-Instruct",
        {"train": data, "val": data},
        tmp_path / "run",
    )
    job_dir = write_job_dir(spec, tmp_path / "job")
    task = build_task(spec, job_dir, planned.train.sky, 3, environ={})
    assert [dict(r.accelerators) for r in task.resources][0] == {plan.settings.gpu: count}
    assert task.num_nodes == 1

    # what the node runs with the GPUs it was given (a dry run: the commands and environment, nothing started)
    node = JobSpec.read(job_dir / "job.json")
    assert node.train.distributed.processes_per_node == count
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_pipeline.trainer.launch",
            "--spec",
            str(job_dir / "job.json"),
            "--nnodes",
            "1",
            "--gpus-per-node",
            str(count),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # the node's own command, as a real process once; the tests below call its `main` in this process
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--nproc-per-node {count}" in proc.stdout
    assert "ACCELERATE_USE_FSDP=true" in proc.stdout and "FSDP_VERSION=2" in proc.stdout


def test_a_local_run_keeps_its_own_distributed_section():
    cfg = load_config(None, ["train.distributed.processes_per_node=2"])
    plan = plan_for_config(cfg.model, cfg.train, cfg.plan, load_model_config("smollm2-135m")[1], "smollm2-135m")
    assert apply_plan(cfg, plan).train.distributed == cfg.train.distributed


@pytest.fixture
def dry_run(capsys, caplog):
    """The node launcher's dry run, its `main` in this process (a subprocess adds only its start-up and
    imports): `dry_run(job_dir, *args)` -> what it prints."""
    from grpo_pipeline.trainer.launch import main

    def run(job_dir, *args):
        capsys.readouterr()
        assert main(["--spec", str(job_dir / "job.json"), *args, "--dry-run"]) == 0, caplog.text
        return capsys.readouterr().out

    return run


def _job(tmp_path, planned, model="meta-llama/Llama-3.1-70B-Instruct"):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    spec = build_job_spec(planned.train, planned.model, model, {"train": data, "val": data}, tmp_path / "run")
    job_dir = write_job_dir(spec, tmp_path / "job")
    return spec, job_dir


SERVER = [
    "model.base=llama-3.1-70b",
    "model.compute_dtype=bfloat16",
    "train.launcher=sky",
    "train.checkpoint_uri=s3://b/p",
    "train.grpo.max_steps=100",
    "train.grpo.use_vllm=true",
]


def test_a_70b_server_mode_plan_shards_the_trainers_and_prices_the_server_gpus(tmp_path, dry_run):
    cfg = load_config(None, SERVER + ["train.grpo.vllm_mode=server"])
    model_config = load_model_config("llama-3.1-70b")[1]
    plan = plan_for_config(cfg.model, cfg.train, cfg.plan, model_config, "llama-3.1-70b")
    s = plan.settings
    assert s.strategy == "fsdp" and s.vllm_server_gpus >= 1 and s.vllm_tensor_parallel == s.vllm_server_gpus
    assert s.processes_per_node + s.vllm_server_gpus == s.count and s.world_size == s.processes_per_node
    # training GPUs hold no vLLM share; the server holds the unquantized bf16 weights, split tensor-parallel
    assert plan.memory.vllm == 0 and plan.memory.kv_cache == 0
    assert plan.server_memory.weights * s.vllm_tensor_parallel == pytest.approx(plan.params * 2, rel=1e-6)
    gpu = load_catalog().get(s.gpu)
    assert plan.server_memory.total <= 0.9 * gpu.memory_gib * 2**30
    # the price counts every GPU on the node, the server's included
    assert plan.estimate.on_demand_usd == pytest.approx(plan.estimate.hours * s.count * gpu.on_demand_usd_h)
    # colocated, the same run cannot shard (vLLM needs the whole bf16 model beside each trainer): nothing fits
    with pytest.raises(PlanError, match="does not fit any allowed GPU"):
        plan_for_config(*_sections(load_config(None, SERVER + ["train.grpo.vllm_mode=colocate"])), model_config, "m")

    planned = apply_plan(cfg, plan)
    d = planned.train.distributed
    assert (d.strategy, d.processes_per_node, d.vllm_server_gpus) == ("fsdp", s.processes_per_node, s.vllm_server_gpus)
    TrainConfig.model_validate(planned.train.model_dump())
    spec, job_dir = _job(tmp_path, planned)
    task = build_task(spec, job_dir, planned.train.sky, 3, environ={})
    assert [dict(r.accelerators) for r in task.resources][0] == {s.gpu: s.count} and task.num_nodes == 1

    # the node launcher splits the node's GPUs as the plan says: trainers first, the server on the last ones
    out = dry_run(job_dir, "--nnodes", "1", "--gpus-per-node", str(s.count))
    trainers = ",".join(map(str, range(s.processes_per_node)))
    server = ",".join(map(str, range(s.processes_per_node, s.count)))
    assert f"CUDA_VISIBLE_DEVICES={server} " in out and f"--tensor-parallel-size {s.vllm_tensor_parallel}" in out
    assert f"CUDA_VISIBLE_DEVICES={trainers} " in out and f"--nproc-per-node {s.processes_per_node}" in out
    assert f"GPUs {s.processes_per_node}-{s.count - 1}" in s.server_gpus()  # what the plan's table says


def test_the_70b_recipe_plans_its_own_launch_with_a_server_node(tmp_path, dry_run):
    from grpo_pipeline.configs.files import packaged
    from grpo_pipeline.tasks.plan import plan_run

    cfg = load_config(packaged("gsm8k-llama-3.1-70b.yaml"))
    plan = plan_run(cfg.model, cfg.train, cfg.plan)
    s, d, grpo = plan.settings, cfg.train.distributed, cfg.train.grpo
    assert (s.strategy, s.vllm_server_node, s.processes_per_node) == ("fsdp", True, d.processes_per_node)
    assert s.nodes == d.nodes + 1 and s.gpus == s.nodes * s.count and s.vllm_tensor_parallel == s.count
    assert plan.estimate.gpu_hours == pytest.approx(plan.estimate.hours * s.gpus)
    # the effective batch is what TRL runs: per device x accumulation x every training process
    assert plan.workload.effective_batch == (
        grpo["per_device_train_batch_size"] * grpo["gradient_accumulation_steps"] * d.nodes * d.processes_per_node
    )
    assert (s.per_device_train_batch_size, s.gradient_accumulation_steps) == (
        grpo["per_device_train_batch_size"],
        grpo["gradient_accumulation_steps"],
    )  # the recipe's, kept

    planned = apply_plan(cfg, plan)
    spec, job_dir = _job(tmp_path, planned)
    assert build_task(spec, job_dir, planned.train.sky, 3, environ={}).num_nodes == s.nodes
    nodes = ["--nnodes", str(s.nodes), "--gpus-per-node", str(s.count)]
    serving = dry_run(job_dir, *nodes, "--node-rank", str(s.nodes - 1))
    assert "vllm-serve" in serving and f"--tensor-parallel-size {s.vllm_tensor_parallel}" in serving
    training = dry_run(job_dir, *nodes, "--node-rank", "0")
    assert f"--nnodes {s.train_nodes} " in training and f"--nproc-per-node {s.processes_per_node}" in training


def test_a_server_mode_config_with_its_own_server_gpus_launches_the_planned_strategy_and_processes(tmp_path, dry_run):
    """Server mode always sets vllm_server_gpus (or vllm_server_node), so the planned layout is written field by
    field: the user's server GPUs stay, the planned strategy and processes fill the rest. Before, setting any of
    them kept every one at its default: Qwen2.5-32B planned as FSDP over 2 trainers launched DDP (out of memory)."""
    sets = [
        "model.base=qwen2.5-32b",
        "model.compute_dtype=bfloat16",
        "train.launcher=sky",
        "train.checkpoint_uri=s3://b/p",
        "train.grpo.max_steps=100",
        "train.grpo.use_vllm=true",
        "train.grpo.vllm_mode=server",
        "train.distributed.vllm_server_gpus=2",
        "plan.target_effective_batch=64",
    ]
    cfg = load_config(None, sets)
    model_config = load_model_config("qwen2.5-32b")[1]
    plan = plan_for_config(cfg.model, cfg.train, cfg.plan, model_config, "qwen2.5-32b")
    s = plan.settings
    assert (s.gpu, s.count, s.strategy, s.processes_per_node, s.vllm_server_gpus) == ("L40S", 4, "fsdp", 2, 2)
    # unsharded, the same node runs out of memory: the strategy is what makes this plan fit
    with pytest.raises(PlanError, match="does not fit any allowed GPU"):
        plan_for_config(
            *_sections(load_config(None, sets + ["train.distributed.strategy=ddp", "train.sky.accelerators=[L40S:4]"])),
            model_config,
            "qwen2.5-32b",
        )

    planned = apply_plan(cfg, plan)
    d = planned.train.distributed
    assert (d.strategy, d.processes_per_node, d.vllm_server_gpus, d.vllm_server_node) == ("fsdp", 2, 2, False)
    TrainConfig.model_validate(planned.train.model_dump())
    spec, job_dir = _job(tmp_path, planned, "Qwen/Qwen2.5-32B-Instruct")
    task = build_task(spec, job_dir, planned.train.sky, 3, environ={})
    assert [dict(r.accelerators) for r in task.resources][0] == {"L40S": 4} and task.num_nodes == 1
    assert JobSpec.read(job_dir / "job.json").train.distributed.strategy == "fsdp"

    out = dry_run(job_dir, "--nnodes", "1", "--gpus-per-node", "4")
    assert "CUDA_VISIBLE_DEVICES=2,3 " in out and "--tensor-parallel-size 2" in out  # the server: the last 2 GPUs
    assert "CUDA_VISIBLE_DEVICES=0,1 " in out and "--nproc-per-node 2" in out  # two trainers, sharded
    assert "ACCELERATE_USE_FSDP=true" in out


def test_the_user_s_distributed_fields_win_and_the_plan_fills_the_rest():
    sets = [
        "model.base=qwen2.5-32b",
        "model.compute_dtype=bfloat16",
        "train.launcher=sky",
        "train.grpo.max_steps=100",
        "train.grpo.use_vllm=true",
        "train.grpo.vllm_mode=server",
        "train.distributed.vllm_server_gpus=2",
        "train.distributed.strategy=zero3",
        "plan.target_effective_batch=64",
    ]
    cfg = load_config(None, sets)
    plan = plan_for_config(cfg.model, cfg.train, cfg.plan, load_model_config("qwen2.5-32b")[1], "qwen2.5-32b")
    d = apply_plan(cfg, plan).train.distributed
    assert plan.settings.strategy == "zero3"  # the plan was sized with the user's strategy
    assert (d.strategy, d.vllm_server_gpus, d.processes_per_node) == ("zero3", 2, plan.settings.processes_per_node)
    assert d.model_fields_set >= {"strategy", "vllm_server_gpus", "processes_per_node"}
