"""Dataset versions: what one is (`DatasetVersion` and its `DataReport`), the key that names it (`dataset_key`: a
hash of everything its content depends on), finding a finished one (`load_version`), and the work directory a
build writes into, removed however the build ends (`removed_on_exit`, `sweep_dead_work`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import DataConfig
from grpo_pipeline.tasks.data.rows import verifier_args
from grpo_pipeline.tasks.data.sources import file_digest, source_fingerprint
from grpo_pipeline.tasks.data.splits import SPLITS
from grpo_pipeline.tasks.data.splits import fingerprint as splits_fingerprint

# the modules whose code shapes a version's content: a change to any of them builds the version anew
_CODE_FILES = (
    "stage.py",
    "rows.py",
    "checks.py",
    "chain.py",
    "versions.py",
    "sources.py",
    "text.py",
    "demo_task.py",
    "splits.py",
)
RUN_FIELDS = (
    "skip_unchanged",
    "incremental",
    "replay_fraction",
    "drift_alert",
)  # DataConfig fields that do not shape a version


class DataReport(BaseModel):
    source: str
    rows_read: int
    rows_kept: int
    splits: dict[str, int]
    dropped: dict[str, int]
    dropped_fraction: float
    max_dropped_fraction: float
    checks: dict[str, str]
    eval_rows: int = 0
    seconds: float = 0.0
    # per source file with a malformed row (chain.MALFORMED): [malformed rows, rows read]
    malformed_by_file: dict[str, list[int]] = {}


class DatasetVersion(BaseModel):
    """What the data stage hands on: JSONL splits, their content hashes, the report and the quarantine."""

    splits: dict[str, Path]
    fingerprints: dict[str, str]
    fingerprint: str
    report: DataReport
    quarantine: Path
    report_path: Path
    key: str


def _tokenizer_digest(tokenizer_path: str | None) -> str:
    if not tokenizer_path:
        return "none"
    root = Path(tokenizer_path)
    if not root.is_dir():
        return str(tokenizer_path)
    names = (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "special_tokens_map.json",
    )
    return hashlib.sha256(
        "".join(f"{n}:{file_digest(root / n)}" for n in names if (root / n).is_file()).encode()
    ).hexdigest()


def dataset_key(cfg: DataConfig, tokenizer_path: str | None, rewards: RewardSet) -> str:
    """A hash of everything the output depends on: input content, configuration, tokenizer, the rewards' names and
    the answer checkers' arguments (the others' arguments and every weight change no row), code."""
    # what the run does with a built version (skip it, train on its new rows) does not change the version
    built = cfg.model_dump(mode="json", exclude=set(RUN_FIELDS))
    digest = hashlib.sha256(orjson.dumps(built, option=orjson.OPT_SORT_KEYS))
    here = Path(__file__).parent
    digest.update("".join(file_digest(here / f) for f in _CODE_FILES).encode())
    # the rewards' own code decides which references are judged (their reference checks, their normalization)
    rewards_code = here.parent.parent / "trainer" / "rewards"
    digest.update("".join(file_digest(f) for f in sorted(rewards_code.glob("*.py"))).encode())
    digest.update(f"\0{_tokenizer_digest(tokenizer_path)}\0{list(rewards.names)}".encode())
    checker_args = {name: args for name, args in verifier_args(rewards).items() if args}
    if checker_args:  # only what changes a row: another url for remote_verifier rebuilds nothing
        digest.update(b"\0" + orjson.dumps(checker_args, option=orjson.OPT_SORT_KEYS, default=str))
    if cfg.source is not None:
        digest.update(
            source_fingerprint(
                cfg.source, cfg.source_format, cfg.s3_endpoint_url, f"{cfg.source_split}:{cfg.source_config}"
            ).encode()
        )
    for source in cfg.eval_sources:
        digest.update(source_fingerprint(source, "auto", cfg.s3_endpoint_url, "all splits").encode())
    return digest.hexdigest()


def version_from(target: Path, key: str, report: DataReport) -> DatasetVersion:
    splits = {s: target / f"{s}.jsonl" for s in SPLITS}
    return DatasetVersion(
        splits=splits,
        fingerprints={s: file_digest(p)[:16] for s, p in splits.items()},
        fingerprint=splits_fingerprint(splits),
        report=report,
        quarantine=target / "quarantine.jsonl",
        report_path=target / "report.json",
        key=key,
    )


def load_version(target: Path) -> DatasetVersion | None:
    """A finished version in `target` (relative paths resolved there), or None."""
    try:
        saved = orjson.loads((target / "version.json").read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    return version_from(target, saved["key"], DataReport.model_validate(saved["report"]))


WORK_TAG = ".tmp-"  # out_dir/.<key>.tmp-<host>-<pid>: a build in progress


def sweep_dead_work(out_dir: Path) -> None:
    """Remove work directories that builds on this host left when they were killed (SIGKILL, a crash)."""
    host = socket.gethostname()
    for path in out_dir.glob(f".*{WORK_TAG}{host}-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextmanager
def removed_on_exit(path: Path) -> Iterator[None]:
    """Remove `path` however the block ends. SIGTERM and SIGHUP would end the process without running
    `finally`; in the main thread, where no handler of their own is set, they raise SystemExit instead for
    the length of the block (the process still ends, with 128 + the signal's number)."""
    installed = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                installed[sig] = signal.signal(sig, _exit_on_signal)
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)
        for sig, previous in installed.items():
            signal.signal(sig, previous)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
