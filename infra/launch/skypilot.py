"""Launch the trainer as a SkyPilot managed job on spot GPUs, follow it, collect its adapter from the store.

SkyPilot recovers a preempted job (relaunching it, another region first); the trainer resumes from its
newest complete checkpoint in S3. Turning a job spec into a `sky.Task` is a pure function
(`task_config`), so tests inspect exactly what would be launched without a cloud.

Several GPUs and nodes: `num_nodes` is train.distributed.nodes (plus one for a dedicated vLLM server node),
each accelerator option asks for processes_per_node (+ vllm_server_gpus) GPUs when that is set, and the
task's run command starts `python -m grpo_pipeline.trainer.launch` on every node with the rendezvous SkyPilot gives
(SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE). A recovery restarts
the whole cluster, and every node's ranks resume from the same checkpoint in S3.
"""

from __future__ import annotations

import io
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grpo_pipeline.configs.files import SOURCE_ROOT, project_file
from grpo_pipeline.configs.schema import SkyConfig, TrainConfig
from grpo_pipeline.infra.launch import BadTrainingInput, TrainingFailed
from grpo_pipeline.trainer.checkpoints import CheckpointStoreError, collect_final, open_store
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


class SkyPreflightError(RuntimeError):
    pass


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
    return spec.model_copy(
        update={
            "model_path": NODE_MODEL_DIR if local_model else spec.model_path,
            "train_file": f"{NODE_JOB_DIR}/data/train.jsonl",
            "val_file": f"{NODE_JOB_DIR}/data/val.jsonl" if spec.val_file else None,
            "work_dir": NODE_WORK_DIR,
            "adapter_dir": f"{NODE_WORK_DIR}/adapter",
        }
    )


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
    return [o["accelerators"] for o in resources.get("ordered") or resources.get("any_of") or []
            if isinstance(o, dict) and "accelerators" in o] or ([resources["accelerators"]] if "accelerators" in resources else [])


def _count(option: str) -> tuple[str, int]:
    """'H100:8' -> ('H100', 8); a bare name is one GPU."""
    name, _, count = str(option).partition(":")
    return name, int(count or 1)


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
    return [(name, max(count, need or count)) for name, count in map(_count, listed)]


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
        resources["ordered"] = [{"accelerators": f"{name}:{max(count, need or count)}"}
                                for name, count in map(_count, options)]
    config["num_nodes"] = d.nodes + d.vllm_server_node
    resources["use_spot"] = sky_cfg.use_spot
    recovery = resources.setdefault("job_recovery", {})
    recovery["max_restarts_on_errors"] = max_restarts
    return config


def build_task(spec: JobSpec, job_dir: Path, sky_cfg: SkyConfig, max_restarts: int, environ: dict[str, str]) -> Any:
    """A `sky.Task`, validated by SkyPilot's own parser; declared secrets come from `environ`."""
    import sky

    base = _task_yaml(sky_cfg.task_yaml)
    config = task_config(base, spec, job_dir, sky_cfg, max_restarts)
    secrets = [(k, environ[k]) for k in (config.get("secrets") or {}) if environ.get(k)]
    return sky.Task.from_yaml_config(config, secrets_overrides=secrets)


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
    from sky.client import sdk

    sdk.get(sdk.check(None, verbose=False))  # refreshes credentials; starts a local API server if none
    if not sdk.get(sdk.enabled_clouds()):
        raise SkyPreflightError(
            "SkyPilot has no cloud enabled: run `sky check` and follow its hints (cloud credentials, "
            "or a Kubernetes context), or use train.launcher=local"
        )


@dataclass
class SkyHandle:
    spec: JobSpec
    job_id: int
    bad_input: str | None = None  # the trainer's exit-2 reason, once its log line streams in


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
    def __init__(self, sky_cfg: SkyConfig, max_restarts: int, on_status: Callable[[str], None] | None = None,
                 on_line: Callable[[str], None] | None = None):
        self.sky_cfg, self.max_restarts = sky_cfg, max_restarts
        self.on_status = on_status or (lambda msg: log.info(msg))
        self.on_line = on_line or (lambda line: log.debug("trainer: %s", line))

    def launch(self, spec: JobSpec) -> SkyHandle:
        import os

        import sky
        from grpo_pipeline.infra.launch import check_launch

        base = _task_yaml(self.sky_cfg.task_yaml)
        options = task_config(base, spec, Path(spec.work_dir), self.sky_cfg, self.max_restarts)["resources"]["ordered"]
        check_launch(spec, sorted({_count(o["accelerators"])[1] for o in options}))  # before the job folder is written

        job_dir = write_job_dir(spec, Path(spec.work_dir) / "sky-job")
        task = build_task(spec, job_dir, self.sky_cfg, self.max_restarts, dict(os.environ))
        job_ids, _ = sky.stream_and_get(sky.jobs.launch(task, name=f"grpo-{Path(spec.work_dir).parent.name}"))
        if not job_ids:
            raise TrainingFailed(f"SkyPilot accepted the managed job for {spec.work_dir} but returned no job id")
        self.on_status(f"managed job {job_ids[0]} submitted")
        return SkyHandle(spec, job_ids[0])

    def _record(self, job_id: int) -> Any:  # a managed-job record, as `sky jobs queue` gives it
        import sky

        records = sky.get(sky.jobs.queue(refresh=False, job_ids=[job_id]))
        records = records[0] if isinstance(records, tuple) else records
        return records[0]

    def watch(self, handle: SkyHandle) -> Callable[[str], None]:
        """The callback for each streamed line: passes it on, and keeps the trainer's bad-input reason."""

        def on_line(line: str) -> None:
            if handle.bad_input is None:
                handle.bad_input = parse_bad_input(line)
            self.on_line(line)

        return on_line

    def _stream_logs(self, handle: SkyHandle) -> None:
        import sky

        try:  # follows the job across recoveries until it ends
            sky.jobs.tail_logs(job_id=handle.job_id, follow=True, output_stream=_Lines(self.watch(handle)))
        except Exception as exc:  # the state loop below still decides the outcome
            log.warning("log streaming of managed job %d stopped: %s", handle.job_id, exc)

    def wait(self, handle: SkyHandle) -> TrainResult:
        threading.Thread(target=self._stream_logs, args=(handle,), daemon=True).start()
        last = None
        while True:
            record = self._record(handle.job_id)
            status = getattr(record.status, "value", str(record.status))
            if status != last:
                self.on_status(f"managed job {handle.job_id}: {status} (recoveries: {record.recovery_count})")
                last = status
            if status in TERMINAL_OK | TERMINAL_BAD:
                break
            if handle.bad_input:
                # SkyPilot recovers any failed job (max_restarts_on_errors) and has no "never on this exit
                # code"; bad input would fail every recovery the same way, each on a fresh cluster.
                self.cancel(handle)
                raise BadTrainingInput(f"managed job {handle.job_id}: bad input, cancelled instead of recovered: "
                                       f"{handle.bad_input}")
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
        import sky

        out = io.StringIO()
        try:
            sky.jobs.tail_logs(job_id=handle.job_id, follow=False, tail=lines, output_stream=out)
        except Exception as exc:  # the logs are a courtesy; the failure reason is already in the message
            return f"(logs unavailable: {exc})"
        return out.getvalue()

    def cancel(self, handle: SkyHandle) -> None:
        import sky

        sky.get(sky.jobs.cancel(job_ids=[handle.job_id]))
        self.on_status(f"managed job {handle.job_id} cancelled")
