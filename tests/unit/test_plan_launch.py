"""Plan = launch: a plan that does not fit one GPU becomes train.distributed and the SkyPilot task's GPU request,
and the node launcher then starts that many processes with the planned strategy."""

import subprocess
import sys

from configs.schema import TrainConfig, load_config
from infra.launch.skypilot import build_task, write_job_dir
from tasks.job import build_job_spec
from tasks.plan import load_model_config
from tasks.plan.stage import apply_plan, plan_for_config
from trainer.spec import JobSpec


def test_a_70b_bf16_lora_plan_asks_for_several_gpus_and_launches_one_process_on_each(tmp_path):
    cfg = load_config(None, ["model.base=llama-3.1-70b", "model.compute_dtype=bfloat16", "train.launcher=sky",
                             "train.checkpoint_uri=s3://b/p",
                             "train.grpo.max_steps=100"])
    plan = plan_for_config(cfg, load_model_config(cfg.model.base)[1], cfg.model.base)
    count, strategy = plan.settings.count, plan.settings.strategy
    assert count > 1 and strategy == "fsdp"  # 70B weights do not fit one GPU: sharded over several
    planned = apply_plan(cfg, plan)
    TrainConfig.model_validate(planned.train.model_dump())  # the planned section is a valid launch
    assert (planned.train.distributed.strategy, planned.train.distributed.processes_per_node) == (strategy, count)
    assert all(a.endswith(f":{count}") for a in planned.train.sky.accelerators)

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    spec = build_job_spec(planned.train, planned.model, "meta-llama/Llama-3.1-70B-Instruct",
                          {"train": data, "val": data}, tmp_path / "run")
    job_dir = write_job_dir(spec, tmp_path / "job")
    task = build_task(spec, job_dir, planned.train.sky, 3, environ={})
    assert [dict(r.accelerators) for r in task.resources][0] == {plan.settings.gpu: count}
    assert task.num_nodes == 1

    # what the node runs with the GPUs it was given (a dry run: the commands and environment, nothing started)
    node = JobSpec.read(job_dir / "job.json")
    assert node.train.distributed.processes_per_node == count
    proc = subprocess.run([sys.executable, "-m", "trainer.launch", "--spec", str(job_dir / "job.json"), "--nnodes", "1",
                           "--gpus-per-node", str(count), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--nproc-per-node {count}" in proc.stdout
    assert "ACCELERATE_USE_FSDP=true" in proc.stdout and "FSDP_VERSION=2" in proc.stdout


def test_a_local_run_keeps_its_own_distributed_section():
    cfg = load_config(None, ["train.distributed.processes_per_node=2"])
    plan = plan_for_config(cfg, load_model_config("smollm2-135m")[1], "smollm2-135m")
    assert apply_plan(cfg, plan).train.distributed == cfg.train.distributed
