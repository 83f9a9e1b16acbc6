"""Reading: each batch a source gives (`grpo_pipeline.tasks.data.sources`) into canonical rows (pos, source,
messages, raw prompt text, answer, key) and the rows that cannot be one, each with its reason (`canonical_batch`).
Plain rows are built with Arrow kernels, the others one by one; both give a row the same outcome. Also what the
stage reads besides its source: the demo task's rows (`demo_batches`) and the prompts of evaluation sets
(`eval_texts`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from grpo_pipeline.configs.data import ROW_FIELDS
from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ConfigError, DataConfig
from grpo_pipeline.tasks.data.demo_task import generate as demo_rows
from grpo_pipeline.tasks.data.sources import RawBatch, Reject, iter_source, json_kind
from grpo_pipeline.tasks.data.splits import SPLITS
from grpo_pipeline.trainer.rewards import (
    REWARDS,
    RUNNER_INPUTS,
    describe,
    optional_columns,
    required_columns,
    resolve_reward,
)
from grpo_pipeline.trainer.rewards import target as reward_function

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


CANONICAL = pa.schema(
    [
        ("pos", pa.int64()),
        ("source", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("raw", pa.string()),
        ("answer", pa.string()),
        ("key", pa.string()),
        ("extra", pa.string()),  # the other columns the rewards read (`RowContext.carried`), as one JSON object
    ]
)


def carried_columns(cfg: DataConfig, rewards: RewardSet | None) -> tuple[dict[str, str], frozenset[str]]:
    """The columns a row carries besides its prompt, answer and key: each reward's own columns (those it needs,
    and those it reads when present, such as `aliases`) and every column `data.columns` maps, as {the reward's
    name: the source's}; and the ones a reward cannot do without (a row lacking one is quarantined).

    >>> carried_columns(DataConfig(columns={"aliases": "also"}), RewardSet(names=("correct_answer",)))
    ({'aliases': 'also'}, frozenset())
    """
    names: dict[str, bool] = {}  # column -> required by some reward
    for name in rewards.names if rewards is not None else ():
        fn = reward_function(name)
        for column in required_columns(fn):
            names[column] = True
        bound = rewards.args_for(name) or {} if rewards is not None else {}
        for column in optional_columns(fn):
            if column not in bound:  # an argument given once for every row (label's labels) is no column
                names.setdefault(column, False)
    if runner := sorted(set(cfg.columns) & RUNNER_INPUTS):
        raise ConfigError(
            f"data.columns: {', '.join(runner)} is what the trainer passes a reward itself, never a data column; map "
            "the columns a reward reads from the rows (e.g. {aliases: other_answers})"
        )
    names.update({c: names.get(c, False) for c in cfg.columns})
    carried = {c: cfg.columns.get(c, c) for c in names if c not in ROW_FIELDS and c not in RUNNER_INPUTS}
    return carried, frozenset(c for c in carried if names[c])


def carried_value(value: Any) -> Any:
    """A carried column's value as the split files hold it: text, numbers, booleans and lists of text as they
    are; anything else (objects, nested or mixed lists) as its JSON text, so every row of a column has one type
    for the trainer's Arrow reader.

    >>> carried_value(["a", "b"]), carried_value({"x": 1}), carried_value([1, "a"]), carried_value(3)
    (['a', 'b'], '{"x":1}', '[1,"a"]', 3)
    """
    if isinstance(value, str | int | float | bool) or (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
    ):
        return value
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _kind(value: Any) -> str:
    return "a number" if isinstance(value, int | float) and not isinstance(value, bool) else json_kind(value)


def answer_text(answer: Any) -> str:
    """A reference answer as the rewards read it: text as it is, a number as written, an object or a list as its
    JSON (keys sorted: the same object is the same text).

    >>> answer_text(42), answer_text({"name": "Ann", "age": 34}), answer_text([1, 2])
    ('42', '{"age": 34, "name": "Ann"}', '[1, 2]')
    """
    if isinstance(answer, dict | list):
        import json  # ensure_ascii off and ", " separators: the text a model would write

        return json.dumps(answer, sort_keys=True, ensure_ascii=False)
    return str(answer)


def verifier_args(rewards: RewardSet | None) -> dict[str, dict[str, Any]]:
    """The answer-checking rewards of `rewards` (those that take the `answer` column, and the shipped ones that need
    another column of the row: `code_tests`' `tests`) and their configured arguments; none for None. The others are
    not resolved here: they judge no reference answer (a custom reward of other columns need not score one 1), and
    some need what only training offers (remote_verifier's service, a reward model)."""
    if rewards is None:
        return {}
    return {
        name: rewards.args_for(name) or {}
        for name in rewards.names
        if "answer" in (columns := describe(name)["columns"]) or (columns and name in REWARDS)
    }


class RowContext:
    """What the chain needs that comes from the configuration, resolved once."""

    def __init__(self, cfg: DataConfig, rewards: RewardSet | None):
        self.cfg = cfg
        prefix, _, suffix = cfg.prompt_template.partition("{prompt}")
        self.prefix, self.suffix = prefix, suffix
        self.carried, self.required = carried_columns(cfg, rewards)
        self.kinds: dict[str, str] = {}  # a carried column's type, set by the first row that has it
        self.rewards = rewards
        # bound with train.reward_args, as the trainer binds them: a checker's required argument is given,
        # and a row is kept or quarantined by the reward as configured
        self.verifiers = {name: resolve_reward(name, args) for name, args in verifier_args(rewards).items()}


def reject_rows(table: pa.Table, mask: np.ndarray, reason: str, details: Sequence[str] | str) -> list[Reject]:
    idx = np.flatnonzero(mask)
    if not len(idx):
        return []
    picked = table.take(pa.array(idx))
    pos, src = picked.column("pos").to_pylist(), picked.column("source").to_pylist()
    rows = picked.select(["messages", "answer", "key", "extra"]).to_pylist()
    for row in rows:
        row["prompt"] = row.pop("messages")
        row.update(orjson.loads(row.pop("extra") or "{}"))
    detail = [details] * len(idx) if isinstance(details, str) else [details[i] for i in idx.tolist()]
    return [Reject(reason, d, s, p, r) for d, s, p, r in zip(detail, src, pos, rows, strict=True)]


def _canonical_record(
    rec: dict, cfg: DataConfig, ctx: RowContext, fields: Sequence[str] | None = None
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
        if isinstance(answer, bool) or not isinstance(answer, str | int | float | dict):
            return None, (
                "wrong_type",
                f"'{cfg.answer_column}' is {json_kind(answer)}, not text, a number or a JSON object",
            )
        extra = {}
        for column, source in ctx.carried.items():
            value = text(rec.get(source), column)
            if value is None:
                if column in ctx.required:
                    return missing(source)
                continue
            kind = ctx.kinds.setdefault(column, _kind(value))  # as the source holds it: an object is no text
            if _kind(value) != kind:
                return None, (
                    "wrong_type",
                    f"'{source}' is {_kind(value)} here and {kind} in the rows before: one type per column",
                )
            extra[column] = carried_value(value)
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
        return {
            "messages": messages,
            "raw": raw,
            "answer": answer_text(answer),
            "key": None if key is None else str(key),
            "extra": orjson.dumps(extra).decode() if extra else None,
        }, None
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


def _plain_table(columns: dict[str, pa.Array | None], cfg: DataConfig, ctx: RowContext) -> pa.Table:
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
            "extra": pa.nulls(n, pa.string()),
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


def canonical_batch(raw: RawBatch, cfg: DataConfig, ctx: RowContext) -> tuple[pa.Table, list[Reject]]:
    """A batch as read -> canonical rows (pos, source, messages, raw, answer, key) and rejected rows.

    Plain rows are built with Arrow kernels; the others one by one by `_canonical_record`, which decides
    every row the fast path cannot take; both give a row the same outcome."""
    rejects = list(raw.rejects)
    positions = np.asarray(raw.positions, np.int64)
    parts = []
    columns: dict[str, pa.Array | None] | None
    wanted = _mapped(cfg) + [c for c in ctx.carried.values() if c not in _mapped(cfg)]
    if ctx.carried:  # the fast path builds the canonical columns alone: each row's other columns one by one
        columns, plain, fields = None, np.zeros(len(positions), bool), None
        if raw.records is not None:
            records = raw.records
        else:
            assert raw.table is not None  # a batch is a table or records
            fields = raw.table.column_names
            records = _records(raw.table.select([c for c in wanted if c in fields]))
    elif raw.records is not None:
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


def eval_texts(source: str, cfg: DataConfig, scratch: Path) -> Iterator[pa.Array]:
    """Prompt texts of an evaluation set, for decontamination only: rows without a usable prompt are skipped."""
    ctx = RowContext(cfg.model_copy(update={"answer_extraction": "none", "answer_regex": None}), None)
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


def demo_batches(cfg: DataConfig) -> Iterator[RawBatch]:
    splits = demo_rows(cfg.demo, cfg.holdout_share, cfg.val_share)
    records = [r for s in SPLITS for r in splits[s]]
    yield RawBatch("demo", list(range(len(records))), records=records)


def effective(cfg: DataConfig) -> DataConfig:
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
