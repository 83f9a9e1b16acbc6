"""Launch the trainer as a SkyPilot managed job on spot GPUs, follow it, collect its adapter from the store.

SkyPilot recovers a preempted job (relaunching it, another region first); the trainer resumes from its
newest complete checkpoint in S3. Turning a job spec into a task config is a pure function (`task_config`),
and SkyPilot's own parser reads it back (`build_task`), so tests inspect exactly what would be launched without
a cloud.

SkyPilot lives in an environment of its own (`.venv-sky`, pinned by sky/requirements.txt, built by `make install`):
it pins click<8.2, which the training stack's huggingface-hub outgrew. Every SkyPilot call runs there, through
`sky_driver.py` beside this file (one long-lived process answers JSON requests; importing SkyPilot takes seconds);
`GRPO_SKY_PYTHON` names another environment's python (an installed, non-editable copy has no .venv-sky beside it).

Several GPUs and nodes: `num_nodes` is train.distributed.nodes (plus one for a dedicated vLLM server node),
each accelerator option asks for processes_per_node (+ vllm_server_gpus) GPUs when that is set, and the
task's run command starts `python -m grpo_pipeline.trainer.launch` on every node with the rendezvous SkyPilot gives
(SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE). A recovery restarts
the whole cluster, and every node's ranks resume from the same checkpoint in S3.

A warm start (`model.init_adapter`): the adapter is uploaded to the run's checkpoint store as its `init-adapter`
entry (`publish_init_adapter`), and the node's job spec pins each of its files' sha256 (`node_spec`); the trainer
fetches the entry and refuses (exit 2) an adapter that differs in any file.
"""

from __future__ import annotations

import atexit
import codecs
import io
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo_pipeline.configs.files import SOURCE_ROOT, project_file
from grpo_pipeline.configs.launchers import gpu_option
from grpo_pipeline.configs.schema import SkyConfig, TrainConfig
from grpo_pipeline.infra.launch import BadTrainingInput, LauncherKind, LaunchRefused, TrainingFailed, check_launch
from grpo_pipeline.trainer.checkpoints import (
    FINAL,
    INIT_ADAPTER,
    CheckpointStoreError,
    Store,
    adapter_files,
    collect_final,
    open_store,
)
from grpo_pipeline.trainer.fence import ATTEMPT, managed_job_id, refusal, release
from grpo_pipeline.trainer.spec import JobSpec, TrainResult, parse_bad_input

log = logging.getLogger(__name__)
# The source checkout the packages run from (the tests read the shipped task YAMLs there); the launcher finds a
# task YAML through grpo_pipeline.configs.files.project_file, the working directory first, so an installed copy works too.
PROJECT_ROOT = SOURCE_ROOT
NODE_JOB_DIR = "/grpo/job"  # where sky/*.yaml mounts JOB_DIR
NODE_MODEL_DIR = "/grpo/model"
NODE_WORK_DIR = "/tmp/grpo-work"  # node-local scratch; everything that matters goes to the store
TERMINAL_OK = {"SUCCEEDED"}
TERMINAL_BAD = {"CANCELLED", "FAILED", "FAILED_SETUP", "FAILED_PRECHECKS", "FAILED_NO_RESOURCE", "FAILED_CONTROLLER"}


DRIVER = Path(__file__).with_name("sky_driver.py")
SKY_PYTHON_VARIABLE = "GRPO_SKY_PYTHON"


class SkyPreflightError(RuntimeError):
    pass


class SkyError(RuntimeError):
    """A SkyPilot call failed in its environment; the message is SkyPilot's."""


def sky_python(environ: Mapping[str, str] | None = None) -> Path:
    """The python of SkyPilot's environment: $GRPO_SKY_PYTHON, else the checkout's .venv-sky.

    >>> str(sky_python({"GRPO_SKY_PYTHON": "/usr/bin/env"}))
    '/usr/bin/env'
    """
    named = (os.environ if environ is None else environ).get(SKY_PYTHON_VARIABLE)
    python = Path(named) if named else SOURCE_ROOT / ".venv-sky" / "bin" / "python"
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise SkyPreflightError(
            f"SkyPilot's environment is missing: no python at {python}. Run `make install` in the project "
            f"checkout (it builds .venv-sky from sky/requirements.txt), or set {SKY_PYTHON_VARIABLE} to the python "
            "of an environment where `pip install -r sky/requirements.txt` ran"
        )
    return python


def _driver_command(command: str, python: Path | None = None) -> list[str]:
    # -I: isolated, so neither this folder (its skypilot.py) nor the caller's PYTHON* variables reach SkyPilot
    return [str(python or sky_python()), "-I", "-u", str(DRIVER), command]


class _Driver:
    """The driver serving in SkyPilot's environment, one per python, started on first use; its standard error
    (SkyPilot's progress: a launch's controller start and upload) is this process's."""

    def __init__(self, python: Path):
        self.process = subprocess.Popen(
            _driver_command("serve", python), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.lock = threading.Lock()  # the log thread and the state loop share it: one request at a time
        atexit.register(self.close)

    def call(self, command: str, request: dict) -> dict:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None  # both are pipes (Popen above)
        with self.lock:
            try:
                stdin.write(json.dumps({"command": command, "request": request}) + "\n")
                stdin.flush()
                line = stdout.readline()
            except (BrokenPipeError, ValueError):
                line = ""
        if not line:
            raise SkyError(
                f"SkyPilot {command}: the driver in SkyPilot's environment exited "
                f"(code {self.process.poll()}); its messages are above"
            )
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            self.process.stdin.close()  # end of requests: the driver returns
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


_drivers: dict[str, _Driver] = {}
_drivers_lock = threading.Lock()


def _drive(command: str, request: dict) -> dict:
    """One call in SkyPilot's environment: its JSON answer, or SkyError with SkyPilot's message."""
    python = sky_python()
    with _drivers_lock:
        driver = _drivers.get(str(python))
        if driver is None or driver.process.poll() is not None:  # first use, or it died: a fresh one
            driver = _drivers[str(python)] = _Driver(python)
    answer = driver.call(command, request)
    if "error" in answer:
        raise SkyError(f"SkyPilot {command}: {answer['error']}")
    return answer


@dataclass(frozen=True)
class ParsedResources:
    accelerators: dict[str, int]
    use_spot: bool
    job_recovery: dict[str, Any]


@dataclass(frozen=True)
class ParsedTask:
    """What SkyPilot's parser made of a task config: the `sky.Task` fields the launcher sets, read back."""

    name: str | None
    num_nodes: int
    run: str
    envs: dict[str, str]
    file_mounts: dict[str, str]
    secrets: dict[str, str]
    resources: list[ParsedResources]


def parse_task(config: dict, secrets: dict[str, str] | None = None) -> ParsedTask:
    """`config` through SkyPilot's own parser (`sky.Task.from_yaml_config`) in its environment; SkyError when
    SkyPilot rejects it."""
    parsed = _drive("task", {"config": config, "secrets": secrets or {}})
    return ParsedTask(**{**parsed, "resources": [ParsedResources(**r) for r in parsed["resources"]]})


@dataclass(frozen=True)
class JobRecord:
    """A managed job's state, as SkyPilot's queue reports it."""

    status: str
    recovery_count: int | None = None
    failure_reason: str | None = None
    accelerators: dict[str, float] | None = None
    job_duration: float | None = None


def node_spec(spec: JobSpec) -> JobSpec:
    """The same job with the paths it has on the GPU node.

    >>> from grpo_pipeline.configs.schema import ModelConfig, TrainConfig
    >>> from grpo_pipeline.tasks.job import build_job_spec
    >>> s = build_job_spec(TrainConfig(checkpoint_uri="s3://b"), ModelConfig(), "Qwen/Qwen2.5-7B-Instruct",
    ...                    {"train": "/x/train.jsonl", "val": "/x/val.jsonl"}, Path("/x/run"))
    >>> node_spec(s).train_file, node_spec(s).model_path
    ('/grpo/job/data/train.jsonl', 'Qwen/Qwen2.5-7B-Instruct')
    """
    local_model = Path(spec.model_path).is_dir()
    warm: dict[str, Any] = {}
    if spec.init_adapter and spec.init_adapter_files is None:
        # the node fetches it from the run's store and checks it against these hashes (`publish_init_adapter`)
        warm = {
            "init_adapter": f"{spec.checkpoint_uri.rstrip('/')}/{INIT_ADAPTER}",
            "init_adapter_files": adapter_files(Path(spec.init_adapter)),
        }
    return spec.model_copy(
        update={
            **warm,
            "model_path": NODE_MODEL_DIR if local_model else spec.model_path,
            "train_file": f"{NODE_JOB_DIR}/data/train.jsonl",
            "val_file": f"{NODE_JOB_DIR}/data/val.jsonl" if spec.val_file else None,
            "work_dir": NODE_WORK_DIR,
            "adapter_dir": f"{NODE_WORK_DIR}/adapter",
        }
    )


def publish_init_adapter(spec: JobSpec, store: Store | None = None) -> None:
    """A warm start's adapter into the run's checkpoint store (entry `init-adapter`), where the node's trainer
    fetches it: a spot node has no view of this machine's disk, and the store is what every recovery of the job
    reaches anyway. The node checks every file against the hashes its job spec pins (`node_spec`), so what it
    trains from is what the pipeline checked against the base and train.lora. Nothing without a warm start."""
    if not spec.init_adapter:
        return
    store = store or open_store(spec.checkpoint_uri, spec.train.s3_endpoint_url)
    store.put(Path(spec.init_adapter), INIT_ADAPTER, 0)


def write_job_dir(spec: JobSpec, job_dir: Path) -> Path:
    """The folder SkyPilot uploads to the node: the node's job.json and the data files."""
    shutil.rmtree(job_dir, ignore_errors=True)
    (job_dir / "data").mkdir(parents=True)
    shutil.copy2(spec.train_file, job_dir / "data" / "train.jsonl")
    if spec.val_file:
        shutil.copy2(spec.val_file, job_dir / "data" / "val.jsonl")
    node_spec(spec).write(job_dir / "job.json")
    return job_dir


def _options(resources: dict) -> list[str]:
    return [
        o["accelerators"]
        for o in resources.get("ordered") or resources.get("any_of") or []
        if isinstance(o, dict) and "accelerators" in o
    ] or ([resources["accelerators"]] if "accelerators" in resources else [])


def _task_yaml(task_yaml: str) -> dict:
    return yaml.safe_load(project_file(task_yaml).read_text())


def project_root(task_yaml: str) -> Path:
    """The folder a relative task YAML path was found in (`grpo_pipeline.configs.files.project_file`: the working directory,
    else the source checkout): SkyPilot syncs it as the workdir, and the node installs the project from it
    (`pip install -e .`), so it is the project whose YAML is launched. An absolute YAML path: the working
    directory, as SkyPilot's own `workdir: .` would read it.

    >>> project_root("sky/train.yaml") / "sky" / "train.yaml" == project_file("sky/train.yaml").resolve()
    True
    """
    path = Path(task_yaml)
    if path.is_absolute():
        return Path.cwd()
    return project_file(path).resolve().parents[len(path.parts) - 1]


def accelerator_options(train: TrainConfig) -> list[tuple[str, int]]:
    """The GPU options a node of the managed job asks for, in order, with the GPU count that
    train.distributed needs (processes_per_node + vllm_server_gpus) where it sets one."""
    d = train.distributed
    listed = train.sky.accelerators or _options(_task_yaml(train.sky.task_yaml)["resources"])
    need = d.processes_per_node + d.vllm_server_gpus if d.processes_per_node else None
    return [(name, max(count, need or count)) for name, count in map(gpu_option, listed)]


def task_config(base: dict[str, Any], spec: JobSpec, job_dir: Path, sky_cfg: SkyConfig, max_restarts: int) -> dict:
    """The task YAML with this job filled in: job folder, local model mount, GPU candidates (as many per
    node as train.distributed needs), nodes, spot, recovery."""
    config = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    config.setdefault("envs", {})["JOB_DIR"] = str(job_dir.resolve())
    config["workdir"] = str(project_root(sky_cfg.task_yaml))
    if Path(spec.model_path).is_dir():
        config.setdefault("file_mounts", {})[NODE_MODEL_DIR] = str(Path(spec.model_path).resolve())
    resources = config.setdefault("resources", {})
    d = spec.train.distributed
    need = d.processes_per_node + d.vllm_server_gpus if d.processes_per_node else None
    options = sky_cfg.accelerators or _options(resources)
    if options:
        for key in ("any_of", "accelerators"):
            resources.pop(key, None)
        resources["ordered"] = [
            {"accelerators": f"{name}:{max(count, need or count)}"} for name, count in map(gpu_option, options)
        ]
    config["num_nodes"] = d.nodes + d.vllm_server_node
    resources["use_spot"] = sky_cfg.use_spot
    recovery = resources.setdefault("job_recovery", {})
    recovery["max_restarts_on_errors"] = max_restarts
    return config


def task_request(spec: JobSpec, job_dir: Path, sky_cfg: SkyConfig, max_restarts: int, environ: dict[str, str]) -> dict:
    """The task config with this job filled in, and the secrets it declares that `environ` has."""
    config = task_config(_task_yaml(sky_cfg.task_yaml), spec, job_dir, sky_cfg, max_restarts)
    secrets = {k: environ[k] for k in (config.get("secrets") or {}) if environ.get(k)}
    return {"config": config, "secrets": secrets}


def build_task(
    spec: JobSpec, job_dir: Path, sky_cfg: SkyConfig, max_restarts: int, environ: dict[str, str]
) -> ParsedTask:
    """The task as SkyPilot's own parser reads it; declared secrets come from `environ`."""
    request = task_request(spec, job_dir, sky_cfg, max_restarts, environ)
    return parse_task(request["config"], request["secrets"])


def claim_checkpoints(
    uri: str,
    endpoint_url: str | None,
    status_of: Callable[[int], str | None],
    on_status: Callable[[str], None] = log.info,
) -> None:
    """Before launching: the checkpoint URI must not belong to another managed job still running (two jobs on
    one URI supersede each other at every recovery: grpo_pipeline.trainer.fence). A store whose owner SkyPilot
    reports ended (cancelled, failed, out of recoveries) is released for this job; one whose owner runs, or
    whose owner SkyPilot does not know, refuses the launch (exit 2) naming both. `status_of`: a managed job's
    status in SkyPilot's queue, None when unknown."""
    store = open_store(uri, endpoint_url)
    body, _ = store.read_record(ATTEMPT)
    try:
        record = json.loads(body) if body else None
    except ValueError:
        return  # unreadable: the trainer claims over it
    owner = record.get("job") if isinstance(record, dict) else None
    if not isinstance(owner, str):
        return  # no job recorded (a local attempt, or one from before jobs were recorded): the epoch fence decides
    reason = refusal(record, "the managed job to be launched", finished=store.has(FINAL), where=uri)
    if reason is None:
        return
    job_id = managed_job_id(owner)
    status = status_of(job_id) if job_id is not None else None
    if status in TERMINAL_OK | TERMINAL_BAD:
        if release(store, owner, f"managed job {job_id} ended {status}; released by a new launch"):
            on_status(f"{uri}: released from managed job {job_id}, which ended {status}")
            return
        raise LaunchRefused(f"{uri}: another attempt claimed it while it was being released: {reason}")
    seen = f"SkyPilot reports managed job {job_id} {status}" if status else "SkyPilot's queue does not know that job"
    raise LaunchRefused(f"{reason} ({seen})")


def check_sky(train: TrainConfig, mlflow_uri: str) -> None:
    """Everything a managed job needs, checked before anything is launched, each failure naming its fix."""
    uri = train.checkpoint_uri or ""
    if not uri.startswith("s3://"):
        raise SkyPreflightError(
            "train.launcher=sky needs checkpoints a spot node can reach: set train.checkpoint_uri=s3://bucket/prefix"
        )
    if not mlflow_uri.startswith(("http://", "https://", "databricks")):
        raise SkyPreflightError(
            f"train.launcher=sky needs an MLflow server the node can reach, not {mlflow_uri}: "
            "set tracking.mlflow_tracking_uri=http(s)://..."
        )
    try:
        open_store(uri, train.s3_endpoint_url).check()
    except CheckpointStoreError as exc:
        raise SkyPreflightError(str(exc)) from None
    sky_python()  # its environment first: the fix for a missing one is not `sky check`
    # refreshes credentials; starts a local API server if none
    if not _drive("check", {})["enabled_clouds"]:
        raise SkyPreflightError(
            "SkyPilot has no cloud enabled: run `sky check` and follow its hints (cloud credentials, "
            "or a Kubernetes context), or use train.launcher=local"
        )


@dataclass
class SkyHandle:
    spec: JobSpec
    job_id: int
    bad_input: str | None = None  # the trainer's exit-2 reason, once its log line streams in
    log_process: subprocess.Popen | None = field(default=None, repr=False)  # the driver following the job's log


class _Lines(io.TextIOBase):
    """A text stream that hands each complete line to a callback (for SkyPilot's log streaming)."""

    def __init__(self, on_line):
        self.on_line, self.buffer = on_line, ""

    def write(self, text: str) -> int:
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            self.on_line(line.rstrip("\r"))
        return len(text)


class SkyLauncher:
    def __init__(
        self,
        sky_cfg: SkyConfig,
        max_restarts: int,
        on_status: Callable[[str], None] | None = None,
        on_line: Callable[[str], None] | None = None,
    ):
        self.sky_cfg, self.max_restarts = sky_cfg, max_restarts
        self.on_status = on_status or (lambda msg: log.info(msg))
        self.on_line = on_line or (lambda line: log.debug("trainer: %s", line))

    def launch(self, spec: JobSpec) -> SkyHandle:

        base = _task_yaml(self.sky_cfg.task_yaml)
        options = task_config(base, spec, Path(spec.work_dir), self.sky_cfg, self.max_restarts)["resources"]["ordered"]
        check_launch(
            spec, sorted({gpu_option(o["accelerators"])[1] for o in options})
        )  # before the job folder is written

        # before a cluster is paid for
        claim_checkpoints(spec.checkpoint_uri, spec.train.s3_endpoint_url, self._status_or_none, self.on_status)
        job_dir = write_job_dir(spec, Path(spec.work_dir) / "sky-job")
        publish_init_adapter(spec)  # before the job exists: its first rank fetches it
        request = task_request(spec, job_dir, self.sky_cfg, self.max_restarts, dict(os.environ))
        # SkyPilot's launch progress (controller start, upload) goes to this process's standard error
        job_id = _drive("launch", {**request, "name": f"grpo-{Path(spec.work_dir).parent.name}"})["job_id"]
        self.on_status(f"managed job {job_id} submitted")
        return SkyHandle(spec, job_id)

    def _record(self, job_id: int) -> JobRecord:
        return JobRecord(**_drive("queue", {"job_id": job_id}))

    def _status_or_none(self, job_id: int) -> str | None:
        try:
            return self._record(job_id).status
        except SkyError:  # not in this API server's queue (or it did not answer): unknown, never "ended"
            return None

    def watch(self, handle: SkyHandle) -> Callable[[str], None]:
        """The callback for each streamed line: passes it on, and keeps the trainer's bad-input reason."""

        def on_line(line: str) -> None:
            if handle.bad_input is None:
                handle.bad_input = parse_bad_input(line)
            self.on_line(line)

        return on_line

    def _stream_logs(self, handle: SkyHandle) -> None:
        try:  # follows the job across recoveries until it ends
            handle.log_process = subprocess.Popen(
                _driver_command("logs"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            process = handle.log_process
            assert process.stdin is not None and process.stdout is not None and process.stderr is not None  # pipes
            process.stdin.write(json.dumps({"job_id": handle.job_id, "follow": True}).encode())
            process.stdin.close()
            lines, text = _Lines(self.watch(handle)), codecs.getincrementaldecoder("utf-8")(errors="replace")
            while chunk := process.stdout.read1(65536):  # type: ignore[attr-defined]  # a BufferedReader: bufsize=-1
                lines.write(text.decode(chunk))
            if process.wait():
                raise SkyError(process.stderr.read().decode(errors="replace").strip()[-2000:])
        except Exception as exc:  # the state loop below still decides the outcome
            log.warning("log streaming of managed job %d stopped: %s", handle.job_id, exc)

    def wait(self, handle: SkyHandle) -> TrainResult:
        threading.Thread(target=self._stream_logs, args=(handle,), daemon=True).start()
        try:
            return self._follow(handle)
        finally:
            if handle.log_process is not None and handle.log_process.poll() is None:
                handle.log_process.terminate()  # the job ended or was given up on: its log has nothing more

    def _follow(self, handle: SkyHandle) -> TrainResult:
        last = None
        while True:
            record = self._record(handle.job_id)
            status = str(record.status)
            if status != last:
                self.on_status(f"managed job {handle.job_id}: {status} (recoveries: {record.recovery_count})")
                last = status
            if status in TERMINAL_OK | TERMINAL_BAD:
                break
            if handle.bad_input:
                # SkyPilot recovers any failed job (max_restarts_on_errors) and has no "never on this exit
                # code"; bad input would fail every recovery the same way, each on a fresh cluster.
                self.cancel(handle)
                raise BadTrainingInput(
                    f"managed job {handle.job_id}: bad input, cancelled instead of recovered: {handle.bad_input}"
                )
            time.sleep(self.sky_cfg.poll_seconds)
        if status in TERMINAL_BAD:
            # The job may end (out of recoveries, or before the next poll) with the trainer's reason already
            # seen: it is still bad input (exit 2), not a failure a rerun could fix.
            failed = BadTrainingInput if handle.bad_input else TrainingFailed
            raise failed(
                (f"{handle.bad_input}\n" if handle.bad_input else "")
                + f"managed job {handle.job_id} ended {status}: {record.failure_reason or ''}\n{self._tail(handle)}"
            )
        d = handle.spec.train.distributed
        gpus = (sum(int(a) for a in (record.accelerators or {}).values()) or 1) * (d.nodes + d.vllm_server_node)
        result, _ = collect_final(handle.spec)
        return result.model_copy(
            update={"restarts": record.recovery_count or 0, "gpu_hours": (record.job_duration or 0) / 3600 * gpus}
        )

    def _tail(self, handle: SkyHandle, lines: int = 40) -> str:
        try:
            done = subprocess.run(
                _driver_command("logs"),
                input=json.dumps({"job_id": handle.job_id, "tail": lines}),
                text=True,
                errors="replace",
                capture_output=True,
                check=False,
            )
        except (OSError, SkyPreflightError) as exc:  # the logs are a courtesy; the failure reason is in the message
            return f"(logs unavailable: {exc})"
        return done.stdout if done.returncode == 0 else f"(logs unavailable: {done.stderr.strip()[-500:]})"

    def cancel(self, handle: SkyHandle) -> None:
        _drive("cancel", {"job_id": handle.job_id})
        self.on_status(f"managed job {handle.job_id} cancelled")


KIND = LauncherKind(
    build=lambda train, on_line, on_status: SkyLauncher(
        train.sky, train.max_restarts, on_status=on_status, on_line=on_line
    ),
    gpus_per_node=lambda train: sorted({count for _, count in accelerator_options(train)}),
    check=check_sky,
)
