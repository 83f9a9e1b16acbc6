"""The data stage: load -> validate -> extract answers -> exact and near dedup -> token bounds -> split ->
decontaminate -> write, with every dropped row in quarantine.jsonl and its reason counted in the report.

    version = build_dataset(cfg.data, Path(".grpo/datasets"), tokenizer_path, cfg.train.reward_set())
    version.splits["train"]  # JSONL rows {"prompt": [{"role": ..., "content": ...}], "answer": "42", "key": "..."}

Rows stream through in Arrow batches of `data.batch_rows`, so memory holds one batch plus the dedup
indexes (a hash per kept row, a MinHash signature per kept row when near-dedup is on, and the n-gram
hashes of the holdout and evaluation prompts). Train rows wait in an Arrow IPC file until every holdout
row is known, then are checked for contamination in a second pass.

The split of a row is `grpo_pipeline.tasks.data.splits.split_of(key)`: a hash of its key alone, so a dataset that grows
never moves an old row, and an old holdout row never reaches training. The output directory is named
by a hash of the input content and the configuration, so a rerun on the same data finds its result and
does nothing; `data_task` (Prefect) is cached on the same key.

This module is the stage's outline (`run_chain`, `build_dataset`, the task); its parts are the modules beside it:
`sources` (reading a source in bounded batches), `rows` (batches into canonical rows), `checks` (what a row must
be), `chain` (dedup, token bounds, the split, contamination), `text` (the text measures they use), `splits`,
`versions` (a version's key, its report, its work directory) and `daily` (what is new since the champion).
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import DEMO_MODEL, ConfigError, DataConfig, ModelConfig
from grpo_pipeline.tasks.data.chain import Chain
from grpo_pipeline.tasks.data.checks import missing_tokenizer, prompt_tokens, token_bounds_apply
from grpo_pipeline.tasks.data.daily import (
    HOLDOUT_KEYS_FILE,
    IDENTITY_FIELDS,
    SEEN_KEYS_FILE,
    config_hash,
    incremental_split,
    split_keys,
    unchanged_reason,
)
from grpo_pipeline.tasks.data.rows import RowContext, demo_batches, effective, eval_texts
from grpo_pipeline.tasks.data.sources import DataSourceError, check_readable, iter_source
from grpo_pipeline.tasks.data.splits import SPLITS, jsonl_line
from grpo_pipeline.tasks.data.text import PromptTokens
from grpo_pipeline.tasks.data.versions import (
    WORK_TAG,
    DataReport,
    DatasetVersion,
    dataset_key,
    load_version,
    removed_on_exit,
    sweep_dead_work,
    version_from,
)
from grpo_pipeline.tasks.model import resolve_base_model

# The stage's surface, where the flows, the CLI and the tests import it from; its parts live in the modules beside it.
__all__ = [
    "CORRECT_ANSWER",
    "HOLDOUT_KEYS_FILE",
    "IDENTITY_FIELDS",
    "REASONS",
    "SEEN_KEYS_FILE",
    "DataQualityError",
    "DataReport",
    "DatasetVersion",
    "build_dataset",
    "config_hash",
    "data_task",
    "dataset_key",
    "incremental_split",
    "jsonl_line",
    "log_lineage",
    "resolve_tokenizer",
    "run_chain",
    "split_keys",
    "token_bounds_apply",
    "unchanged_reason",
]


REASONS = {
    "bad_json": "the line is not one JSON object (RFC 8259: no NaN, comments, raw control characters or second value)",
    "invalid_utf8": "the bytes are not UTF-8 text",
    "line_too_long": "a JSON line longer than grpo_pipeline.tasks.data.sources.MAX_LINE_BYTES (16 MiB)",
    "too_deep": "arrays and objects nested deeper than grpo_pipeline.tasks.data.sources.MAX_DEPTH (64), in any field",
    "nul_character": "a prompt or answer holding U+0000 (NUL): binary or mis-encoded data, whatever the format",
    "bad_csv": "a CSV row with the wrong number of fields",
    "missing_field": "no prompt or no answer",
    "wrong_type": "a prompt that is neither text nor a list of {role, content} messages, or an answer that is not text or a number",
    "empty_prompt": "the prompt is empty or whitespace",
    "answer_extraction_failed": "the answer has no part the configured extraction finds",
    "answer_unverifiable": "a configured reward scores the reference answer itself 0: it cannot parse it",
    "exact_duplicate": "the same prompt (case and whitespace aside) as an earlier row",
    "duplicate_key": "the same key as an earlier row with a different prompt",
    "too_few_tokens": "prompt shorter than data.min_prompt_tokens",
    "too_many_tokens": "prompt longer than data.max_prompt_tokens",
    "near_duplicate": "MinHash Jaccard with an earlier row at or above data.near_dup_threshold",
    "contaminated": "a train row whose n-grams overlap the holdout, val or eval sets beyond data.contamination_threshold",
}


class DataQualityError(ConfigError):
    """Too many rows were dropped: the stage stops instead of training on what is left. A ConfigError, so
    the CLI exits 2 (bad input) with the report; the fix is the source, the mapping or the bound."""

    def __init__(self, message: str, report: DataReport):
        super().__init__(message)
        self.report = report


def run_chain(cfg: DataConfig, work: Path, tokenizer_path: str | None, rewards: RewardSet) -> DataReport:
    """The whole chain into `work`: train/val/holdout.jsonl, quarantine.jsonl. Returns the report. `rewards`' answer
    checkers, bound with their arguments, judge each reference answer."""
    started = time.perf_counter()
    cfg = effective(cfg)
    ctx = RowContext(cfg, rewards)
    tokens = prompt_tokens(cfg, tokenizer_path)
    chain = Chain(cfg, ctx, tokens, work)
    eval_rows = 0
    # The chain makes no reference cycles, but millions of small objects (dedup keys, rows) make the cyclic
    # collector rescan the live heap over and over (~15% of the time); it runs once at the end instead.
    collecting = gc.isenabled()
    gc.disable()
    try:
        batches = (
            demo_batches(cfg)
            if cfg.source is None
            else iter_source(
                cfg.source,
                cfg.source_format,
                cfg.batch_rows,
                split=cfg.source_split,
                config=cfg.source_config,
                s3_endpoint_url=cfg.s3_endpoint_url,
                scratch=work,
            )
        )
        for raw in batches:
            chain.feed(raw)
        if cfg.contamination_threshold is not None:
            for source in cfg.eval_sources:
                for texts in eval_texts(source, cfg, work):
                    chain.add_reference(texts)
                    eval_rows += len(texts)
        chain.finish()
    finally:
        for f in (*chain.outputs.values(), chain.quarantine):
            f.close()
        if collecting:
            gc.enable()
            gc.collect()
    kept = sum(chain.kept.values())
    dropped = sum(chain.dropped.values())
    return DataReport(
        source=cfg.source or "demo",
        rows_read=chain.rows_read,
        rows_kept=kept,
        splits={s: chain.kept[s] for s in SPLITS},
        dropped=dict(sorted(chain.dropped.items())),
        dropped_fraction=dropped / chain.rows_read if chain.rows_read else 0.0,
        max_dropped_fraction=cfg.max_dropped_fraction,
        checks=_checks(cfg, ctx, tokens, tokenizer_path),
        eval_rows=eval_rows,
        seconds=round(time.perf_counter() - started, 3),
        malformed_by_file={f: [n, chain.read_by_file[f]] for f, n in sorted(chain.malformed_by_file.items())},
    )


def _checks(
    cfg: DataConfig, ctx: RowContext, tokens: PromptTokens | None, tokenizer_path: str | None
) -> dict[str, str]:
    """What each check did, in words, for the report."""
    return {
        "answer": f"rewards {', '.join(ctx.verifiers)} score the reference answer"
        if ctx.verifiers
        else "no configured reward takes an answer: not checked",
        "tokens": (
            f"{tokenizer_path}: {tokens.exact} prompts tokenized, the rest bounded by byte length"
            if tokens
            else "off: data.max_prompt_tokens is null and data.min_prompt_tokens <= 1"
        ),
        "near_dedup": (
            f"MinHash LSH, {cfg.near_dup_num_perm} permutations, Jaccard >= {cfg.near_dup_threshold} "
            f"on word {cfg.near_dup_ngram}-grams"
            if cfg.near_dup_threshold
            else "off"
        ),
        "contamination": (
            f"train vs holdout, val and {len(cfg.eval_sources)} eval source(s): share of word "
            f"{cfg.contamination_ngram}-grams >= {cfg.contamination_threshold}"
            if cfg.contamination_threshold
            else "off"
        ),
    }


# The rewards of a build that names none (a test's, a benchmark's): the default config's answer checker.
CORRECT_ANSWER = RewardSet.model_validate({"names": ("correct_answer",)})


def build_dataset(
    cfg: DataConfig, out_dir: Path, tokenizer_path: str | None = None, rewards: RewardSet = CORRECT_ANSWER
) -> DatasetVersion:
    """Build (or find, when the same inputs were built before) a dataset version under out_dir/<key>. The run's
    `rewards` travel whole (`TrainConfig.reward_set()`): their answer checkers, with their arguments, judge each
    reference answer, and the key follows their names and those arguments, not the weights, which change no row.

    Raises ConfigError for a source that cannot be read or token bounds without a tokenizer,
    DataQualityError when more than `max_dropped_fraction` of the rows were dropped, or more than
    `max_malformed_per_file` of one file's rows were malformed (the quarantine is then kept in out_dir/<key>.rejected). The version is written aside and renamed into place, so a failure
    leaves nothing half-written: the work directory goes on an exception, on SIGTERM or SIGHUP (see
    `removed_on_exit`), and after a SIGKILL with the next build in the same out_dir.
    """
    out_dir = Path(out_dir)
    if token_bounds_apply(cfg) and not tokenizer_path:
        raise missing_tokenizer(cfg, "no tokenizer was given")
    for source in ([cfg.source] if cfg.source else []) + cfg.eval_sources:
        check_readable(source, cfg.s3_endpoint_url)
    key = dataset_key(cfg, tokenizer_path, rewards)
    target = out_dir / key[:16]
    found = load_version(target)
    if found is not None:
        return found
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep_dead_work(out_dir)
    work = out_dir / f".{key[:16]}{WORK_TAG}{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    with removed_on_exit(work):
        report = run_chain(cfg, work, tokenizer_path, rewards)
        (work / "report.json").write_bytes(orjson.dumps(report.model_dump(mode="json"), option=orjson.OPT_INDENT_2))
        if report.rows_read == 0:
            raise DataQualityError(f"data.source {cfg.source} holds no rows", report)
        worst = ", ".join(f"{r} {n}" for r, n in Counter(report.dropped).most_common(3))
        if broken := malformed_files(report, cfg.max_malformed_per_file):
            rejected = _set_aside(work, out_dir / f"{key[:16]}.rejected")
            raise DataQualityError(
                f"{'; '.join(broken)}: more than data.max_malformed_per_file={cfg.max_malformed_per_file} of "
                f"the file's rows ({worst} over the whole source); see {rejected / 'quarantine.jsonl'}, then fix or "
                "remove the file (or raise the bound); nothing was trained on any file",
                report,
            )
        if report.dropped_fraction > cfg.max_dropped_fraction:
            rejected = _set_aside(work, out_dir / f"{key[:16]}.rejected")
            raise DataQualityError(
                f"{report.dropped_fraction:.1%} of {report.rows_read} rows were dropped ({worst}), more than "
                f"data.max_dropped_fraction={cfg.max_dropped_fraction}; see {rejected / 'quarantine.jsonl'} "
                "and fix the source or the column mapping (or raise the bound)",
                report,
            )
        version = version_from(work, key, report)
        (work / "version.json").write_bytes(orjson.dumps({"key": key, "report": report.model_dump(mode="json")}))
        try:
            work.rename(target)
        except OSError:  # another run finished the same version first: theirs is identical
            pass
        return load_version(target) or version


def malformed_files(report: DataReport, bound: float | None) -> list[str]:
    """The files more than `bound` of whose rows are malformed (`data.max_malformed_per_file`), each in words.

    >>> r = DataReport(source="d", rows_read=100, rows_kept=80, splits={}, dropped={"bad_json": 20},
    ...                dropped_fraction=0.2, max_dropped_fraction=0.2, checks={},
    ...                malformed_by_file={"d/2026-12-05.jsonl": [0, 60], "d/2026-12-06.jsonl": [20, 40]})
    >>> malformed_files(r, 0.2)
    ['d/2026-12-06.jsonl: 20 of 40 rows malformed (50.0%)']
    >>> malformed_files(r, 0.5), malformed_files(r, None)
    ([], [])
    """
    if bound is None:
        return []
    return [
        f"{name}: {bad} of {read} rows malformed ({bad / read:.1%})"
        for name, (bad, read) in report.malformed_by_file.items()
        if read and bad / read > bound
    ]


def _set_aside(work: Path, rejected: Path) -> Path:
    """A refused build's work directory, without its splits, as `rejected`: its quarantine and report stay to look at."""
    shutil.rmtree(rejected, ignore_errors=True)
    for name in SPLITS:
        (work / f"{name}.jsonl").unlink(missing_ok=True)
    work.rename(rejected)
    return rejected


def resolve_tokenizer(data: DataConfig, model: ModelConfig, data_dir: Path, given: str | None = None) -> str | None:
    """The tokenizer the data stage counts tokens with when the stage runs alone (`grpo-pipeline data`): the
    one given, else model.base's, as the pipeline resolves it for the run (the demo model is fetched and
    converted once). None when no token bound applies. Raises ConfigError naming the fixes."""
    if given or not token_bounds_apply(data):
        return given
    base = model.base
    on_disk = [data_dir / "models" / DEMO_MODEL] if base == DEMO_MODEL else [Path(base).expanduser()]
    for path in on_disk:
        if path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return str(path)

    try:
        return resolve_base_model(model, data_dir / "models")
    except Exception as exc:  # a missing path, no network for the demo model's download, a bad GGUF file
        raise missing_tokenizer(
            data, f"model.base {base!r} could not be resolved here ({type(exc).__name__}: {str(exc)[:300]})"
        ) from None


class _InputsCache(CachePolicy):
    """Prefect cache key = the version key, offered only while that version is on disk (a cached result
    that points at deleted files would be worse than rebuilding). The key holds what of `rewards` changes a row
    (`dataset_key`: the names, the answer checkers' arguments), not the weights, which change none."""

    def compute_key(
        self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        rewards: RewardSet = inputs["rewards"]
        try:
            key = dataset_key(inputs["cfg"], inputs.get("tokenizer_path"), rewards)
        except (DataSourceError, OSError, ValueError):
            return None  # the task itself reports the problem
        out_dir = Path(inputs["out_dir"])
        return f"data-{key}-{out_dir.resolve()}" if (out_dir / key[:16] / "version.json").is_file() else None


@task(name="data", cache_policy=_InputsCache(), persist_result=True)
def data_task(cfg: DataConfig, out_dir: Path, tokenizer_path: str | None, rewards: RewardSet) -> DatasetVersion:
    """The version `build_dataset` builds or finds; its answer checks run `rewards`' checkers with their arguments."""
    return build_dataset(cfg, out_dir, tokenizer_path, rewards)


def log_lineage(version: DatasetVersion) -> None:
    """Inside an active MLflow run: each split as a dataset input (digest = its content hash), the report
    and the quarantine as artifacts, row counts as params, drops per reason as metrics."""
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, Schema

    schema = Schema([ColSpec("string", "prompt"), ColSpec("string", "answer"), ColSpec("string", "key")])
    for split, path in version.splits.items():
        with warnings.catch_warnings():  # MLflow registers two local-file source classes and says so
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(str(Path(path).resolve()))
        # MLflow's Dataset marks `profile` abstract without being an ABC: MetaDataset is made as MLflow's docs do
        dataset = MetaDataset(source, name=split, digest=version.fingerprints[split], schema=schema)  # type: ignore[abstract]
        mlflow.log_input(
            dataset, context=split, tags={"source": version.report.source, "dataset_fingerprint": version.fingerprint}
        )
    report = version.report
    mlflow.log_params(
        {f"rows_{s}": n for s, n in report.splits.items()} | {"source": report.source, "data_key": version.key[:16]}
    )
    mlflow.log_metrics(
        {"rows_read": report.rows_read, "dropped_fraction": report.dropped_fraction}
        | {f"dropped/{r}": n for r, n in report.dropped.items()}
    )
    mlflow.set_tag("dataset_fingerprint", version.fingerprint)
    mlflow.log_artifact(str(version.report_path))
    mlflow.log_artifact(str(version.quarantine))
