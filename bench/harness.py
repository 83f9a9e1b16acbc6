"""Run two commands side by side, alternating, and report the ratio of a metric they print.

Each command must print a JSON object as its last stdout line; `metric` is a dotted path into it.
Alternating A, B, A, B... spreads the noise of a shared machine over both sides.

    python -m bench.harness --name demo --metric seconds --baseline "cmd A" --candidate "cmd B"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

# BENCH_RESULTS redirects saved results (tests write there, not into the tracked folder).
ROOT = Path(__file__).resolve().parents[1]  # the checkout: benchmarks run from one, with its configs/
RESULTS = Path(os.environ.get("BENCH_RESULTS") or ROOT / "bench" / "results")


def metric_of(stdout: str, metric: str) -> float:
    """Read a dotted path from the last JSON line of a command's output.

    >>> metric_of('noise\\n{"metrics": {"t": 2.5}}\\n', "metrics.t")
    2.5
    """
    value = json.loads(stdout.strip().splitlines()[-1])
    for part in metric.split("."):
        value = value[part]
    return float(value)


def training_bench_args(description: str) -> argparse.Namespace:
    """The options every training benchmark takes: steps per run, rounds, and a tiny model for a quick look."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2-135M")
    return parser.parse_args()


def spread(values: list[float]) -> dict[str, float]:
    """Median and spread of repeated measurements (min, max; quartiles from 4 values on).

    >>> spread([3.0, 1.0, 2.0])
    {'median': 2.0, 'min': 1.0, 'max': 3.0, 'n': 3}
    """
    out = {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
    if len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4)
        out |= {"q1": q1, "q3": q3}
    return out


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM) in MiB; since the last `reset_peak_rss()` where Linux allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # not Linux: the lifetime peak (bytes on macOS, KiB elsewhere)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if platform.system() == "Darwin" else peak / 1024


def reset_peak_rss() -> bool:
    """Restart the peak-RSS mark at the current RSS (Linux clear_refs 5), so a later peak is a phase's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux), else what `platform` knows: two machines of one kind can differ in speed."""
    from grpo_pipeline.trainer.precision import cpuinfo_value

    return cpuinfo_value(("model name",), cpuinfo) or platform.processor() or platform.machine()


def stamp() -> dict:
    """Where and when a result was measured, for the end of its JSON: the CPU's model and whether it computes
    bf16 natively (AVX2-only machines emulate it ~50x slower), as the benchmarks page says for each figure."""
    from grpo_pipeline.trainer.precision import cpu_has_native_bf16

    return {
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "native_bf16": cpu_has_native_bf16(),
            "python": platform.python_version(),
        },
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def save(name: str, report: dict) -> Path:
    """Write `bench/results/<name>.json` aside, then rename it into place: never a half-written result."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
    return path


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """`--threads` of the benchmarks that run the pipeline (`torch_threads` reads it)."""
    parser.add_argument(
        "--threads",
        default="auto",
        help="torch threads per process; auto: 1 when other work already keeps a core busy (two threads on one "
        "free core thrash: 10x slower steps), else torch's own",
    )


def add_work_options(parser: argparse.ArgumentParser, default: Path) -> None:
    """`--work` and `--fresh` of the benchmarks whose runs `open_work` keeps between invocations."""
    parser.add_argument("--fresh", action="store_true", help="forget the work folder's runs and measure all again")
    parser.add_argument("--work", type=Path, default=default, help="where runs are kept between invocations")


def torch_threads(option: str, busy: float | None = None) -> int | None:
    """Torch threads per process for `--threads`: a number as given; `auto`: 1 when the load (`busy`, default
    the 1-minute load average) says another job already keeps a core busy, else None (torch's own).

    >>> torch_threads("2"), torch_threads("auto", busy=1.2), torch_threads("auto", busy=0.1)
    (2, 1, None)
    """
    if option != "auto":
        return int(option)
    return 1 if (os.getloadavg()[0] if busy is None else busy) >= 0.8 else None


def load_runs(path: Path, fresh: bool = False) -> dict:
    """A resumable benchmark's finished runs (kept by `keep_runs`); none when there is no file yet or `fresh`."""
    return {} if fresh or not path.is_file() else json.loads(path.read_text())


def keep_runs(path: Path, runs: dict) -> None:
    """Keep the finished runs after each one, so that a killed benchmark resumes from the next: written aside,
    then renamed into place (never a half-written file).

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "bench" / "runs.json"
    >>> keep_runs(path, {"off": {"steps": 40}}); load_runs(path), load_runs(path, fresh=True)
    ({'off': {'steps': 40}}, {})
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(runs, indent=1))
    tmp.replace(path)


def fingerprint(identity: str, code: tuple[str, ...], root: Path = ROOT) -> str:
    """What a resumable benchmark's runs were made with: `identity` (its configuration, as text) and every source
    file of `code` (folders and files under `root`; a changed file is another code version).

    >>> a = fingerprint("train: {}", ("bench/harness.py",))
    >>> a == fingerprint("train: {}", ("bench/harness.py",)), a == fingerprint("train: {lr: 1}", ("bench/harness.py",))
    (True, False)
    """
    digest = hashlib.sha256(identity.encode())
    for entry in code:
        path = root / entry
        files = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".yaml", ".json")) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" not in file.parts:
                digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


class MixedWorkFolder(SystemExit):
    """A work folder of another configuration or code version: its runs are not comparable with new ones."""


def open_work(work: Path, current: str, fresh: bool) -> dict:
    """A resumable benchmark's work folder: its finished runs (`runs.json`, kept by `keep_runs`), refused when
    they were made with another fingerprint (`fingerprint`).

    >>> import tempfile
    >>> work = Path(tempfile.mkdtemp())
    >>> keep_runs(work / "runs.json", {"fingerprint": "aaa", "runs": {"demo/0": {}}})
    >>> open_work(work, "aaa", fresh=False)["runs"], open_work(work, "bbb", fresh=True)["runs"]
    ({'demo/0': {}}, {})
    >>> open_work(work, "bbb", fresh=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    bench.harness.MixedWorkFolder: ...
    """
    kept = load_runs(work / "runs.json", fresh)
    if kept and kept.get("fingerprint") != current:
        raise MixedWorkFolder(
            f"{work} holds runs of another configuration or code version (fingerprint {kept.get('fingerprint')}, "
            f"this checkout {current}); mixing them would compare different things. Pass --fresh to start that "
            "folder over, or --work to use another one."
        )
    return {**(kept or {}), "fingerprint": current, "runs": kept.get("runs", {}) if kept else {}}


def pipeline_run(work: Path, sets: list[str], threads: int | None, config: Path | None = None) -> tuple[dict, float]:
    """`grpo-pipeline run --json` (the CLI's default config unless `config`) in a fresh `work` folder as its
    data_dir, with its own MLflow (sqlite under it: the base is the baseline, no earlier champion) and Prefect
    home; the converted demo model is linked in so the run does not fetch it again. Returns the run's summary
    and its wall seconds; a run that fails (any exit but 0 and 3, "not promoted") stops the benchmark."""
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    models = ROOT / ".grpo" / "models"
    if models.is_dir():
        (work / "models").symlink_to(models.resolve())
    cmd = [sys.executable, "-m", "grpo_pipeline.cli", "run", "--json", "--set", f"data_dir={work}"]
    cmd += ["--config", str(config)] if config else []
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"PREFECT_HOME": str(work / "prefect")}
    if threads:  # torch's intra-op threads in every process of the run (the trainer inherits them)
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    seconds = time.monotonic() - started
    if proc.returncode not in (0, 3):
        raise SystemExit(f"grpo-pipeline run exited {proc.returncode}: {proc.stdout[-2000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{") :]), seconds


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def prune_weights(work: Path) -> int:
    """Delete the model weights a finished pipeline run left under `work` (its adapters, merged models and
    checkpoints: ~1.9 GB a demo run) and return the bytes freed; the records (summaries, logs, MLflow's database
    and tables) stay. The linked-in base model is not followed. A benchmark over many runs fills a disk otherwise.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = (Path(d) / "adapter.safetensors").write_bytes(b"x" * 10)
    ...     _ = (Path(d) / "summary.json").write_text("{}")
    ...     prune_weights(Path(d)), sorted(p.name for p in Path(d).iterdir())
    (10, ['summary.json'])
    """
    freed = 0
    for root, _dirs, files in os.walk(work):  # os.walk does not follow the symlinked models folder
        for name in files:
            path = Path(root) / name
            if name.endswith(WEIGHT_SUFFIXES) and not path.is_symlink():
                freed += path.stat().st_size
                path.unlink()
    return freed


def run_once(cmd: list[str], metric: str) -> float:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return metric_of(proc.stdout, metric)


def compare(
    name: str,
    baseline: list[str],
    candidate: list[str],
    metric: str,
    repeats: int = 2,
    before_each: Callable[[], None] = lambda: None,
    **meta,
) -> dict:
    """Alternate the two commands `repeats` times; ratio = median(candidate) / median(baseline).

    `before_each` resets shared state (e.g. a checkpoint store a resumable trainer would pick up).
    """
    samples: dict[str, list[float]] = {"baseline": [], "candidate": []}
    for i in range(repeats):
        for side, cmd in (("baseline", baseline), ("candidate", candidate)):
            before_each()
            value = run_once(cmd, metric)
            samples[side].append(value)
            print(f"[{name}] round {i + 1}/{repeats} {side}: {metric} = {value:.4g}", flush=True)
    medians = {side: statistics.median(v) for side, v in samples.items()}
    report = {
        "name": name,
        "metric": metric,
        "ratio": medians["candidate"] / medians["baseline"],
        "median": medians,
        "samples": samples,
        "baseline": shlex.join(baseline),
        "candidate": shlex.join(candidate),
        **stamp(),
        **meta,
    }
    save(name, report)
    print(f"[{name}] ratio candidate/baseline = {report['ratio']:.3f} (saved to bench/results/{name}.json)")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--metric", required=True, help="dotted path into each command's last JSON line")
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--candidate", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    started = time.monotonic()
    compare(args.name, shlex.split(args.baseline), shlex.split(args.candidate), args.metric, args.repeats)
    print(f"took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
