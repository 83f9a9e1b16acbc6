"""train.distributed without processes: its validation, the checks before launch (exit 2, nothing started or
written), the torchrun and vLLM commands, and the strategy config files read by accelerate's own classes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_pipeline.configs.layout import DistributedConfig
from grpo_pipeline.configs.schema import ConfigError, ModelConfig, TrainConfig, load_config
from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.distributed import problems
from grpo_pipeline.trainer.launch import ACCELERATE_CONFIGS, strategy_env
from grpo_pipeline.trainer.spec import JobSpec, TrainSettings

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {"per_device_train_batch_size": 8, "num_generations": 8, "gradient_accumulation_steps": 1}


def _spec(tmp_path, quantization="none", checkpoint_uri=None, grpo=None, **distributed) -> JobSpec:
    return JobSpec(
        model_path="m",
        model=model_load(ModelConfig(quantization=quantization)),
        train=train_settings(TrainConfig()).model_copy(
            update={"grpo": grpo or {}, "distributed": DistributedConfig(**distributed)}
        ),
        train_file="t",
        work_dir=str(tmp_path / "work"),
        adapter_dir=str(tmp_path / "a"),
        checkpoint_uri=checkpoint_uri or str(tmp_path / "ckpt"),
    )


def test_config_spec_and_planner_hold_the_one_distributed_type():
    """One type, not copies kept alike: the config's train.distributed, the job spec's and the planner's fixed
    layout are the same class, so a field, bound, default or validator cannot differ between them."""
    from grpo_pipeline.tasks.plan import Layout

    holders = (TrainConfig, TrainSettings, Layout)
    assert {holder.model_fields["distributed"].annotation for holder in holders} == {DistributedConfig}
    with pytest.raises(ValueError, match="follow from train.distributed"):  # the config's validator, on the node too
        TrainSettings.model_validate(
            {**train_settings(TrainConfig()).model_dump(), "distributed": {"accelerate": {"num_processes": 4}}}
        )
    assert (
        train_settings(
            load_config(None, ["train.distributed.processes_per_node=2"]).train
        ).distributed.processes_per_node
        == 2
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.distributed.nodes=2"], "needs train.launcher=sky"),
        (["train.distributed.nodes=2", "train.launcher=sky"], "set train.checkpoint_uri=s3://bucket/prefix"),
        (
            ["train.distributed.processes_per_node=3", "train.grpo.per_device_train_batch_size=4"],
            "4 x 3 x 1 = 12 completions is not a multiple of num_generations (8)",
        ),
        (
            ["train.launcher=sky", "train.sky.accelerators=[L4:1]", "train.distributed.processes_per_node=2"],
            "needs 2 GPUs per node, and train.sky.accelerators offers [1]",
        ),
        (
            ["train.launcher=sky", "train.sky.accelerators=[H100:3]", "train.grpo.per_device_train_batch_size=4"],
            "per_device_train_batch_size=8",
        ),  # one process per GPU: 3 of them
        (["train.distributed.accelerate={num_processes: 4}"], "follow from train.distributed"),
        (["train.distributed.strategy=zero4"], "train.distributed.strategy"),
    ],
)
def test_bad_distributed_config_is_refused_with_the_numbers_and_a_fix(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_a_good_two_node_config_validates():
    cfg = load_config(
        None,
        [
            "train.launcher=sky",
            "train.checkpoint_uri=s3://b/p",
            "train.distributed.nodes=2",
            "train.sky.accelerators=[H100:8]",
            "train.grpo.per_device_train_batch_size=4",
        ],
    )
    assert cfg.train.distributed.nodes == 2


@pytest.mark.parametrize(
    ("kwargs", "gpus", "message"),
    [
        ({"processes_per_node": 4}, 2, "processes_per_node (4) needs 4 GPUs on a node that has 2"),
        ({"strategy": "fsdp"}, 0, "strategy=fsdp needs GPUs"),
        ({"strategy": "zero3", "quantization": "nf4"}, 2, "a bitsandbytes nf4 base cannot be sharded"),
        ({"strategy": "fsdp", "quantization": "int8"}, 2, "do not shard int8"),
        ({"nodes": 2}, 8, "set train.checkpoint_uri=s3://bucket/prefix"),
        ({"grpo": {"use_vllm": True, "vllm_mode": "server"}}, 8, "set train.distributed.vllm_server_gpus=K"),
        ({"vllm_server_gpus": 2}, 8, "only with train.grpo.use_vllm=true and vllm_mode=server"),
        (
            {"processes_per_node": 3, "grpo": {"per_device_train_batch_size": 2, "num_generations": 4}},
            4,
            "2 x 3 x 1 = 6 completions is not a multiple of num_generations (4)",
        ),
    ],
)
def test_problems_name_numbers_and_fix(tmp_path, kwargs, gpus, message):
    quant, grpo = kwargs.pop("quantization", "none"), kwargs.pop("grpo", None)
    found = problems(_spec(tmp_path, quant, grpo=grpo, **kwargs), gpus, DEFAULTS)
    assert any(message in p for p in found), found


def test_zero2_keeps_a_quantized_base_and_ddp_fits(tmp_path):
    assert problems(_spec(tmp_path, "nf4", strategy="zero2"), 2, DEFAULTS) == []
    assert problems(_spec(tmp_path, "nf4"), 8, DEFAULTS) == []  # one process per GPU, 8 x 8 completions


def test_bad_launch_exits_2_before_anything_starts(tmp_path):
    """The node launcher as SkyPilot's run command starts it: a real process, its exit code and stderr."""
    spec = _spec(tmp_path, processes_per_node=3, grpo={"per_device_train_batch_size": 2, "num_generations": 4})
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.trainer.launch", "--spec", str(spec.write(tmp_path / "job.json"))]
        + ["--gpus-per-node", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "2 x 3 x 1 = 6 completions" in proc.stderr and "per_device_train_batch_size=4" in proc.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "ckpt").exists()  # nothing half-written


@pytest.fixture
def launch(capsys, caplog, monkeypatch):
    """The node launcher's `main` in this process (a dry run starts nothing, and a subprocess would only add
    its start-up and imports): `launch(spec_path, *args, env=...)` -> (exit code, stdout, log)."""
    from grpo_pipeline.trainer.launch import main

    def run(spec_path, *args, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        caplog.clear()
        code = main(["--spec", str(spec_path), *args])
        return code, capsys.readouterr().out, caplog.text

    return run


def test_node_count_must_match_the_job(tmp_path, launch):
    spec = _spec(tmp_path, nodes=2, checkpoint_uri="s3://b/p")
    code, _, log = launch(spec.write(tmp_path / "job.json"), "--nnodes", "3", "--gpus-per-node", "0", "--dry-run")
    assert code == 2 and "--nnodes 3 (SKYPILOT_NUM_NODES) differs" in log


def test_dry_run_shows_torchrun_for_two_processes_and_the_plain_trainer_for_one(tmp_path, launch):
    code, two, log = launch(
        _spec(tmp_path, processes_per_node=2, grpo={"per_device_train_batch_size": 4}).write(tmp_path / "two.json"),
        "--gpus-per-node",
        "0",
        "--dry-run",
        "--master-port",
        "29999",
    )
    assert code == 0, log
    assert "-m torch.distributed.run --nnodes 1 --node-rank 0 --nproc-per-node 2" in two
    assert "--master-port 29999" in two and "-m grpo_pipeline.trainer --spec" in two
    code, one, _ = launch(_spec(tmp_path).write(tmp_path / "one.json"), "--gpus-per-node", "0", "--dry-run")
    assert code == 0 and one.split()[1:] == ["-m", "grpo_pipeline.trainer", "--spec", str(tmp_path / "one.json")]


def test_vllm_server_mode_splits_the_gpus_without_overlap(tmp_path, launch):
    spec = _spec(
        tmp_path, vllm_server_gpus=2, grpo={"use_vllm": True, "vllm_mode": "server", "per_device_train_batch_size": 4}
    )
    code, out, log = launch(spec.write(tmp_path / "job.json"), "--gpus-per-node", "8", "--dry-run")
    assert code == 0, log
    server, trainers = out.strip().splitlines()
    assert server.startswith("CUDA_VISIBLE_DEVICES=6,7 ") and "vllm-serve --model m --tensor-parallel-size 2" in server
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5" in trainers and "--nproc-per-node 6" in trainers
    assert "GRPO_VLLM_SERVER_HOST=127.0.0.1" in trainers
    assert "--host 127.0.0.1 " in server  # no auth: its trainers share its node, so nobody else need reach it


def test_a_vllm_node_of_its_own_listens_on_its_own_address_only(tmp_path, launch):
    spec = _spec(
        tmp_path,
        vllm_server_node=True,
        checkpoint_uri="s3://b/p",
        grpo={"use_vllm": True, "vllm_mode": "server", "per_device_train_batch_size": 4},
    )
    code, out, log = launch(
        spec.write(tmp_path / "job.json"),
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--gpus-per-node",
        "8",
        "--dry-run",
        env={"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2"},
    )
    assert code == 0, log
    assert "vllm-serve" in out and "--host 10.0.0.2 " in out and "0.0.0.0" not in out


# ------------------------------------------------------------- strategy configs, read by accelerate's own code


@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "zero3"])
def test_strategy_files_are_self_documenting_accelerate_configs(strategy):
    from accelerate.commands.config.config_args import ClusterConfig

    path = ACCELERATE_CONFIGS / f"{strategy}.yaml"
    assert path.read_text().startswith("# ")
    config = ClusterConfig.from_yaml_file(str(path))  # accelerate's parser: unknown keys refused
    assert config.distributed_type.value == ("FSDP" if strategy == "fsdp" else "DEEPSPEED")


def test_fsdp_config_becomes_accelerates_fsdp2_plugin(tmp_path, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    env = strategy_env(_spec(tmp_path, strategy="fsdp"), 8, 2)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # the two settings that need a GPU to build the plugin (it makes a param_init_fn on the current device)
    monkeypatch.setenv("FSDP_SYNC_MODULE_STATES", "false")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    plugin = FullyShardedDataParallelPlugin()  # as the trainer's Accelerator builds it, from the environment
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)


@pytest.mark.parametrize(("strategy", "stage"), [("zero2", 2), ("zero3", 3)])
def test_zero_configs_become_accelerates_deepspeed_plugin(tmp_path, monkeypatch, strategy, stage):
    from accelerate.utils import DeepSpeedPlugin

    spec = _spec(tmp_path, strategy=strategy, accelerate={"deepspeed_config": {"offload_optimizer_device": "cpu"}})
    for key, value in strategy_env(spec, 8, 1).items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()  # as TrainingArguments builds it from ACCELERATE_USE_DEEPSPEED's environment
    assert plugin.zero_stage == stage
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"  # the override reached DeepSpeed's own config
    assert zero["stage3_gather_16bit_weights_on_model_save"] is (stage == 3)
    try:  # DeepSpeed's own parser where the package is installed (not in the pinned set: it needs a CUDA build)
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return
    filled = json.loads(json.dumps(plugin.deepspeed_config).replace('"auto"', "1"))
    assert DeepSpeedConfig(filled).zero_optimization_stage == stage


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"fsdp_config": {"fsdp_reshard_after_forwrd": True}},
            "keys accelerate does not know: ['fsdp_reshard_after_forwrd']",
        ),
        ({"fsdp_configs": {}}, "unknown keys (['fsdp_configs'])"),
    ],
)
def test_a_misspelt_override_is_refused_by_accelerates_parser(tmp_path, override, message):
    with pytest.raises(ValueError) as err:
        strategy_env(_spec(tmp_path, strategy="fsdp", accelerate=override), 8, 1)
    assert message in str(err.value)


def test_strategy_files_need_no_mixed_precision_or_sizes():
    """Those come from train.grpo (bf16) and train.distributed (nodes, processes): never two sources."""
    for path in ACCELERATE_CONFIGS.glob("*.yaml"):
        keys = set(yaml.safe_load(path.read_text()))
        assert not keys & {"mixed_precision", "num_processes", "num_machines"}, path.name
