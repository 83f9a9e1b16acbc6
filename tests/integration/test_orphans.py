"""No orphaned training processes, with real processes: a SIGKILL to the node launcher's process group
(`python -m grpo_pipeline.trainer.launch` and torchrun; the ranks run in sessions of their own) ends both ranks before they
take another step, and a SIGKILL to the process that ran the local launcher (the flow's) ends its trainer."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.launch import free_port
from grpo_pipeline.trainer.spec import JobSpec

# slow: each kills a real launcher mid-training and waits for every rank to end (~60-120 s): `make test-slow`
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
RECORDED = "tests.integration.health_rewards:recorded"


def _spec(tmp_path, tiny_model, tiny_splits, tiny_config, *overrides) -> JobSpec:
    cfg = tiny_config(
        "train.grpo.max_steps=400", "train.checkpoint_every=1000", f"train.rewards=[{RECORDED}]", *overrides
    )
    return JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
    )


def _calls(prefix: Path) -> dict[str, int]:
    return {p.name: len(p.read_text().splitlines()) for p in prefix.parent.glob(prefix.name + ".rank*")}


def _until(condition, what: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {limit_s:.0f} s"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _trainers_of(prefix: Path) -> list[int]:
    """The pids of the processes that are training: those whose reward wrote to the calls files."""
    return [p.pid for p in psutil.process_iter(["cmdline", "environ"]) if _is_trainer(p, prefix)]


def _is_trainer(proc, prefix: Path) -> bool:
    try:
        cmd, env = proc.info["cmdline"] or [], proc.info["environ"] or {}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    module = (
        cmd[cmd.index("-m") + 1] if "-m" in cmd[:-1] else None
    )  # torchrun runs `python -u -m grpo_pipeline.trainer`
    return module == "grpo_pipeline.trainer" and env.get("HEALTH_TEST_CALLS") == str(prefix)


def test_sigkill_to_the_launchers_group_ends_both_ranks_before_another_step(
    tmp_path, tiny_model, tiny_splits, tiny_config
):
    spec = _spec(
        tmp_path,
        tiny_model,
        tiny_splits,
        tiny_config,
        "train.grpo.per_device_train_batch_size=2",
        "train.distributed.processes_per_node=2",
    )
    prefix = tmp_path / "calls"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grpo_pipeline.trainer.launch",
            "--spec",
            str(spec.write(tmp_path / "job.json")),
            "--master-port",
            str(free_port()),
        ],
        cwd=ROOT,
        env={**os.environ, "HEALTH_TEST_CALLS": str(prefix)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _until(lambda: len(_calls(prefix)) == 2 or launcher.poll() is not None, "both ranks scoring completions")
    try:
        assert launcher.poll() is None
        ranks = _trainers_of(prefix)
        assert len(ranks) == 2, ranks
    except BaseException:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise

    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and torchrun; the ranks are in sessions of their own
    launcher.wait()
    _until(lambda: all(map(_gone, ranks)), "both ranks gone", limit_s=30)
    after = _calls(prefix)
    time.sleep(2)
    assert _calls(prefix) == after  # nothing scored anything since


def test_sigkill_to_the_flows_process_ends_its_local_trainer(tmp_path, tiny_model, tiny_splits, tiny_config):
    spec = _spec(tmp_path, tiny_model, tiny_splits, tiny_config)
    prefix = tmp_path / "calls"
    flow = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        from pathlib import Path
        from grpo_pipeline.infra.launch.local import LocalLauncher
        from grpo_pipeline.trainer.spec import JobSpec
        launcher = LocalLauncher(max_restarts=0, on_line=lambda line: None)
        launcher.wait(launcher.launch(JobSpec.read(Path({str(spec.write(tmp_path / "job.json"))!r}))))
        """),
        ],
        cwd=ROOT,
        env={**os.environ, "HEALTH_TEST_CALLS": str(prefix)},
    )
    _until(lambda: _calls(prefix) or flow.poll() is not None, "the trainer scoring completions")
    assert flow.poll() is None
    (trainer,) = _trainers_of(prefix)

    flow.kill()
    flow.wait()
    # SIGTERM from its death signal: it finishes the step it is in, checkpoints, and exits
    _until(lambda: _gone(trainer), "the trainer gone", limit_s=120)
    assert len(list((tmp_path / "ckpt").glob("checkpoint-*/manifest.json"))) == 1
