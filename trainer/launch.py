"""`python -m grpo_pipeline.trainer.launch --spec job.json [--nnodes N --node-rank R --master-addr IP]`: run one job's
training processes on this node, as `train.distributed` says, and exit with the trainer's codes.

One DDP process on one node (the default on a CPU machine, or `processes_per_node: 1`) is `python -m
trainer --spec job.json` itself, exec'd. Otherwise torchrun (`python -m torch.distributed.run`) starts
`processes_per_node` copies of it, on every node of the job (static rendezvous at rank 0's address; SkyPilot's
run command passes SKYPILOT_NODE_RANK, the first of SKYPILOT_NODE_IPS and SKYPILOT_NUM_NODES).

Why torchrun rather than `accelerate launch`: on a machine without GPUs `accelerate launch` starts its processes
unconnected (each one a world of one) unless MPI is installed, so neither the CPU tests nor a CPU node could
run several ranks, while torchrun's processes form a gloo group there and an NCCL group on GPUs. What
accelerate adds for FSDP and DeepSpeed is its config file, and that we keep: `configs/accelerate/<strategy>.yaml`
(TRL's recipes, in accelerate's format) is read by accelerate's own parser and turned into the environment
that `accelerate launch` would give its processes (`strategy_env`), which the trainer's accelerate reads.

Exit codes: 0 done; 75 every rank on this node checkpointed after a SIGTERM (relaunch to resume); 2 bad spec
or a launch that cannot work (`grpo_pipeline.trainer.distributed.problems`, before anything starts); 1 anything else, such
as a rank that died (torchrun then stops the others; collectives time out after train.distributed.timeout_s).

SIGTERM to this launcher goes to the training processes directly: torchrun would pass it on too, but kill
them 30 s later, and a GRPO step with its checkpoint can take longer than that.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from grpo_pipeline.trainer.distributed import LAUNCH_DIR_ENV, VLLM_HOST_ENV, problems
from grpo_pipeline.trainer.spec import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_SUPERSEDED, RESULT_FILE, JobSpec

log = logging.getLogger("grpo_pipeline.trainer.launch")
DEFAULT_PORT = 29500
VLLM_PORT = 8000
LOOPBACK = "127.0.0.1"  # the vLLM server's address when its trainers share its node
# shipped beside this package (package data of configs/): accelerate config files, one per strategy
ACCELERATE_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m grpo_pipeline.trainer.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--spec", required=True, help="path to a JobSpec JSON file")
    p.add_argument("--nnodes", type=int, help="nodes of the job; must match train.distributed.nodes")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's node (the first of SKYPILOT_NODE_IPS)")
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", DEFAULT_PORT)))
    p.add_argument("--gpus-per-node", type=int, help="default: the GPUs this node has (torch.cuda.device_count)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and environment; start nothing")
    return p.parse_args(argv)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def accelerate_config(spec: JobSpec) -> dict:
    """configs/accelerate/<strategy>.yaml with train.distributed.accelerate's keys merged over it."""
    d = spec.train.distributed
    base = yaml.safe_load((ACCELERATE_CONFIGS / f"{d.strategy}.yaml").read_text())
    return _deep_merge(base, d.accelerate)


def strategy_env(spec: JobSpec, nproc: int, nnodes: int) -> dict[str, str]:
    """What `accelerate launch --config_file <the strategy's file>` exports to its processes for FSDP or
    DeepSpeed, computed by accelerate itself: its config-file parser (`ClusterConfig`, which refuses unknown
    keys) and its launch helpers. DDP needs nothing beyond torchrun's own variables. Mixed precision is left to
    the trainer (train.grpo.bf16), which sets accelerate's variable itself."""
    if spec.train.distributed.strategy == "ddp":
        return {}
    # accelerate imports torch (seconds): only an FSDP or DeepSpeed launch, and its check before one, pays for it
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(accelerate_config(spec), f)
    parser = launch_command_parser()
    known = {action.dest for action in parser._actions}
    try:
        args = parser.parse_args(
            [
                "--config_file",
                f.name,
                "--num_processes",
                str(nproc * nnodes),
                "--num_machines",
                str(nnodes),
                "-m",
                "grpo_pipeline.trainer",
            ]
        )
        args, defaults, mp_from_config = _validate_launch_command(args)
        # accelerate ignores unknown keys inside these sections; its launch options name the ones it reads
        for section in ("fsdp_config", "deepspeed_config"):
            if unknown := sorted(set(getattr(defaults, section, None) or {}) - known):
                raise ValueError(
                    f"train.distributed.accelerate: {section} has keys accelerate does not know: {unknown}"
                )
        if args.use_deepspeed:
            # as accelerate's launch_command does before its DeepSpeed launcher
            fields = list(defaults.deepspeed_config) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(
                fields + (["mixed_precision"] if mp_from_config else [])
            )
            _, env = prepare_deepspeed_cmd_env(args)
        else:
            env = prepare_multi_gpu_env(args)
    finally:
        os.unlink(f.name)
    keep = ("ACCELERATE_USE_", "FSDP_", "ACCELERATE_DEEPSPEED_", "ACCELERATE_CONFIG_DS_FIELDS")
    return {k: v for k, v in env.items() if k.startswith(keep) and os.environ.get(k) != v}


def detect_gpus() -> int:
    try:  # torch takes seconds to import: only a launch asks how many GPUs this machine has
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def torchrun_command(
    spec_path: str, nproc: int, nnodes: int, node_rank: int, addr: str, port: int, timeout_s: int
) -> list[str]:
    """The torchrun command line for this node.

    >>> " ".join(torchrun_command("/j.json", 8, 2, 1, "10.0.0.1", 29500, 600)[1:])
    '-m torch.distributed.run --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 --max-restarts 0 --rdzv-conf timeout=600 -m grpo_pipeline.trainer --spec /j.json'
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        addr,
        "--master-port",
        str(port),
        # a failed rank fails the job: SkyPilot (or the local launcher) relaunches all of it from a checkpoint
        "--max-restarts",
        "0",
        "--rdzv-conf",
        f"timeout={timeout_s}",
        "-m",
        "grpo_pipeline.trainer",
        "--spec",
        spec_path,
    ]


def vllm_command(spec: JobSpec, gpus: int, host: str) -> list[str]:
    """`trl vllm-serve` for vllm_mode=server, tensor-parallel over the GPUs it is given, listening on `host` only.

    The server has no authentication (anyone who reaches it can generate and push weights into it), so it
    listens on the one address its trainers use: 127.0.0.1 when they share its node, the node's own address
    (never 0.0.0.0) when it has a node of its own.

    >>> from grpo_pipeline.trainer.spec import JobSpec
    >>> " ".join(vllm_command(JobSpec.model_construct(model_path="m"), 2, "127.0.0.1")[3:])
    'vllm-serve --model m --tensor-parallel-size 2 --host 127.0.0.1 --port 8000'
    """
    return [
        sys.executable,
        "-m",
        "trl.cli.main",
        "vllm-serve",
        "--model",
        spec.model_path,
        "--tensor-parallel-size",
        str(gpus),
        "--host",
        host,
        "--port",
        str(VLLM_PORT),
    ]


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 now, the kernel's pick: for the rendezvous here, and (one
    definition for every layer, the trainer being the lowest that all may import) for the servers the pipeline
    starts. Another process may take it before the caller binds it: a start that fails on it fails loudly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """This node's part of the job: its processes, their pids (from the launch folder) and exit codes."""

    def __init__(self, folder: Path):
        self.folder, self.stopping = folder, False
        self.signalled: set[str] = set()
        self.proc: subprocess.Popen | None = None

    def pids(self) -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in self.folder.glob("rank-*.pid")}

    def exit_codes(self) -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in self.folder.glob("rank-*.exit")}

    def forward_sigterm(self, *_: object) -> None:  # a signal handler's (signum, frame)
        self.stopping = True
        for name, pid in self.pids().items():
            if name not in self.signalled:
                self.signalled.add(name)
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def wait(self) -> int:
        assert self.proc is not None, "started before it is waited on"
        while self.proc.poll() is None:
            if self.stopping:  # ranks that wrote their pid after the signal get it too
                self.forward_sigterm()
            time.sleep(0.2)
        return self.proc.returncode


def outcome(torchrun_code: int, codes: dict[str, int], nproc: int) -> int:
    """This node's exit code from torchrun's and its ranks'.

    >>> outcome(1, {"rank-0": 75, "rank-1": 75}, 2), outcome(1, {"rank-0": 75}, 2), outcome(1, {"rank-1": 2}, 2)
    (75, 1, 2)
    >>> outcome(1, {"rank-0": 3, "rank-1": -15}, 2)
    3
    """
    if torchrun_code == 0:
        return 0
    if len(codes) == nproc and all(c == EXIT_INTERRUPTED for c in codes.values()):
        return EXIT_INTERRUPTED
    if EXIT_BAD_INPUT in codes.values():
        return EXIT_BAD_INPUT
    if EXIT_SUPERSEDED in codes.values():  # rank 0 found a newer attempt's claim; the other ranks were torn down
        return EXIT_SUPERSEDED
    return 1


def _wait_for_vllm(proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{VLLM_PORT}/health/", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"trl vllm-serve did not answer on port {VLLM_PORT} within {timeout_s:.0f} s")


def _serve_until_trainers_leave(spec: JobSpec, gpus: int, addr: str, port: int, env: dict) -> int:
    """The dedicated vLLM node (vllm_server_node): serve until rank 0's rendezvous port has been gone a minute."""
    server = subprocess.Popen(vllm_command(spec, gpus, env[VLLM_HOST_ENV]), env=env)
    seen, gone_since = False, None
    while server.poll() is None:
        try:
            socket.create_connection((addr, port), timeout=5).close()
            seen, gone_since = True, None
        except OSError:
            gone_since = gone_since or time.monotonic()
            if seen and time.monotonic() - gone_since > 60:
                server.terminate()
                server.wait(60)
                return 0
        time.sleep(10)
    return server.returncode


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not launcher_lifeline():
        log.error("the process that started this launcher is gone; not training on alone")
        return 1
    opts = options(argv)
    try:
        spec = JobSpec.read(Path(opts.spec))
    except (OSError, ValueError) as exc:
        log.error("bad job spec %s: %s", opts.spec, exc)
        return EXIT_BAD_INPUT
    d = spec.train.distributed
    gpus = opts.gpus_per_node if opts.gpus_per_node is not None else detect_gpus()
    nnodes = opts.nnodes or d.nodes
    found = problems(spec, gpus)
    if nnodes != d.nodes + d.vllm_server_node:
        found.append(
            f"--nnodes {nnodes} (SKYPILOT_NUM_NODES) differs from the job's train.distributed.nodes "
            f"({d.nodes}{' + 1 vLLM node' if d.vllm_server_node else ''}): launch the task the job was built for"
        )
    if found:
        for problem in found:
            log.error("cannot launch: %s", problem)
        return EXIT_BAD_INPUT
    nproc = d.processes(gpus)
    env = dict(os.environ)
    try:
        strategy = strategy_env(spec, nproc, d.nodes)
    except ValueError as exc:  # accelerate's parser refused the strategy's config file
        log.error("cannot launch: %s", exc)
        return EXIT_BAD_INPUT
    server_gpus = list(range(gpus - d.vllm_server_gpus, gpus)) if d.vllm_server_gpus else []
    if server_gpus or d.vllm_server_node:
        # trainers on the first GPUs, the server on the rest (or on the last node), never the same GPU twice
        env[VLLM_HOST_ENV] = LOOPBACK if server_gpus else _node_ip(nnodes - 1)
    if d.vllm_server_node and opts.node_rank == nnodes - 1:
        if opts.dry_run:
            print(" ".join(vllm_command(spec, gpus, env[VLLM_HOST_ENV])))
            return 0
        return _serve_until_trainers_leave(spec, gpus, opts.master_addr, opts.master_port, env)
    train_nodes = d.nodes
    if train_nodes == 1 and nproc == 1 and not server_gpus and d.strategy == "ddp":
        command = [sys.executable, "-m", "grpo_pipeline.trainer", "--spec", opts.spec]
        if opts.dry_run:
            print(" ".join(command))
            return 0
        os.execv(sys.executable, command)  # the plain one-process trainer: its signals and exit code are ours
    env.update(strategy)
    if server_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(gpus - d.vllm_server_gpus))
    command = torchrun_command(
        opts.spec, nproc, train_nodes, opts.node_rank, opts.master_addr, opts.master_port, d.timeout_s
    )
    if opts.dry_run:
        if server_gpus:
            print(
                f"CUDA_VISIBLE_DEVICES={','.join(map(str, server_gpus))} "
                + " ".join(vllm_command(spec, len(server_gpus), LOOPBACK))
            )
        print(
            " ".join(f"{k}={v}" for k, v in sorted(env.items()) if k not in os.environ or os.environ[k] != v),
            " ".join(command),
        )
        return 0
    return _run_node(spec, command, env, nproc, server_gpus, opts.node_rank)


PARENT_PID_ENV = "GRPO_PARENT_PID"  # set by whoever starts this launcher and waits on it: its own pid
AGENT_PID_FILE = "agent.pid"  # in the launch folder: torchrun's pid, the parent each rank checks it still has
PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int, sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (PR_SET_PDEATHSIG), then check that
    the parent is still the one expected: one that died before the request was made sends nothing, and this
    process has been handed to init (or a subreaper) meanwhile. False: the parent is already gone (the caller
    exits); True otherwise, or where prctl does not exist (not Linux: a cancel's SIGTERM still reaches the
    processes through their parents). The signal comes when the parent *thread* ends, so the process that
    starts a child must wait for it on the same thread, as every launcher here does."""
    libc = _libc()
    if libc is None:
        return True
    libc.prctl(PR_SET_PDEATHSIG, sig)
    return os.getppid() == expected_parent


@functools.cache
def _libc():
    """libc through ctypes, loaded once: in the parent before a fork, so a child between fork and exec imports
    nothing (an import there can deadlock on a lock another thread held at the fork)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except (OSError, AttributeError):
        return None


def _die_with_parent(launcher_pid: int) -> None:
    """torchrun gets SIGTERM (and stops its ranks) if this launcher is killed outright (SIGKILL after a
    cancel's grace period). Run in torchrun's process between fork and exec."""
    if not die_with_parent(launcher_pid, signal.SIGTERM):
        os._exit(1)  # the launcher died before torchrun could start: nothing must run on its own


def rank_lifeline() -> bool:
    """For a rank under torchrun (`python -m grpo_pipeline.trainer`): SIGKILL when torchrun dies. Its ranks run in sessions
    of their own, so a SIGKILL to the launcher's process group (a cancel that escalates, the OOM killer) kills
    the launcher and torchrun and nothing else; without this the ranks trained on, unsupervised. SIGKILL, not
    SIGTERM: torchrun dead means no one collects an exit code or forwards a stop, and the relaunch must not
    meet this rank still writing. False: torchrun is gone already. True where there is no node launcher."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if not folder or "RANK" not in os.environ:
        return True
    agent = Path(folder) / AGENT_PID_FILE
    deadline = time.monotonic() + 30  # written right after torchrun starts, long before a rank imports anything
    while not agent.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not agent.is_file():
        log.warning("no %s in %s: this rank cannot check its parent", AGENT_PID_FILE, folder)
        return die_with_parent(os.getppid(), signal.SIGKILL)
    return die_with_parent(int(agent.read_text()), signal.SIGKILL)


def launcher_lifeline() -> bool:
    """For this launcher: SIGTERM when the process that started it dies (the flow's, the local launcher's),
    so the trainer checkpoints after its step and exits instead of training on alone (seen: more than 10
    minutes on both cores after the flow was SIGKILLed). The single-process trainer is this process exec'd,
    and keeps the request. False: that process is gone already."""
    parent = os.environ.pop(PARENT_PID_ENV, None)  # popped: torchrun and the ranks have other parents
    return die_with_parent(int(parent), signal.SIGTERM) if parent else True


def _node_ip(index: int) -> str:
    ips = os.environ.get("SKYPILOT_NODE_IPS", "").split()
    return ips[index] if len(ips) > index else "127.0.0.1"


def _run_node(spec: JobSpec, command: list[str], env: dict, nproc: int, server_gpus: list[int], node_rank: int) -> int:
    folder = Path(tempfile.mkdtemp(prefix="grpo-launch-"))  # node-local: this attempt's pids and exit codes
    env[LAUNCH_DIR_ENV] = str(folder)
    node = Node(folder)
    signal.signal(signal.SIGTERM, node.forward_sigterm)
    server = None
    if server_gpus:
        server = subprocess.Popen(
            vllm_command(spec, len(server_gpus), LOOPBACK),
            env={**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, server_gpus))},
        )
        _wait_for_vllm(server, spec.train.distributed.timeout_s)
    log.info("node %d: %s", node_rank, " ".join(command))
    try:
        launcher_pid, _ = os.getpid(), _libc()
        node.proc = subprocess.Popen(command, env=env, preexec_fn=lambda: _die_with_parent(launcher_pid))
        (folder / AGENT_PID_FILE).write_text(str(node.proc.pid))  # each rank checks it is still torchrun's child
        code = outcome(node.wait(), node.exit_codes(), nproc)
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    log.info("node %d: ranks exited %s -> %d", node_rank, dict(sorted(node.exit_codes().items())), code)
    result = Path(spec.work_dir) / RESULT_FILE
    if code == 0 and node_rank == 0 and result.is_file():
        print(result.read_text().replace("\n", ""), flush=True)  # last line of stdout: the result, as the trainer's
    return code


if __name__ == "__main__":
    sys.exit(main())
