"""Several training processes for real, on the CPU (torchrun, gloo): two ranks through the pipeline, two
"nodes" on loopback started by the SkyPilot task's own run command, a rank SIGKILLed, a SIGTERM, and the
same global batch at one and two processes. Tiny random model, a few steps; nothing here depends on timing."""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest
import yaml

from grpo_pipeline.infra.launch.local import LocalLauncher
from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.checkpoints import FINAL, LocalStore, S3Store
from grpo_pipeline.trainer.launch import free_port
from grpo_pipeline.trainer.spec import JobSpec, TrainResult

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # a hang fails the test, never the suite
ROOT = Path(__file__).resolve().parents[2]
PID = re.compile(r"rank (\d+)/\d+ \(local \d+\) pid (\d+)")
MARKER_ENV = "DIST_TEST_MARKER"


def slow_reward(completions, **_):
    """0.3 s per call, so that a kill lands mid-run on any machine; touches a marker once training runs."""
    if os.environ.get(MARKER_ENV):
        Path(os.environ[MARKER_ENV]).touch()
    time.sleep(0.3)
    return [0.0] * len(completions)


def prompt_reward(completions, prompts, trainer_state, **_):
    """A reward of the prompt alone, and a record of which prompts each rank scored at each step."""
    with open(os.environ[MARKER_ENV] + f".rank{os.environ.get('RANK', '0')}", "a") as f:
        for p in prompts:
            f.write(json.dumps([trainer_state.global_step, str(p)]) + "\n")
    return [(sum(map(ord, str(p))) % 7) / 7 for p in prompts]


def _spec(tmp_path, tiny_model, tiny_splits, tiny_config, *overrides, checkpoint_uri=None, **extra) -> JobSpec:
    cfg = tiny_config(*overrides)
    return JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=checkpoint_uri or str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
        **extra,
    )


def _node_launcher(spec_path: Path, *args: str, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grpo_pipeline.trainer.launch",
            "--spec",
            str(spec_path),
            "--master-port",
            str(free_port()),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


class Output(threading.Thread):
    """Reads a process's output as it comes, noting each rank's pid."""

    def __init__(self, proc):
        super().__init__(daemon=True)
        self.proc, self.lines, self.pids = proc, [], {}
        self.start()

    def run(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := PID.search(line):
                self.pids[int(m.group(1))] = int(m.group(2))

    def text(self) -> str:
        self.join(timeout=60)
        return "".join(self.lines)


def _wait(condition, what: str, limit_s: float = 600, out: "Output | None" = None):
    """Until `condition()`; a process that ends first, or a wait past `limit_s` (a hang), fails with its output."""
    deadline = time.monotonic() + limit_s
    while not condition():
        ended = out is not None and out.proc.poll() is not None
        assert not ended and time.monotonic() < deadline, (
            f"{what}: not after {limit_s:.0f} s" if not ended else f"{what}: the job ended first"
        ) + ("\n" + "".join(out.lines[-60:]) if out else "")
        time.sleep(0.05)


@pytest.mark.slow
def test_two_processes_through_the_pipeline(tmp_path, tiny_model):
    cfg = {
        "data_dir": str(tmp_path / "data"),
        "data": {"demo": {"max_operand": 9, "n_train": 32, "n_val": 4, "n_holdout": 6}},
        "model": {"base": str(tiny_model)},
        "train": {
            "checkpoint_every": 2,
            "keep_checkpoints": 5,
            "distributed": {"processes_per_node": 2},
            "grpo": {
                "max_steps": 4,
                "num_generations": 4,
                "per_device_train_batch_size": 2,
                "max_completion_length": 6,
                "logging_steps": 1,
            },
            "lora": {"r": 4, "target_modules": "all-linear"},
        },
        "evaluate": {"max_new_tokens": 6, "batch_size": 4},
        "check": {"enabled": False},  # a random model's task is too_hard; this test is about the processes
    }
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "run", "--config", str(tmp_path / "tiny.yaml"), "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["train"]["world_size"] == 2 and summary["train"]["global_step"] == 4
    store = LocalStore(Path(summary["run_dir"]) / "checkpoints")
    assert store.complete_steps() == [2, 4]  # one checkpoint per interval, each with both ranks' RNG state
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (store.root / "checkpoint-4").iterdir()}
    client = mlflow.MlflowClient(summary["mlflow"]["tracking_uri"])
    history = client.get_metric_history(summary["train"]["mlflow_run_id"], "reward")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]  # each step once, from rank 0 alone


@pytest.mark.slow  # two nodes' ranks; one and two processes stay in the default run: make test-slow (the default run's 12-minute budget)
def test_two_nodes_on_loopback_started_by_the_sky_run_command(
    tmp_path, s3_endpoint, tiny_model, tiny_splits, tiny_config
):
    spec = _spec(
        tmp_path,
        tiny_model,
        tiny_splits,
        tiny_config,
        "train.grpo.max_steps=3",
        "train.checkpoint_every=2",
        f"train.s3_endpoint_url={s3_endpoint}",
        checkpoint_uri="s3://ckpt/two-nodes",
    )
    spec = spec.model_copy(
        update={
            "train": spec.train.model_copy(
                update={"distributed": spec.train.distributed.model_copy(update={"nodes": 2})}
            )
        }
    )
    spec_path = spec.write(tmp_path / "job.json")
    # The task's run command as written, with a stand-in for the node's venv and this job's spec path for the
    # mount point; the variables as SkyPilot sets them on each node (IPs one per line, head first).
    run = yaml.safe_load((ROOT / "sky" / "train.yaml").read_text())["run"].replace("/grpo/job/job.json", str(spec_path))
    venv = tmp_path / "home" / "grpo-venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "python").chmod(0o755)
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            ["bash", "-c", run],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "HOME": str(tmp_path / "home"),
                "MASTER_PORT": port,
                "SKYPILOT_NUM_NODES": "2",
                "SKYPILOT_NODE_RANK": str(rank),
                "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n",
                "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            },
        )
        for rank in (0, 1)
    ]
    outputs = [Output(n) for n in nodes]
    codes = [n.wait(timeout=800) for n in nodes]
    assert codes == [0, 0], [o.text()[-3000:] for o in outputs]
    store = S3Store(spec.checkpoint_uri, endpoint_url=s3_endpoint)
    assert store.complete_steps() == [2, 3] and store.has(FINAL)
    names = {key.rsplit("/", 1)[-1] for key in store._keys(store._key("checkpoint-2") + "/")}
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= names  # node 1's RNG state reached node 0's upload
    result = TrainResult.model_validate_json(outputs[0].text().strip().splitlines()[-1])
    assert (result.world_size, result.global_step) == (2, 3)


@pytest.mark.slow
def test_sigkill_of_one_rank_ends_the_job_and_the_relaunch_resumes(tmp_path, tiny_model, tiny_splits, tiny_config):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("dist")).info.run_id
    spec = _spec(
        tmp_path,
        tiny_model,
        tiny_splits,
        tiny_config,
        "train.grpo.max_steps=12",
        "train.checkpoint_every=3",
        "train.keep_checkpoints=5",
        "train.grpo.per_device_train_batch_size=2",
        "train.max_restarts=2",
        "train.distributed.processes_per_node=2",
        "train.distributed.timeout_s=60",
        f"train.rewards=[correct_answer, {__name__}:slow_reward]",
        mlflow_tracking_uri=uri,
        mlflow_run_id=run_id,
    )
    store = LocalStore(spec.checkpoint_uri)
    pids: dict[int, int] = {}

    def note(line: str) -> None:
        if m := PID.search(line):
            pids[int(m.group(1))] = int(m.group(2))

    launcher = LocalLauncher(max_restarts=2, on_line=note)
    handle = launcher.launch(spec)
    first = handle.process
    killed: dict = {}

    def chaos():
        _wait(lambda: store.complete_steps() and 1 in pids, "a first checkpoint")
        killed["step"] = store.complete_steps()[-1]
        os.kill(pids[1], signal.SIGKILL)  # rank 1 alone, with no chance to clean up
        killed["at"] = time.monotonic()
        first.wait()  # the whole job ends: rank 0 is stopped, not left waiting on a dead peer
        killed["ended_s"] = time.monotonic() - killed["at"]
        killed["code"] = first.returncode

    thread = threading.Thread(target=chaos)
    thread.start()
    result = launcher.wait(handle)
    thread.join()

    assert killed["code"] not in (0, 75), killed
    # no hang: the collective timeout (60 s), torchrun's grace before SIGKILL (30 s), and slack for a loaded machine
    assert killed["ended_s"] < 60 + 30 + 240, killed
    assert result.restarts == 1 and result.global_step == 12 and result.world_size == 2
    assert killed["step"] <= result.resumed_from_step < 12  # the relaunch resumed from a complete checkpoint
    history = client.get_metric_history(run_id, "reward")
    assert sorted(m.step for m in history) == list(range(1, 13))  # each step exactly once across the kill


@pytest.mark.slow
def test_sigterm_to_one_rank_then_to_the_job_checkpoints_exits_75_everywhere_and_resumes(
    tmp_path, tiny_model, tiny_splits, tiny_config
):
    marker = tmp_path / "training"
    spec = _spec(
        tmp_path,
        tiny_model,
        tiny_splits,
        tiny_config,
        "train.grpo.max_steps=400",
        "train.checkpoint_every=1000",
        "train.keep_checkpoints=3",
        "train.grpo.per_device_train_batch_size=2",
        "train.distributed.processes_per_node=2",
        f"train.rewards=[{__name__}:slow_reward]",
    )
    spec_path = spec.write(tmp_path / "job.json")
    store = LocalStore(spec.checkpoint_uri)
    env = {MARKER_ENV: str(marker)}
    steps = []
    for target in ("rank 1", "the node launcher"):
        marker.unlink(missing_ok=True)
        proc = _node_launcher(spec_path, env=env)
        out = Output(proc)
        _wait(lambda out=out: marker.exists() and len(out.pids) == 2, "both ranks training", out=out)
        os.kill(out.pids[1] if target == "rank 1" else proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=600) == 75, out.text()[-3000:]
        assert "ranks exited {'rank-0': 75, 'rank-1': 75} -> 75" in out.text(), target
        steps.append(store.complete_steps()[-1])
    assert len(store.complete_steps()) == 2 and 0 < steps[0] < steps[1] < 400  # one checkpoint per SIGTERM

    # and the job resumes from the second one, on both ranks, to the end
    short = spec.model_copy(
        update={"train": spec.train.model_copy(update={"grpo": {**spec.train.grpo, "max_steps": steps[1] + 2}})}
    )
    proc = _node_launcher(short.write(tmp_path / "short.json"))
    out = Output(proc)
    assert proc.wait(timeout=600) == 0, out.text()[-3000:]
    result = TrainResult.model_validate_json(out.text().strip().splitlines()[-1])
    assert (result.resumed_from_step, result.global_step) == (steps[1], steps[1] + 2)


@pytest.mark.slow  # make test-slow: two trainings of 4 steps (60 s on 2 cores)
def test_one_and_two_processes_train_on_the_same_global_batch(tmp_path, tiny_model, tiny_splits, tiny_config):
    """Same seed, same global batch (8 completions of 2 prompts per step): one process of 8, or two of 4.

    What must agree, and does exactly: the prompts of each step (TRL's sampler orders them by the seed alone and
    the ranks split each batch), so a reward of the prompt alone logs the same mean at every step. What differs,
    by design: the completions, hence the loss, because each rank samples from its own generator state, and a
    group's completions come from one rank in the two-process run but from one long batch in the one-process run.
    """
    runs = {}
    for procs, pdb in ((1, 8), (2, 4)):
        marker = tmp_path / f"p{procs}"
        spec = _spec(
            tmp_path / f"p{procs}",
            tiny_model,
            tiny_splits,
            tiny_config,
            "train.grpo.max_steps=3",
            "train.checkpoint_every=100",
            f"train.grpo.per_device_train_batch_size={pdb}",
            f"train.distributed.processes_per_node={procs}",
            f"train.rewards=[{__name__}:prompt_reward]",
        )
        proc = _node_launcher(spec.write(tmp_path / f"p{procs}.json"), env={MARKER_ENV: str(marker)})
        out = Output(proc)
        assert proc.wait(timeout=600) == 0, out.text()[-3000:]
        seen: dict[int, list[str]] = {}
        for rank_file in tmp_path.glob(f"p{procs}.rank*"):
            for line in rank_file.read_text().splitlines():
                step, prompt = json.loads(line)
                seen.setdefault(step, []).append(prompt)
        logs = [ast.literal_eval(line) for line in out.text().splitlines() if line.startswith("{'loss'")]  # HF's
        runs[procs] = ({s: sorted(p) for s, p in seen.items()}, [log["reward"] for log in logs])
    assert runs[1][0] == runs[2][0]  # the same prompts, step by step (GRPO's steps 0..2 as TRL counts them)
    assert len(runs[1][1]) == len(runs[2][1]) == 3
    assert runs[1][1] == pytest.approx(runs[2][1], abs=1e-6)
