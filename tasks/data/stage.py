"""The data stage: load -> validate -> extract answers -> exact and near dedup -> token bounds -> split ->
decontaminate -> write, with every dropped row in quarantine.jsonl and its reason counted in the report.

    version = build_dataset(cfg.data, Path(".grpo/datasets"), tokenizer_path, rewards=["correct_answer"])
    version.splits["train"]  # JSONL rows {"prompt": [{"role": ..., "content": ...}], "answer": "42", "key": "..."}

Rows stream through in Arrow batches of `data.batch_rows`, so memory holds one batch plus the dedup
indexes (a hash per kept row, a MinHash signature per kept row when near-dedup is on, and the n-gram
hashes of the holdout and evaluation prompts). Train rows wait in an Arrow IPC file until every holdout
row is known, then are checked for contamination in a second pass.

The split of a row is `grpo_pipeline.tasks.data.splits.split_of(key)`: a hash of its key alone, so a dataset that grows
never moves an old row, and an old holdout row never reaches training. The output directory is named
by a hash of the input content and the configuration, so a rerun on the same data finds its result and
does nothing; `data_task` (Prefect) is cached on the same key.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import shutil
import signal
import socket
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from pydantic import BaseModel

from grpo_pipeline.configs.schema import DEMO_MODEL, ConfigError, DataConfig, ModelConfig, PipelineConfig
from grpo_pipeline.tasks.data.demo_task import generate as demo_rows
from grpo_pipeline.tasks.data.sources import (
    DataSourceError,
    RawBatch,
    Reject,
    check_readable,
    file_digest,
    iter_source,
    json_kind,
    source_fingerprint,
)
from grpo_pipeline.tasks.data.splits import fingerprint as splits_fingerprint
from grpo_pipeline.tasks.data.splits import incremental_rows, split_of
from grpo_pipeline.tasks.data.text import (
    NearDuplicateIndex,
    PromptTokens,
    ngram_hashes,
    normalize,
    overlap_fraction,
    sorted_unique,
    words,
)

SPLITS = ("train", "val", "holdout")
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
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
CANONICAL = pa.schema(
    [
        ("pos", pa.int64()),
        ("source", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("raw", pa.string()),
        ("answer", pa.string()),
        ("key", pa.string()),
    ]
)
_GSM8K = r"(?s)^.*####\s*(?P<answer>.*?)\s*$"
_CODE_FILES = ("stage.py", "sources.py", "text.py", "demo_task.py", "splits.py")


class DataQualityError(ConfigError):
    """Too many rows were dropped: the stage stops instead of training on what is left. A ConfigError, so
    the CLI exits 2 (bad input) with the report; the fix is the source, the mapping or the bound."""

    def __init__(self, message: str, report: DataReport):
        super().__init__(message)
        self.report = report


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


class DatasetVersion(BaseModel):
    """What the data stage hands on: JSONL splits, their content hashes, the report and the quarantine."""

    splits: dict[str, Path]
    fingerprints: dict[str, str]
    fingerprint: str
    report: DataReport
    quarantine: Path
    report_path: Path
    key: str


# ---------------------------------------------------------------- rows: canonical form and validation


RewardArgs = Mapping[str, Mapping[str, Any]]  # train.reward_args: reward name -> its keyword arguments


def _verifier_args(rewards: Sequence[str], reward_args: RewardArgs | None) -> dict[str, dict[str, Any]]:
    """The answer-checking rewards (those that take the `answer` column) and their configured arguments. The
    others are not resolved here: they do not judge a reference answer, and some need what only training
    offers (remote_verifier's service)."""
    from grpo_pipeline.trainer.rewards import describe

    args = reward_args or {}
    return {name: dict(args.get(name) or {}) for name in rewards if "answer" in describe(name)["columns"]}


class _Context:
    """What the chain needs that comes from the configuration, resolved once."""

    def __init__(self, cfg: DataConfig, rewards: Sequence[str], reward_args: RewardArgs | None = None):
        from grpo_pipeline.trainer.rewards import resolve_reward

        self.cfg = cfg
        prefix, _, suffix = cfg.prompt_template.partition("{prompt}")
        self.prefix, self.suffix = prefix, suffix
        # bound with train.reward_args, as the trainer binds them: a checker's required argument is given,
        # and a row is kept or quarantined by the reward as configured
        self.verifiers = {
            name: resolve_reward(name, args) for name, args in _verifier_args(rewards, reward_args).items()
        }


# Characters that str.splitlines() breaks lines at but JSON leaves unescaped (orjson escapes the ASCII ones).
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def jsonl_line(obj: Any) -> bytes:
    r"""One JSON line that every line splitter reads as one line (GSM8K has U+2028 inside questions).

    >>> jsonl_line({"q": "a\u2028b"})
    b'{"q":"a\\u2028b"}\n'
    """
    line = orjson.dumps(obj, default=str)
    for raw, escaped in _LINE_BREAKS:
        line = line.replace(raw, escaped)
    return line + b"\n"


def _reject_rows(table: pa.Table, mask: np.ndarray, reason: str, details: Sequence[str] | str) -> list[Reject]:
    idx = np.flatnonzero(mask)
    if not len(idx):
        return []
    picked = table.take(pa.array(idx))
    pos, src = picked.column("pos").to_pylist(), picked.column("source").to_pylist()
    rows = picked.select(["messages", "answer", "key"]).to_pylist()
    for row in rows:
        row["prompt"] = row.pop("messages")
    detail = [details] * len(idx) if isinstance(details, str) else [details[i] for i in idx.tolist()]
    return [Reject(reason, d, s, p, r) for d, s, p, r in zip(detail, src, pos, rows, strict=True)]


def _canonical_record(
    rec: dict, cfg: DataConfig, ctx: _Context, fields: Sequence[str] | None = None
) -> tuple[dict | None, tuple[str, str] | None]:
    """One parsed record -> (row in canonical form, None) or (None, (reason, detail)). `fields`: the columns
    the row came with, named when a mapped one is missing (default: the record's keys)."""

    def text(value: Any, what: str) -> str:
        if isinstance(value, bytes):  # CSV columns arrive as bytes, so bad UTF-8 is this row's problem alone
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _RowError("invalid_utf8", f"{what}: byte {exc.start}: {exc.reason}") from None
        return value

    def missing(column: str) -> tuple[None, tuple[str, str]]:
        if rec.get(column, ...) is None:
            return None, ("missing_field", f"'{column}' is null")
        # Name what the row does have: a wrong column mapping shows at once.
        return None, (
            "missing_field",
            f"no '{column}' (the row has: {', '.join(map(str, fields or rec))[:200] or 'nothing'})",
        )

    try:
        prompt = text(rec.get(cfg.prompt_column), "prompt")
        answer = text(rec.get(cfg.answer_column), "answer")
        for value, column in ((prompt, cfg.prompt_column), (answer, cfg.answer_column)):
            if value is None:
                return missing(column)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            return None, ("wrong_type", f"'{cfg.answer_column}' is {json_kind(answer)}, not text or a number")
        system = text(rec.get(cfg.system_column), "system") if cfg.system_column else None
        if system is not None and not isinstance(system, str):
            return None, ("wrong_type", f"'{cfg.system_column}' is {json_kind(system)}, not text")
        system = system or cfg.system_prompt
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": ctx.prefix + prompt + ctx.suffix}]
            raw = prompt
        elif isinstance(prompt, list):
            for i, m in enumerate(prompt):
                if not isinstance(m, dict):
                    return None, ("wrong_type", f"'{cfg.prompt_column}' message {i} is {json_kind(m)}, not an object")
                for part in ("role", "content"):
                    if not isinstance(m.get(part), str):
                        return None, (
                            "wrong_type",
                            f"'{cfg.prompt_column}' message {i}: '{part}' is "
                            f"{json_kind(m.get(part)) if part in m else 'missing'}, not text",
                        )
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
            if not any(m["role"] == "user" for m in messages):
                return None, ("wrong_type", f"'{cfg.prompt_column}' has no user message")
            raw = "\n".join(m["content"] for m in messages if m["role"] != "system")
        else:
            return None, ("wrong_type", f"'{cfg.prompt_column}' is {json_kind(prompt)}, not text or a list of messages")
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        key = text(rec.get(cfg.key_column), "key") if cfg.key_column else None
        if cfg.key_column:
            if key is None:
                return missing(cfg.key_column)
            if isinstance(key, bool) or not isinstance(key, str | int):
                return None, ("wrong_type", f"'{cfg.key_column}' is {json_kind(key)}, not text or an integer")
        return {"messages": messages, "raw": raw, "answer": str(answer), "key": None if key is None else str(key)}, None
    except _RowError as exc:
        return None, (exc.reason, exc.detail)


class _RowError(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


def _mapped(cfg: DataConfig) -> list[str]:
    return [c for c in (cfg.prompt_column, cfg.answer_column, cfg.system_column, cfg.key_column) if c]


def _table_columns(table: pa.Table, cfg: DataConfig) -> dict[str, pa.Array] | None:
    """An Arrow batch's mapped columns as text, or None when the batch needs row-by-row care (a column
    missing, messages, nulls, types other than text and integers)."""
    if not set(_mapped(cfg)) <= set(table.column_names):
        return None
    try:
        columns = {
            "prompt": _as_text(table.column(cfg.prompt_column)),
            "answer": _as_text(table.column(cfg.answer_column), numbers=True),
            "system": _as_text(table.column(cfg.system_column)) if cfg.system_column else None,
            "key": _as_text(table.column(cfg.key_column), numbers=True) if cfg.key_column else None,
        }
    except _NotText:
        return None
    if any(columns[c] is not None and columns[c].null_count for c in ("prompt", "answer", "key")):
        return None  # missing values: the row-by-row path names each one
    return columns


def _record_columns(records: list[dict], cfg: DataConfig) -> tuple[dict[str, pa.Array], np.ndarray]:
    """The records whose mapped values are plain (prompt text; answer and key text or integers; system text or
    absent) as Arrow text columns, and the mask of those records. Python values decide, never an inferred
    Arrow type, so a row is read the same beside any neighbours."""
    prompts = [r.get(cfg.prompt_column) for r in records]
    answers = [r.get(cfg.answer_column) for r in records]
    plain = [type(p) is str and (type(a) is str or type(a) is int) for p, a in zip(prompts, answers, strict=True)]
    keys = systems = None
    if cfg.key_column:
        keys = [r.get(cfg.key_column) for r in records]
        plain = [ok and (type(k) is str or type(k) is int) for ok, k in zip(plain, keys, strict=True)]
    if cfg.system_column:
        systems = [r.get(cfg.system_column) for r in records]
        plain = [ok and (s is None or type(s) is str) for ok, s in zip(plain, systems, strict=True)]
    mask = np.array(plain, bool)

    def column(values: list | None, numbers: bool = False) -> pa.Array | None:
        if values is None:
            return None
        picked = [v for v, ok in zip(values, plain, strict=True) if ok]
        if numbers:
            picked = [v if type(v) is str else str(v) for v in picked]
        return pa.array(picked, pa.string())

    return {
        "prompt": column(prompts),
        "answer": column(answers, True),
        "system": column(systems),
        "key": column(keys, True),
    }, mask


def _plain_table(columns: dict[str, pa.Array | None], cfg: DataConfig, ctx: _Context) -> pa.Table:
    """Text columns (prompt, answer, system?, key?) built into canonical columns with Arrow kernels."""
    prompt, answer, system, key = columns["prompt"], columns["answer"], columns["system"], columns["key"]
    assert prompt is not None and answer is not None  # built for every plain row; system and key are optional
    n = len(prompt)
    content = pc.binary_join_element_wise(ctx.prefix, prompt, ctx.suffix, "") if ctx.prefix or ctx.suffix else prompt
    if system is None:
        system = (
            pa.nulls(n, pa.string()) if cfg.system_prompt is None else pa.array([cfg.system_prompt] * n, pa.string())
        )
    elif cfg.system_prompt is not None:
        system = pc.if_else(pc.or_kleene(pc.is_null(system), pc.equal(system, "")), cfg.system_prompt, system)
    has_system = pc.and_(pc.is_valid(system), pc.not_equal(system.fill_null(""), "")).to_numpy(zero_copy_only=False)
    has_system = has_system.astype(bool)
    counts = 1 + has_system.astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    take = np.empty(offsets[-1], np.int64)
    take[offsets[1:] - 1] = np.arange(n)
    take[offsets[:-1][has_system]] = n + np.flatnonzero(has_system)
    contents = pa.concat_arrays(
        [content.combine_chunks() if isinstance(content, pa.ChunkedArray) else content, system.fill_null("")]
    ).take(pa.array(take))
    role_idx = np.zeros(offsets[-1], np.int8)
    role_idx[offsets[:-1][has_system]] = 1
    roles = pa.array(["user", "system"]).take(pa.array(role_idx))
    messages = pa.ListArray.from_arrays(
        pa.array(offsets), pa.StructArray.from_arrays([roles, contents], fields=list(MESSAGE))
    )
    return pa.table(
        {
            "messages": messages,
            "raw": prompt,
            "answer": answer,
            "key": key if key is not None else pa.nulls(n, pa.string()),
        }
    )


class _NotText(Exception):
    pass


def _as_text(column: pa.ChunkedArray | pa.Array, numbers: bool = False) -> pa.Array:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr.cast(pa.string())
    if pa.types.is_null(arr.type):
        return arr.cast(pa.string())
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        try:
            return arr.cast(pa.string())  # validates UTF-8
        except pa.ArrowInvalid:
            raise _NotText from None
    if numbers and pa.types.is_integer(arr.type):
        return arr.cast(pa.string())
    raise _NotText


def canonical_batch(raw: RawBatch, cfg: DataConfig, ctx: _Context) -> tuple[pa.Table, list[Reject]]:
    """A batch as read -> canonical rows (pos, source, messages, raw, answer, key) and rejected rows.

    Plain rows are built with Arrow kernels; the others one by one by `_canonical_record`, which decides
    every row the fast path cannot take; both give a row the same outcome."""
    rejects = list(raw.rejects)
    positions = np.asarray(raw.positions, np.int64)
    parts = []
    columns: dict[str, pa.Array | None] | None
    if raw.records is not None:
        columns, plain = _record_columns(raw.records, cfg)
        records = [r for r, ok in zip(raw.records, plain, strict=True) if not ok]
        fields = None
    else:
        assert raw.table is not None  # a batch is a table or records
        columns = _table_columns(raw.table, cfg)
        plain = np.full(len(positions), columns is not None, bool)
        fields = raw.table.column_names
        records = [] if columns is not None else _records(raw.table.select([c for c in _mapped(cfg) if c in fields]))
    if plain.any():
        assert columns is not None  # rows are plain only where the columns were built
        parts.append(_with_position(_plain_table(columns, cfg, ctx), raw.source, positions[plain]))
    rows, kept_pos = [], []
    wanted = _mapped(cfg)
    for pos, rec in zip(positions[~plain].tolist(), records, strict=True):
        row, problem = _canonical_record(rec, cfg, ctx, fields)
        if problem:  # the mapped columns only: a huge or deep unused field stays out of the quarantine
            rejects.append(
                Reject(problem[0], problem[1], raw.source, pos, _jsonable({c: rec[c] for c in wanted if c in rec}))
            )
        else:
            rows.append(row)
            kept_pos.append(pos)
    if rows or not parts:
        table = (
            pa.Table.from_pylist(rows, schema=CANONICAL.remove(0).remove(0))
            if rows
            else CANONICAL.empty_table().drop(["pos", "source"])
        )
        parts.append(_with_position(table, raw.source, np.array(kept_pos, np.int64)))
    table = parts[0] if len(parts) == 1 else pa.concat_tables(parts).sort_by("pos")  # the rows in file order
    return table, rejects


def _with_position(table: pa.Table, source: str, positions: np.ndarray) -> pa.Table:
    table = table.add_column(0, "source", pa.array([source] * table.num_rows, pa.string()))
    table = table.add_column(0, "pos", pa.array(positions, pa.int64()))
    return table.select(CANONICAL.names).cast(CANONICAL)


def _records(table: pa.Table) -> list[dict]:
    """Rows as Python dicts; a column Arrow cannot turn into Python values (bad UTF-8) is read as bytes."""
    columns = {}
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
            columns[name] = col.to_pylist()
        else:
            try:
                columns[name] = col.to_pylist()
            except (UnicodeDecodeError, pa.ArrowInvalid):
                columns[name] = col.cast(pa.binary()).to_pylist()
    n = table.num_rows
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def _jsonable(rec: Any) -> Any:
    if isinstance(rec, dict):
        return {k: _jsonable(v) for k, v in rec.items()}
    if isinstance(rec, list):
        return [_jsonable(v) for v in rec]
    if isinstance(rec, bytes):
        return rec.decode("utf-8", "backslashreplace")
    return rec


def extract_answers(answers: pa.Array, cfg: DataConfig) -> pa.Array:
    """The part of each answer the rewards compare against; null where the extraction finds nothing.

    >>> extract_answers(pa.array(["so 1,080 in all\\n#### 1,080", "no marker"]), DataConfig(answer_extraction="gsm8k")).to_pylist()
    ['1080', None]
    """
    if cfg.answer_extraction == "none":
        out = pc.utf8_trim_whitespace(answers)
    else:
        pattern = _GSM8K if cfg.answer_extraction == "gsm8k" else cfg.answer_regex
        assert pattern is not None  # DataConfig requires answer_regex with answer_extraction=regex
        try:
            out = pc.struct_field(pc.extract_regex(answers, pattern), "answer")
        except pa.ArrowInvalid:  # a Python-only regex feature (e.g. lookbehind): match row by row
            compiled = re.compile(pattern)
            found = [compiled.search(a) for a in answers.to_pylist()]
            out = pa.array([m.group("answer") if m else None for m in found], pa.string())
        out = pc.utf8_trim_whitespace(out)
        if cfg.answer_extraction == "gsm8k":
            out = pc.replace_substring(out, ",", "")
    return pc.if_else(pc.equal(out, ""), pa.scalar(None, pa.string()), out)


def _unverifiable(answers: list[str], ctx: _Context) -> list[str | None]:
    """Per answer: why the rewards cannot check it, or None. Each answer-checking reward is offered the
    reference answer itself as the completion (in TRL's conversational format); it must score above 0."""
    why: list[str | None] = [None] * len(answers)
    completions = [[{"role": "assistant", "content": a}] for a in answers]
    for name, fn in ctx.verifiers.items():
        scores: list[float | str]
        try:
            scores = list(fn(completions, answer=answers))
        except Exception:  # find the rows that break it, one at a time
            scores = []
            for c, a in zip(completions, answers, strict=True):
                try:
                    scores.append(fn([c], answer=[a])[0])
                except Exception as exc:
                    scores.append(f"{type(exc).__name__}: {exc}")
        for i, s in enumerate(scores):
            if why[i] is None and (isinstance(s, str) or s is None or not s > 0):
                why[i] = f"reward '{name}' gives {s!r} to the answer {answers[i]!r} itself"
    return why


def validate(table: pa.Table, cfg: DataConfig, ctx: _Context) -> tuple[pa.Table, list[Reject]]:
    """Text with NUL, empty prompts, answers the extraction or the rewards cannot use."""
    rejects: list[Reject] = []
    messages = table.column("messages").combine_chunks()
    in_messages = pc.match_substring(messages.flatten().field("content"), "\x00").to_numpy(zero_copy_only=False)
    if in_messages.any() or pc.any(pc.match_substring(table.column("answer"), "\x00")).as_py():
        lengths = pc.list_value_length(messages).to_numpy(zero_copy_only=False)
        nul = np.bincount(np.repeat(np.arange(len(lengths)), lengths), weights=in_messages, minlength=len(lengths)) > 0
        nul |= pc.match_substring(table.column("answer"), "\x00").to_numpy(zero_copy_only=False).astype(bool)
        rejects += _reject_rows(table, nul, "nul_character", "U+0000 (NUL) in the prompt or the answer")
        table = table.filter(pa.array(~nul))
    empty = pc.equal(pc.utf8_trim_whitespace(table.column("raw")), "").to_numpy(zero_copy_only=False)
    rejects += _reject_rows(table, empty, "empty_prompt", "the prompt has no text")
    table = table.filter(pa.array(~empty))
    extracted = extract_answers(table.column("answer").combine_chunks(), cfg)
    failed = pc.is_null(extracted).to_numpy(zero_copy_only=False)
    how = {
        "none": "the answer is empty",
        "gsm8k": "no '#### <answer>' line in the answer",
        "regex": f"answer_regex {cfg.answer_regex!r} does not match",
    }[cfg.answer_extraction]
    rejects += _reject_rows(table, failed, "answer_extraction_failed", how)
    table = table.filter(pa.array(~failed))
    table = table.set_column(table.column_names.index("answer"), "answer", extracted.filter(pa.array(~failed)))
    if ctx.verifiers and table.num_rows:
        # Each distinct answer once: answers repeat a lot (GSM8K: ~50k rows, ~2k distinct answers).
        answers = pc.dictionary_encode(table.column("answer").combine_chunks())
        why_unique = _unverifiable(answers.dictionary.to_pylist(), ctx)
        index = answers.indices.to_numpy(zero_copy_only=False)
        bad = np.array([w is not None for w in why_unique], bool)[index] if len(why_unique) else np.zeros(0, bool)
        rejects += _reject_rows(
            table, bad, "answer_unverifiable", [why_unique[i] if b else "" for i, b in zip(index, bad, strict=True)]
        )
        table = table.filter(pa.array(~bad))
    return table, rejects


# ---------------------------------------------------------------- the chain


class _Chain:
    """Stateful, batch-at-a-time: what has been kept so far decides what a new row duplicates."""

    def __init__(self, cfg: DataConfig, ctx: _Context, tokens: PromptTokens | None, work: Path):
        self.cfg, self.ctx, self.tokens = cfg, ctx, tokens
        # 96-bit hashes of normalized prompts seen so far -> the kept row's key. With default keys (the
        # prompt's own hash) the key is implied, so a set of ints holds the same at a third of the memory.
        self.seen_text: dict[int, str] | set[int] = {} if cfg.key_column else set()
        self.seen_keys: set[str] = set()
        self.near = (
            NearDuplicateIndex(cfg.near_dup_threshold, cfg.near_dup_num_perm) if cfg.near_dup_threshold else None
        )
        self.reference: list[np.ndarray] = []
        self.dropped: Counter[str] = Counter()
        self.rows_read = 0
        self.kept: Counter[str] = Counter()
        self.work = work
        self.quarantine = (work / "quarantine.jsonl").open("wb")
        self.outputs = {s: (work / f"{s}.jsonl").open("wb") for s in ("val", "holdout")}
        self.pending_path = work / "train.pending.arrow"
        self.pending = pa.ipc.new_stream(str(self.pending_path), CANONICAL)

    def drop(self, rejects: list[Reject]) -> None:
        for r in rejects:
            self.dropped[r.reason] += 1
            self.quarantine.write(jsonl_line(r.as_dict()))

    def feed(self, raw: RawBatch) -> None:
        self.rows_read += len(raw.positions) + len(raw.rejects)
        table, rejects = canonical_batch(raw, self.cfg, self.ctx)
        self.drop(rejects)
        if table.num_rows:
            table, rejects = validate(table, self.cfg, self.ctx)
            self.drop(rejects)
        if table.num_rows:
            self._dedup_and_split(table)

    def _dedup_and_split(self, table: pa.Table) -> None:
        cfg = self.cfg
        norm = normalize(table.column("raw").combine_chunks()).to_pylist()
        keys = table.column("key").to_pylist()
        keep = np.ones(len(norm), bool)
        exact_detail: list[str] = [""] * len(norm)
        key_detail: list[str] = [""] * len(norm)
        for i, text in enumerate(norm):
            digest = hashlib.sha256(text.encode()).digest()
            if keys[i] is None:
                keys[i] = digest[:8].hex()  # the default key: the normalized prompt's hash
            text_id = int.from_bytes(digest[:12], "big")
            if text_id in self.seen_text:
                keep[i] = False
                first = self.seen_text[text_id] if isinstance(self.seen_text, dict) else keys[i]
                exact_detail[i] = f"same prompt as the kept row with key {first}"
            elif isinstance(self.seen_text, set):
                self.seen_text.add(text_id)
            elif keys[i] in self.seen_keys:
                keep[i] = False
                key_detail[i] = f"key {keys[i]} is already taken by a different prompt"
            else:
                self.seen_text[text_id] = keys[i]
                self.seen_keys.add(keys[i])
        table = table.set_column(table.column_names.index("key"), "key", pa.array(keys, pa.string()))
        exact = np.array([bool(d) for d in exact_detail])
        self.drop(_reject_rows(table, exact, "exact_duplicate", exact_detail))
        dup_key = np.array([bool(d) for d in key_detail])
        self.drop(_reject_rows(table, dup_key, "duplicate_key", key_detail))
        # Rows dropped from here on have registered their text and key: a later copy is still a duplicate
        # of a dropped row, which is what it is.
        table, keys = table.filter(pa.array(keep)), [k for k, ok in zip(keys, keep, strict=True) if ok]
        if self.tokens is not None and table.num_rows:
            high = cfg.max_prompt_tokens if cfg.max_prompt_tokens is not None else float("inf")
            low, up = self.tokens.lengths(table.column("messages").combine_chunks(), cfg.min_prompt_tokens, high)
            short, long = up < cfg.min_prompt_tokens, low > high
            self.drop(
                _reject_rows(
                    table,
                    short,
                    "too_few_tokens",
                    [f"at most {n} tokens, min_prompt_tokens={cfg.min_prompt_tokens}" for n in up],
                )
            )
            self.drop(
                _reject_rows(
                    table,
                    long,
                    "too_many_tokens",
                    [f"at least {n} tokens, max_prompt_tokens={cfg.max_prompt_tokens}" for n in low],
                )
            )
            ok = ~(short | long)
            table, keys = table.filter(pa.array(ok)), [k for k, o in zip(keys, ok, strict=True) if o]
        if self.near is not None and table.num_rows:
            gram, rows = ngram_hashes(words(table.column("raw").combine_chunks()), cfg.near_dup_ngram)
            found = self.near.check(gram, rows, table.num_rows, keys)
            near = np.array([f is not None for f in found])
            self.drop(
                _reject_rows(
                    table, near, "near_duplicate", [f"near duplicate of the kept row with key {f}" for f in found]
                )
            )
            table, keys = table.filter(pa.array(~near)), [k for k, f in zip(keys, found, strict=True) if f is None]
        if not table.num_rows:
            return
        split = np.array([split_of(k, cfg.holdout_share, cfg.val_share) for k in keys])
        for name in ("val", "holdout"):
            part = table.filter(pa.array(split == name))
            if part.num_rows:
                self._write(name, part)
                if cfg.contamination_threshold is not None:
                    gram, _ = ngram_hashes(words(part.column("raw").combine_chunks()), cfg.contamination_ngram)
                    self.reference.append(sorted_unique(gram))
        train = table.filter(pa.array(split == "train"))
        if train.num_rows:
            self.pending.write_table(train)

    def _write(self, split: str, table: pa.Table) -> None:
        out = self.outputs[split]
        # Flat columns to Python, rows assembled here: Arrow's to_pylist() on nested structs costs ~5x more.
        messages = table.column("messages").combine_chunks()
        offsets = messages.offsets.to_numpy().tolist()
        flat = messages.flatten()
        roles, contents = flat.field("role").to_pylist(), flat.field("content").to_pylist()
        answers, keys = table.column("answer").to_pylist(), table.column("key").to_pylist()
        out.writelines(
            jsonl_line(
                {
                    "prompt": [{"role": roles[j], "content": contents[j]} for j in range(offsets[i], offsets[i + 1])],
                    "answer": answers[i],
                    "key": keys[i],
                }
            )
            for i in range(len(answers))
        )
        self.kept[split] += table.num_rows

    def add_reference(self, texts: pa.Array) -> None:
        gram, _ = ngram_hashes(words(texts), self.cfg.contamination_ngram)
        self.reference.append(sorted_unique(gram))

    def finish(self) -> None:
        """Second pass: train rows against the holdout, val and evaluation n-grams, then written."""
        self.pending.close()
        reference = sorted_unique(np.concatenate(self.reference)) if self.reference else np.empty(0, np.uint64)
        self.reference = []
        self.outputs["train"] = (self.work / "train.jsonl").open("wb")
        cfg = self.cfg
        # Read, not memory-mapped: mapped pages would stay in this process's resident memory.
        with pa.OSFile(str(self.pending_path)) as source:
            for batch in pa.ipc.open_stream(source):
                table = pa.Table.from_batches([batch])
                if cfg.contamination_threshold is not None and len(reference):
                    gram, rows = ngram_hashes(words(table.column("raw").combine_chunks()), cfg.contamination_ngram)
                    share = overlap_fraction(gram, rows, table.num_rows, reference)
                    dirty = share >= cfg.contamination_threshold
                    self.drop(
                        _reject_rows(
                            table,
                            dirty,
                            "contaminated",
                            [
                                f"{s:.0%} of its {cfg.contamination_ngram}-grams appear in the holdout, val or eval sets"
                                for s in share
                            ],
                        )
                    )
                    table = table.filter(pa.array(~dirty))
                if table.num_rows:
                    self._write("train", table)
        self.pending_path.unlink()
        for f in (*self.outputs.values(), self.quarantine):
            f.close()


def _eval_texts(source: str, cfg: DataConfig, scratch: Path) -> Iterator[pa.Array]:
    """Prompt texts of an evaluation set, for decontamination only: rows without a usable prompt are skipped."""
    ctx = _Context(cfg.model_copy(update={"answer_extraction": "none", "answer_regex": None}), [])
    loose = cfg.model_copy(
        update={"answer_column": cfg.prompt_column, "system_column": None, "key_column": None, "source_format": "auto"}
    )
    for raw in iter_source(
        source,
        "auto",
        cfg.batch_rows,
        split=None,
        config=cfg.source_config,
        s3_endpoint_url=cfg.s3_endpoint_url,
        scratch=scratch,
    ):
        table, _ = canonical_batch(raw, loose, ctx)
        if table.num_rows:
            yield table.column("raw").combine_chunks()


def _demo_batches(cfg: DataConfig) -> Iterator[RawBatch]:
    splits = demo_rows(cfg.demo, cfg.holdout_share, cfg.val_share)
    records = [r for s in SPLITS for r in splits[s]]
    yield RawBatch("demo", list(range(len(records))), records=records)


def _effective(cfg: DataConfig) -> DataConfig:
    """With no source, the demo generator's rows and columns (its answers are plain integers)."""
    if cfg.source is not None:
        return cfg
    return cfg.model_copy(
        update={
            "prompt_column": "prompt",
            "answer_column": "answer",
            "system_column": None,
            "key_column": "key",
            "answer_extraction": "none",
            "answer_regex": None,
        }
    )


def token_bounds_apply(cfg: DataConfig) -> bool:
    """Whether the configured token bounds need the model's tokenizer: a maximum, or a minimum above one
    token (any prompt that passes the empty-prompt check has at least one).

    >>> token_bounds_apply(DataConfig()), token_bounds_apply(DataConfig(max_prompt_tokens=None))
    (True, False)
    """
    return cfg.max_prompt_tokens is not None or cfg.min_prompt_tokens > 1


def _bounds(cfg: DataConfig) -> str:
    return " and ".join(
        ([f"data.max_prompt_tokens={cfg.max_prompt_tokens}"] if cfg.max_prompt_tokens is not None else [])
        + ([f"data.min_prompt_tokens={cfg.min_prompt_tokens}"] if cfg.min_prompt_tokens > 1 else [])
    )


TOKENS_OFF = "--set data.max_prompt_tokens=null --set data.min_prompt_tokens=0"


def missing_tokenizer(cfg: DataConfig, why: str) -> ConfigError:
    """The error for token bounds that cannot be counted: what is set, why there is no tokenizer, the fixes."""
    return ConfigError(
        f"the token bounds ({_bounds(cfg)}) are counted in the model's own tokens, but {why}. Give the model's "
        "tokenizer (grpo-pipeline data --tokenizer DIR, a directory with tokenizer.json or tokenizer_config.json), "
        f"or drop the bounds ({TOKENS_OFF})"
    )


def _prompt_tokens(cfg: DataConfig, tokenizer_path: str | None) -> PromptTokens | None:
    """The token counter the bounds need; refuses (ConfigError) rather than skip a configured bound."""
    if not token_bounds_apply(cfg):
        return None
    if not tokenizer_path:
        raise missing_tokenizer(cfg, "no tokenizer was given")
    try:
        return PromptTokens(tokenizer_path)
    except (OSError, ValueError, TypeError) as exc:  # not a tokenizer directory, or a hub id off the hub
        raise missing_tokenizer(
            cfg,
            f"{tokenizer_path} does not load as one ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''})",
        ) from None


def run_chain(
    cfg: DataConfig,
    work: Path,
    tokenizer_path: str | None,
    rewards: Sequence[str],
    reward_args: RewardArgs | None = None,
) -> DataReport:
    """The whole chain into `work`: train/val/holdout.jsonl, quarantine.jsonl. Returns the report."""
    started = time.perf_counter()
    cfg = _effective(cfg)
    ctx = _Context(cfg, rewards, reward_args)
    tokens = _prompt_tokens(cfg, tokenizer_path)
    chain = _Chain(cfg, ctx, tokens, work)
    eval_rows = 0
    # The chain makes no reference cycles, but millions of small objects (dedup keys, rows) make the cyclic
    # collector rescan the live heap over and over (~15% of the time); it runs once at the end instead.
    collecting = gc.isenabled()
    gc.disable()
    try:
        batches = (
            _demo_batches(cfg)
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
                for texts in _eval_texts(source, cfg, work):
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
    checks = {
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
    return DataReport(
        source=cfg.source or "demo",
        rows_read=chain.rows_read,
        rows_kept=kept,
        splits={s: chain.kept[s] for s in SPLITS},
        dropped=dict(sorted(chain.dropped.items())),
        dropped_fraction=dropped / chain.rows_read if chain.rows_read else 0.0,
        max_dropped_fraction=cfg.max_dropped_fraction,
        checks=checks,
        eval_rows=eval_rows,
        seconds=round(time.perf_counter() - started, 3),
    )


# ---------------------------------------------------------------- versions: key, build, cache


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


def dataset_key(
    cfg: DataConfig, tokenizer_path: str | None, rewards: Sequence[str], reward_args: RewardArgs | None = None
) -> str:
    """A hash of everything the output depends on: input content, configuration, tokenizer, rewards and the
    answer checkers' arguments (the others' do not change a row), code."""
    # what the run does with a built version (skip it, train on its new rows) does not change the version
    built = cfg.model_dump(mode="json", exclude=set(RUN_FIELDS))
    digest = hashlib.sha256(orjson.dumps(built, option=orjson.OPT_SORT_KEYS))
    here = Path(__file__).parent
    digest.update("".join(file_digest(here / f) for f in _CODE_FILES).encode())
    digest.update(f"\0{_tokenizer_digest(tokenizer_path)}\0{list(rewards)}".encode())
    checker_args = {name: args for name, args in _verifier_args(rewards, reward_args).items() if args}
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


def _version_from(target: Path, key: str, report: DataReport) -> DatasetVersion:
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
    return _version_from(target, saved["key"], DataReport.model_validate(saved["report"]))


def build_dataset(
    cfg: DataConfig,
    out_dir: Path,
    tokenizer_path: str | None = None,
    rewards: Sequence[str] = ("correct_answer",),
    reward_args: RewardArgs | None = None,
) -> DatasetVersion:
    """Build (or find, when the same inputs were built before) a dataset version under out_dir/<key>.

    Raises ConfigError for a source that cannot be read or token bounds without a tokenizer,
    DataQualityError when more than `max_dropped_fraction` of the rows were dropped (the quarantine is then
    kept in out_dir/<key>.rejected). The version is written aside and renamed into place, so a failure
    leaves nothing half-written: the work directory goes on an exception, on SIGTERM or SIGHUP (see
    `_removed_on_exit`), and after a SIGKILL with the next build in the same out_dir.
    """
    out_dir = Path(out_dir)
    if token_bounds_apply(cfg) and not tokenizer_path:
        raise missing_tokenizer(cfg, "no tokenizer was given")
    for source in ([cfg.source] if cfg.source else []) + cfg.eval_sources:
        check_readable(source, cfg.s3_endpoint_url)
    key = dataset_key(cfg, tokenizer_path, rewards, reward_args)
    target = out_dir / key[:16]
    found = load_version(target)
    if found is not None:
        return found
    out_dir.mkdir(parents=True, exist_ok=True)
    _sweep_dead_work(out_dir)
    work = out_dir / f".{key[:16]}{_WORK_TAG}{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    with _removed_on_exit(work):
        report = run_chain(cfg, work, tokenizer_path, rewards, reward_args)
        (work / "report.json").write_bytes(orjson.dumps(report.model_dump(mode="json"), option=orjson.OPT_INDENT_2))
        if report.rows_read == 0:
            raise DataQualityError(f"data.source {cfg.source} holds no rows", report)
        if report.dropped_fraction > cfg.max_dropped_fraction:
            rejected = out_dir / f"{key[:16]}.rejected"
            shutil.rmtree(rejected, ignore_errors=True)
            for name in SPLITS:
                (work / f"{name}.jsonl").unlink(missing_ok=True)
            work.rename(rejected)
            worst = ", ".join(f"{r} {n}" for r, n in Counter(report.dropped).most_common(3))
            raise DataQualityError(
                f"{report.dropped_fraction:.1%} of {report.rows_read} rows were dropped ({worst}), more than "
                f"data.max_dropped_fraction={cfg.max_dropped_fraction}; see {rejected / 'quarantine.jsonl'} "
                "and fix the source or the column mapping (or raise the bound)",
                report,
            )
        version = _version_from(work, key, report)
        (work / "version.json").write_bytes(orjson.dumps({"key": key, "report": report.model_dump(mode="json")}))
        try:
            work.rename(target)
        except OSError:  # another run finished the same version first: theirs is identical
            pass
        return load_version(target) or version


_WORK_TAG = ".tmp-"  # out_dir/.<key>.tmp-<host>-<pid>: a build in progress


def _sweep_dead_work(out_dir: Path) -> None:
    """Remove work directories that builds on this host left when they were killed (SIGKILL, a crash)."""
    host = socket.gethostname()
    for path in out_dir.glob(f".*{_WORK_TAG}{host}-*"):
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
def _removed_on_exit(path: Path) -> Iterator[None]:
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
    from grpo_pipeline.tasks.model import resolve_base_model

    try:
        return resolve_base_model(model, data_dir / "models")
    except Exception as exc:  # a missing path, no network for the demo model's download, a bad GGUF file
        raise missing_tokenizer(
            data, f"model.base {base!r} could not be resolved here ({type(exc).__name__}: {str(exc)[:300]})"
        ) from None


# ---------------------------------------------------------------- daily retraining: what is new since the champion

RUN_FIELDS = (
    "skip_unchanged",
    "incremental",
    "replay_fraction",
    "drift_alert",
)  # DataConfig fields that do not shape a version
# What a configuration hash leaves out: where and how a run happens, not what it trains (docs/operations.md).
IDENTITY_FIELDS: dict[str, Any] = {
    "data_dir": True,
    "tracking": True,
    "deploy": True,
    "plan": True,
    "data": {"skip_unchanged": True, "drift_alert": True},
    "train": {"launcher": True, "sky": True, "checkpoint_uri": True, "s3_endpoint_url": True, "max_restarts": True},
}
SEEN_KEYS_FILE = "seen_keys.json"  # the train keys a registered version's lineage trained on (its register run)
HOLDOUT_KEYS_FILE = "holdout_keys.json"  # the holdout keys a registered version was judged on


def config_hash(cfg: PipelineConfig) -> str:
    """A hash of the configuration as it decides what trains and how the candidate is judged: every field but
    the run's identity and placement (`IDENTITY_FIELDS`: data_dir, tracking, deploy, plan, the launcher and
    the checkpoint store, data.skip_unchanged and data.drift_alert). Two runs with the same hash on the same rows train the same way.

    >>> from grpo_pipeline.configs.schema import load_config
    >>> config_hash(load_config(None, ["tracking.experiment=x", "train.launcher=sky"])) == config_hash(load_config(None))
    True
    >>> config_hash(load_config(None, ["train.grpo.learning_rate=1e-4"])) == config_hash(load_config(None))
    False
    """
    tree = cfg.model_dump(mode="json", exclude=IDENTITY_FIELDS)
    return hashlib.sha256(orjson.dumps(tree, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def split_keys(path: Path) -> list[str]:
    """The keys of a split file's rows, in order."""
    with Path(path).open("rb") as f:
        return [orjson.loads(line)["key"] for line in f if line.strip()]


def unchanged_reason(
    champion: str, tags: Mapping[str, str], fingerprint: str, cfg_hash: str, new_rows: int | None
) -> str | None:
    """Why a run may end after the data stage: the champion (version `champion`, its model-version `tags`) was
    trained with this configuration on these rows, or on a lineage that saw every train row there is now
    (`new_rows` 0; None when the lineage is unknown). None: something changed, so the run trains.

    >>> tags = {"dataset_fingerprint": "f1", "config_hash": "c1"}
    >>> unchanged_reason("3", tags, "f1", "c1", None)
    'champion v3 was trained on this dataset (fingerprint f1) with this configuration (hash c1): no new rows, nothing to train'
    >>> unchanged_reason("3", tags, "f1", "c2", None) is None, unchanged_reason("3", tags, "f2", "c1", 5) is None
    (True, True)
    """
    if tags.get("config_hash") != cfg_hash:
        return None
    if tags.get("dataset_fingerprint") == fingerprint:
        return (
            f"champion v{champion} was trained on this dataset (fingerprint {fingerprint}) with this configuration "
            f"(hash {cfg_hash}): no new rows, nothing to train"
        )
    if new_rows == 0:
        return (
            f"no train row of dataset {fingerprint} is new since champion v{champion} (its lineage trained on all "
            f"of them) and the configuration is the same (hash {cfg_hash}): nothing to train"
        )
    return None


def incremental_split(
    train: Path, seen: set[str], replay_fraction: float, salt: str, out: Path
) -> tuple[Path, int, int]:
    """`data.incremental`: the train split's new rows plus `replay_fraction` of the seen ones
    (`grpo_pipeline.tasks.data.splits.incremental_rows`, sampled by `salt`, the dataset's fingerprint), written to `out`; the version
    itself stays whole. Returns (path, new, replayed)."""
    with Path(train).open("rb") as f:
        rows = [orjson.loads(line) for line in f if line.strip()]
    picked, new, replayed = incremental_rows(rows, seen, replay_fraction, salt)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"".join(jsonl_line(r) for r in picked))
    return out, new, replayed


class _InputsCache(CachePolicy):
    """Prefect cache key = the version key, offered only while that version is on disk (a cached result
    that points at deleted files would be worse than rebuilding)."""

    def compute_key(
        self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        try:
            key = dataset_key(
                inputs["cfg"], inputs.get("tokenizer_path"), inputs.get("rewards") or (), inputs.get("reward_args")
            )
        except (DataSourceError, OSError, ValueError):
            return None  # the task itself reports the problem
        out_dir = Path(inputs["out_dir"])
        return f"data-{key}-{out_dir.resolve()}" if (out_dir / key[:16] / "version.json").is_file() else None


@task(name="data", cache_policy=_InputsCache(), persist_result=True)
def data_task(
    cfg: DataConfig,
    out_dir: Path,
    tokenizer_path: str | None,
    rewards: list[str],
    reward_args: RewardArgs | None = None,
) -> DatasetVersion:
    return build_dataset(cfg, out_dir, tokenizer_path, rewards, reward_args)


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
