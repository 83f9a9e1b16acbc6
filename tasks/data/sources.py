"""Data sources for the data stage: where rows come from, read in bounded Arrow batches.

A source is a JSONL, Parquet or CSV file (or a glob or directory of them, local or `s3://`), a directory
written by `datasets.save_to_disk`, or a hub dataset id. Every reader yields `RawBatch`es of at most
`batch_rows` rows, so memory stays bounded however large the source is. A line or row that cannot be
read (not JSON, not UTF-8, too long, too deep: the rules are above `judge_line`) comes back as a `Reject`
with its position instead of stopping the read; a whole file that cannot be read raises `DataSourceError`.

One module, past the ~600 lines a module is cut at, on purpose: the readers and the line rules are one contract,
every reader yielding the `Reject`s the rules define, and `judge_line` is the JSON reader's inner loop. A module's
file is also part of every dataset version's key (`versions._CODE_FILES`).
"""

from __future__ import annotations

import csv
import glob
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import pyarrow as pa

from grpo_pipeline.configs.schema import ConfigError, DataConfig
from grpo_pipeline.trainer.s3 import s3_client

_FORMATS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
}
JSON_BLOCK_BYTES = 1 << 22  # JSONL is parsed in ~4 MiB blocks; a block never splits a line

DATA_EXTENSIONS = (".jsonl", ".json", ".ndjson", ".parquet", ".pq", ".csv", ".tsv")


def looks_local(source: str) -> bool:
    """A data source that must be on this machine: not s3://, not a hub id 'org/name'.

    >>> [looks_local(s) for s in ("data/train.jsonl", "openai/gsm8k", "s3://b/k.jsonl", "./gsm8k", "d/*.csv")]
    [True, False, False, True, True]
    """
    if "://" in source:
        return False
    data_file = source.lower().removesuffix(".gz").endswith(DATA_EXTENSIONS)
    hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", source) is not None
    return Path(source).expanduser().exists() or data_file or not hub_id or source.startswith((".", "~"))


def check_local_sources(data: DataConfig) -> None:
    """Fail early when a local data source (or an eval source) is not on this machine.

    Checked where the data stage runs (a worker), not when the configuration is parsed: the machine
    that writes or validates a config need not hold the data."""
    for field_name, sources in (
        ("data.source", [data.source] if data.source else []),
        ("data.eval_sources", data.eval_sources),
    ):
        for source in sources:
            path = str(Path(source).expanduser())
            if looks_local(source) and (hint := empty_folder_problem(source)):
                raise DataSourceError(f"{field_name}: {hint}")
            if looks_local(source) and not (glob.glob(path) if glob.has_magic(path) else Path(path).exists()):
                raise DataSourceError(
                    f"{field_name}: {source} does not exist; give a JSONL/Parquet/CSV file, a glob or directory of "
                    "them, a datasets.save_to_disk directory, s3://bucket/key or a hub id such as 'openai/gsm8k'"
                )


def empty_folder_problem(source: str) -> str | None:
    """What is wrong with a local source that names a folder (no data file extension, no glob) which does not exist
    or holds no data file yet, with where to put the rows: a growing source (a daily schedule's folder of dated files)
    starts out so. None for anything else (a file, a glob, a folder with files, a saved dataset).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> empty_folder_problem(str(folder / "daily")).startswith(f"{folder}/daily does not exist: create the folder")
    True
    >>> print(empty_folder_problem(str(folder)))  # doctest: +ELLIPSIS
    /... holds no .jsonl, .json, ... file yet: put the rows there, one JSONL file per day ..., e.g. /.../2026-12-07.jsonl
    >>> _ = (folder / "2026-12-07.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}')
    >>> empty_folder_problem(str(folder)) is None, empty_folder_problem(str(folder / "x.jsonl")) is None
    (True, True)
    """
    path = Path(source).expanduser()
    if glob.has_magic(str(path)) or source.lower().removesuffix(".gz").endswith(DATA_EXTENSIONS):
        return None
    example = path / "2026-12-07.jsonl"
    where = f"one JSONL file per day (a row per line: prompt, answer), e.g. {example}"
    if not path.exists():
        return (
            f"{source} does not exist: create the folder ({path.absolute()}) and put the rows there, {where}; "
            "or point data.source at your data"
        )
    if path.is_dir() and not is_datasets_dir(path) and not any(_is_data_file(p.name, "auto") for p in path.rglob("*")):
        return f"{source} holds no {', '.join(DATA_EXTENSIONS)} file yet: put the rows there, {where}"
    return None


class DataSourceError(ConfigError):
    """A source that cannot be found or read; the message names it and the fix."""


@dataclass
class Reject:
    """A row the stage drops, with why; one line of quarantine.jsonl."""

    reason: str
    detail: str
    source: str
    position: int
    row: Any = None

    def as_dict(self) -> dict:
        return {
            "reason": self.reason,
            "detail": self.detail,
            "source": self.source,
            "position": self.position,
            "row": self.row,
        }


@dataclass
class RawBatch:
    """Rows as read: an Arrow table (Parquet, CSV, datasets) or parsed records (JSON Lines, the demo)."""

    source: str
    positions: list[int] | Any  # line numbers (JSONL, CSV) or row numbers (Parquet, datasets)
    table: pa.Table | None = None
    records: list[Any] | None = None
    rejects: list[Reject] = field(default_factory=list)


@dataclass(frozen=True)
class SourceFile:
    uri: str  # local path or s3://bucket/key
    fmt: str  # jsonl | parquet | csv
    delimiter: str = ","


def format_of(name: str, declared: str = "auto") -> str:
    """The reader for a file: the declared format, or its extension's.

    >>> format_of("s3://b/train.jsonl.gz"), format_of("x.parquet"), format_of("x.txt", "csv")
    ('jsonl', 'parquet', 'csv')
    """
    if declared != "auto":
        return declared
    suffix = Path(name.lower().removesuffix(".gz")).suffix
    if suffix not in _FORMATS:
        raise DataSourceError(
            f"{name}: cannot tell the format from '{suffix or name}'; use one of {', '.join(DATA_EXTENSIONS)} "
            "or set data.source_format"
        )
    return _FORMATS[suffix]


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def is_datasets_dir(path: Path) -> bool:
    """A directory written by `datasets.save_to_disk` (a Dataset or a DatasetDict)."""
    return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json"))


def resolve_files(source: str, declared: str, s3: Any = None) -> list[SourceFile]:
    """The files a source names, in a stable order: a file, a glob, a directory, s3://bucket/key or a prefix/."""
    if source.startswith("s3://"):
        bucket, key = _split_s3(source)
        if key and not key.endswith("/"):
            return [SourceFile(source, format_of(key, declared), _delimiter(key))]
        keys = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
            keys += [o["Key"] for o in page.get("Contents", []) if _is_data_file(o["Key"], declared)]
        if not keys:
            raise DataSourceError(f"data.source: no data files under {source}; check the prefix and the extension")
        return [SourceFile(f"s3://{bucket}/{k}", format_of(k, declared), _delimiter(k)) for k in sorted(keys)]
    path = Path(source).expanduser()
    if glob.has_magic(str(path)):
        names = sorted(glob.glob(str(path), recursive=True))
    elif path.is_dir():
        names = sorted(str(p) for p in path.rglob("*") if p.is_file() and _is_data_file(p.name, declared))
    elif path.is_file():
        names = [str(path)]
    else:
        raise DataSourceError(
            f"data.source: {source} does not exist; give a file, a glob, a directory or s3://bucket/key"
        )
    if not names:
        raise DataSourceError(f"data.source: {source} holds no {', '.join(DATA_EXTENSIONS)} files")
    return [SourceFile(n, format_of(n, declared), _delimiter(n)) for n in names]


def _is_data_file(name: str, declared: str) -> bool:
    return declared != "auto" or name.lower().removesuffix(".gz").endswith(DATA_EXTENSIONS)


def _delimiter(name: str) -> str:
    return "\t" if name.lower().removesuffix(".gz").endswith(".tsv") else ","


# ---------------------------------------------------------------- content fingerprints (for the cache key)

_FILE_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, remembered per (path, size, mtime) within a process."""
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _FILE_DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
        _FILE_DIGESTS[memo] = digest.hexdigest()
    return _FILE_DIGESTS[memo]


def source_fingerprint(source: str, declared: str, s3_endpoint_url: str | None, extra: str = "") -> str:
    """A hash of what a source holds now: file bytes, S3 ETags, or a saved dataset's own fingerprints.

    A hub id is named, not hashed (its content cannot be read without downloading it).
    """
    digest = hashlib.sha256(f"{source}\0{declared}\0{extra}".encode())
    if source.startswith("s3://"):
        client = s3_client(s3_endpoint_url)
        for f in resolve_files(source, declared, client):
            bucket, key = _split_s3(f.uri)
            head = client.head_object(Bucket=bucket, Key=key)
            digest.update(f"{f.uri}\0{head['ETag']}\0{head['ContentLength']}\n".encode())
    elif not looks_local(source):
        digest.update(b"hub")
    elif is_datasets_dir(Path(source).expanduser()):
        root = Path(source).expanduser()
        for p in sorted(root.rglob("*")):
            if p.is_file():
                digest.update(f"{p.relative_to(root)}\0{file_digest(p)}\n".encode())
    else:
        for f in resolve_files(source, declared):
            digest.update(f"{f.uri}\0{file_digest(Path(f.uri))}\n".encode())
    return digest.hexdigest()


# ---------------------------------------------------------------- readers


def iter_source(
    source: str,
    declared: str,
    batch_rows: int,
    *,
    split: str | None = "train",
    config: str | None = None,
    s3_endpoint_url: str | None = None,
    scratch: Path | None = None,
) -> Iterator[RawBatch]:
    """Every row of a source, in bounded batches, in a stable order. `split` picks one split of a
    DatasetDict (a save_to_disk directory or a hub dataset); None reads them all (evaluation sets).
    S3 objects are downloaded one at a time into `scratch` (default: the system's temporary directory)."""
    if not looks_local(source) and not source.startswith("s3://"):
        for name, ds in _splits_of(_load_hub(source, config), split, source):
            yield from _iter_dataset(ds, name, batch_rows)
        return
    if looks_local(source) and is_datasets_dir(Path(source).expanduser()):
        from datasets import load_from_disk

        for name, ds in _splits_of(load_from_disk(str(Path(source).expanduser())), split, source):
            yield from _iter_dataset(ds, name, batch_rows)
        return
    client = s3_client(s3_endpoint_url) if source.startswith("s3://") else None
    for f in resolve_files(source, declared, client):
        with _local_copy(f.uri, client, scratch) as path:
            if f.fmt == "jsonl":
                yield from iter_jsonl(path, f.uri, batch_rows)
            elif f.fmt == "parquet":
                yield from iter_parquet(path, f.uri, batch_rows)
            else:
                yield from iter_csv(path, f.uri, batch_rows, f.delimiter)


@contextmanager
def _local_copy(uri: str, client: Any, scratch: Path | None = None) -> Iterator[Path]:
    """A local path for a file: itself, or an S3 object downloaded to a temporary file (removed after)."""
    if not uri.startswith("s3://"):
        yield Path(uri)
        return
    bucket, key = _split_s3(uri)
    fd, tmp = tempfile.mkstemp(suffix="-" + Path(key).name, dir=scratch)
    os.close(fd)
    try:
        try:
            client.download_file(bucket, key, tmp)
        except Exception as exc:
            raise DataSourceError(
                f"cannot read {uri} at {client.meta.endpoint_url}: {exc}; check the key, the "
                "credentials and data.s3_endpoint_url"
            ) from None
        yield Path(tmp)
    finally:
        os.unlink(tmp)


# ---------------------------------------------------------------- JSON Lines: one set of rules for every line
#
# Every line is judged alone, by the same rules in the same order, so a row's fate never depends on the rows
# around it or on the block it is read in:
#   1. a line is the bytes up to b"\n" (U+2028 and friends are characters; "\r\n" endings are fine);
#   2. a line longer than MAX_LINE_BYTES is `line_too_long`; it is skipped without being held in memory;
#   3. a blank line (ASCII whitespace only) is no row: it is neither counted nor quarantined;
#   4. a UTF-8 byte order mark at the start of a line is dropped (RFC 8259 section 8.1 lets a parser ignore
#      it; spreadsheet exports and Windows tools write one, and `cat` of two such files puts one mid-file);
#   5. bytes that are not UTF-8 are `invalid_utf8`; a file that starts with a UTF-16 or UTF-32 byte order
#      mark is refused whole (DataSourceError), since every line of it would be;
#   6. the line must be exactly one JSON value by RFC 8259 (orjson's strict parser): no NaN or Infinity,
#      no comments, no second value after the first, no raw control characters (a raw NUL byte included:
#      JSON text writes it as \u0000) -> otherwise `bad_json`, with the parser's message;
#   7. nesting deeper than MAX_DEPTH arrays and objects is `too_deep`, whatever field holds it;
#   8. the value must be an object -> otherwise `bad_json`;
#   9. a key given twice in one object: the last value counts (as JSON.parse, Python's json and jq read it).
# Text containing U+0000, from any format, is refused later by the stage (`nul_character`).
#
# Only orjson parses: Arrow's JSON reader recursed without bound on deep nesting (SIGSEGV near 17,500
# levels, superlinear time long before), read two objects on one line as two rows, accepted NaN and a BOM
# at the start of a block only, and typed values by their neighbours (ISO dates became timestamps, an
# integer beside a float became a float), so a row's outcome depended on the block it fell in.

MAX_LINE_BYTES = 16 << 20  # a row longer than this is refused (a long-context prompt of 128k tokens is ~0.5 MiB)
MAX_DEPTH = 64  # arrays and objects; a prompt in messages form is 3 deep
PREVIEW_CHARS = 2000  # of a refused line, in quarantine.jsonl
_BOM = b"\xef\xbb\xbf"
_WIDE_BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}


def _preview(line: bytes, total: int | None = None) -> str:
    """A refused line as text for the quarantine, cut to PREVIEW_CHARS (its length said when cut)."""
    total = len(line) if total is None else total
    text = line[: PREVIEW_CHARS * 4].decode("utf-8", "backslashreplace")
    return text if len(text) <= PREVIEW_CHARS and total == len(line) else f"{text[:PREVIEW_CHARS]}... ({total:,} bytes)"


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of arrays and objects (a scalar is 0), counted level by level without recursion; stops
    counting past `limit`.

    >>> _depth({"a": [1, {"b": []}]}, 64), _depth("text", 64), _depth([[[[]]]], 2)
    (4, 0, 3)
    """
    depth, level = 0, [value] if isinstance(value, dict | list) else []
    while level and depth <= limit:
        depth += 1
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, dict | list)]
    return depth


def judge_line(line: bytes, name: str, position: int) -> dict | Reject | None:
    """One JSON line by the rules above: its object, its Reject, or None for a blank line.

    >>> judge_line(b'\\xef\\xbb\\xbf{"q": "1 + 1"}', "f", 1)
    {'q': '1 + 1'}
    >>> judge_line(b'{"a": 1}{"b": 2}', "f", 2).reason, judge_line(b'[[[[1]]]]', "f", 3).reason
    ('bad_json', 'bad_json')
    >>> judge_line(b"   ", "f", 4) is None
    True
    """
    if len(line) > MAX_LINE_BYTES:
        return Reject(
            "line_too_long",
            f"{len(line):,} bytes; a row may hold at most {MAX_LINE_BYTES:,}",
            name,
            position,
            _preview(line),
        )
    if line.startswith(_BOM):
        line = line[3:]
    if not line.strip():
        return None
    try:
        record = orjson.loads(line)
        problem = None
    except orjson.JSONDecodeError as exc:
        record, problem = None, str(exc)
    if problem is not None:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Reject("invalid_utf8", f"byte {exc.start}: {exc.reason}", name, position, _preview(line))
        if "depth" in problem:  # orjson stops at 1024 levels, before any deeper recursion could
            return Reject(
                "too_deep",
                f"nested more than 1024 levels; at most {MAX_DEPTH} are read",
                name,
                position,
                _preview(line),
            )
        if b"\x00" in line:
            problem += (
                f"; a raw NUL byte at byte {line.index(0)} (JSON writes it as \\u0000; a UTF-16 file "
                "has one in every other byte: save it as UTF-8)"
            )
        return Reject("bad_json", problem, name, position, _preview(line))
    # An upper bound first: nesting needs an opening bracket per level.
    if line.count(b"{") + line.count(b"[") > MAX_DEPTH and _depth(record, MAX_DEPTH) > MAX_DEPTH:
        return Reject(
            "too_deep", f"nested more than {MAX_DEPTH} levels (arrays and objects)", name, position, _preview(line)
        )
    if not isinstance(record, dict):
        return Reject(
            "bad_json", f"a line must hold one JSON object, not {json_kind(record)}", name, position, _preview(line)
        )
    return record


def json_kind(value: Any) -> str:
    """A value's kind in JSON's words, for messages.

    >>> [json_kind(v) for v in (None, True, 3, 2.5, "x", [1], {})]
    ['null', 'true/false', 'an integer', 'a number with a fraction', 'text', 'an array', 'an object']
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    return {
        int: "an integer",
        float: "a number with a fraction",
        str: "text",
        list: "an array",
        dict: "an object",
        bytes: "bytes",
    }.get(type(value), type(value).__name__)


def _line_blocks(stream: IO[bytes], block_bytes: int, name: str) -> Iterator[tuple[bytes, int, list[Reject]]]:
    """(block of whole lines, its first line's number, lines refused for length) from a byte stream. A line
    longer than MAX_LINE_BYTES is skipped as it streams by, so memory stays bounded by one block and one line."""
    line_no, carry = 1, b""
    long: list | None = None  # [first line number, preview bytes, bytes so far] of a line being skipped
    while True:
        chunk = stream.read(block_bytes)
        if long is not None:
            cut = chunk.find(b"\n")
            if cut < 0 and chunk:
                long[2] += len(chunk)
                continue
            long[2] += cut if cut >= 0 else 0
            yield (
                b"",
                line_no,
                [
                    Reject(
                        "line_too_long",
                        f"{long[2]:,} bytes; a row may hold at most {MAX_LINE_BYTES:,}",
                        name,
                        line_no,
                        _preview(long[1], long[2]),
                    )
                ],
            )
            line_no += 1
            long = None
            if cut < 0:
                return
            chunk = chunk[cut + 1 :]
            if not chunk:
                continue
        data = carry + chunk
        if not chunk:
            if data:
                yield data, line_no, []
            return
        cut = data.rfind(b"\n")
        if cut < 0:
            block, carry = b"", data
        else:
            block, carry = data[: cut + 1], data[cut + 1 :]
        if block:
            yield block, line_no, []
            line_no += block.count(b"\n")
        if len(carry) > MAX_LINE_BYTES:
            long, carry = [line_no, carry[: PREVIEW_CHARS * 4], len(carry)], b""


def iter_jsonl(path: Path, name: str, batch_rows: int) -> Iterator[RawBatch]:
    """JSON Lines, each line judged alone (`judge_line`), in batches of at most `batch_rows` objects."""
    block_bytes = max(1 << 16, min(JSON_BLOCK_BYTES, batch_rows * 512))
    loads, limit = orjson.loads, MAX_DEPTH
    positions: list[int] = []
    records: list[Any] = []
    rejects: list[Reject] = []
    with pa.input_stream(str(path), compression="detect") as stream:
        for block, first, refused in _line_blocks(stream, block_bytes, name):
            if first == 1:
                for bom, encoding in _WIDE_BOMS.items():
                    if block.startswith(bom):
                        raise DataSourceError(
                            f"{name} is {encoding} text; JSON Lines must be UTF-8: save it as UTF-8 "
                            f"(e.g. iconv -f {encoding} -t UTF-8)"
                        )
            rejects += refused
            for i, line in enumerate(block.split(b"\n")):
                # The common case inline (one parse, a type check, a bracket count: nesting needs one bracket
                # per level), the same rules as judge_line, which takes every other line.
                try:
                    record = loads(line)
                except orjson.JSONDecodeError:
                    record = None
                if (
                    type(record) is not dict
                    or len(line) > MAX_LINE_BYTES
                    or (line.count(b"{") + line.count(b"[") > limit and _depth(record, limit) > limit)
                ):
                    record = judge_line(line, name, first + i)
                    if record is None:
                        continue
                    if isinstance(record, Reject):
                        rejects.append(record)
                        continue
                positions.append(first + i)
                records.append(record)
                if len(records) == batch_rows:
                    yield RawBatch(name, positions, records=records, rejects=rejects)
                    positions, records, rejects = [], [], []
    if records or rejects:
        yield RawBatch(name, positions, records=records, rejects=rejects)


def iter_parquet(path: Path, name: str, batch_rows: int) -> Iterator[RawBatch]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataSourceError(f"{name} is not a readable Parquet file: {exc}") from None
    row = 0
    batches = pf.iter_batches(batch_size=batch_rows)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:  # a corrupt page: Parquet cannot skip to the next row
            raise DataSourceError(f"{name}: cannot read past row {row}: {exc}; rewrite the file") from None
        if batch is None:
            return
        yield RawBatch(name, range(row, row + batch.num_rows), table=pa.Table.from_batches([batch]))
        row += batch.num_rows


def iter_csv(path: Path, name: str, batch_rows: int, delimiter: str = ",") -> Iterator[RawBatch]:
    """CSV streamed by Arrow; every column read as bytes so that invalid UTF-8 is one row's problem, and
    rows with the wrong number of fields rejected through Arrow's invalid-row handler."""
    import pyarrow.csv as pcsv

    bad_rows: list[Reject] = []

    def on_invalid(row: Any) -> str:  # pyarrow.csv.InvalidRow
        bad_rows.append(
            Reject(
                "bad_csv",
                f"expected {row.expected_columns} fields, got {row.actual_columns}",
                name,
                row.number or -1,
                row.text,
            )
        )
        return "skip"

    with pa.input_stream(str(path), compression="detect") as head:
        header = head.read(1 << 16).split(b"\n", 1)[0]
    # Arrow skips a UTF-8 byte order mark before the header, as spreadsheet exports write it; so do we.
    header_text = header.removeprefix(_BOM).decode("utf-8", "replace")
    columns = next(csv.reader(io.StringIO(header_text), delimiter=delimiter), [])
    twice = sorted({c for c in columns if columns.count(c) > 1})
    if twice:
        raise DataSourceError(
            f"{name}: the header names {', '.join(map(repr, twice))} more than once, so a column "
            "mapping could mean either; rename the duplicates"
        )
    try:
        reader = pcsv.open_csv(
            pa.input_stream(str(path), compression="detect"),
            read_options=pcsv.ReadOptions(block_size=max(1 << 16, batch_rows * 256)),
            parse_options=pcsv.ParseOptions(
                delimiter=delimiter, newlines_in_values=True, invalid_row_handler=on_invalid
            ),
            convert_options=pcsv.ConvertOptions(
                column_types={c: pa.binary() for c in columns}, strings_can_be_null=False
            ),
        )
    except pa.ArrowInvalid as exc:
        raise DataSourceError(f"{name} is not readable CSV: {exc}") from None
    row = 2  # line 1 is the header; positions are data lines, approximate when values span lines
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        except pa.ArrowInvalid as exc:  # e.g. a quote never closed: CSV cannot find the next row after it
            raise DataSourceError(
                f"{name}: cannot read past data line ~{row}: {exc}; a quoted value may be unterminated"
            ) from None
        table = pa.Table.from_batches([batch])
        yield RawBatch(name, range(row, row + table.num_rows), table=table, rejects=bad_rows[:])
        bad_rows.clear()
        row += table.num_rows
    if bad_rows:
        yield RawBatch(name, [], table=None, records=[], rejects=bad_rows[:])


def _splits_of(ds: Any, split: str | None, name: str) -> list[tuple[str, Any]]:
    """(name, Dataset) pairs: the one split asked for, or every split of a DatasetDict."""
    from datasets import DatasetDict

    if not isinstance(ds, DatasetDict):
        return [(name, ds)]
    if split is None:
        return [(f"{name}[{s}]", ds[s]) for s in sorted(ds)]
    if split not in ds:
        raise DataSourceError(f"data.source_split: {name} has splits {sorted(ds)}, not '{split}'")
    return [(name, ds[split])]


def _load_hub(name: str, config: str | None) -> Any:  # a datasets Dataset or DatasetDict
    from datasets import load_dataset

    try:
        return load_dataset(name, config)
    except Exception as exc:
        raise DataSourceError(
            f"data.source: cannot load '{name}' from the hub ({type(exc).__name__}: {str(exc)[:300]}); on a machine "
            "without hub access, save it elsewhere with datasets' save_to_disk (or as JSONL) and point data.source at it"
        ) from None


def _iter_dataset(ds: Any, name: str, batch_rows: int) -> Iterator[RawBatch]:
    """A `datasets.Dataset`'s Arrow table (memory-mapped), in batches; indices mappings applied."""
    table = ds.with_format("arrow")
    row = 0
    for start in range(0, len(ds), batch_rows):
        part = table[start : start + batch_rows]
        yield RawBatch(name, range(row, row + part.num_rows), table=part)
        row += part.num_rows


def check_readable(source: str, s3_endpoint_url: str | None) -> None:
    """Fail early, before any work, when an s3:// source cannot be listed with the credentials at hand."""
    if not source.startswith("s3://"):
        return
    bucket, key = _split_s3(source)
    client = s3_client(s3_endpoint_url)
    try:
        client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    except Exception as exc:
        raise DataSourceError(
            f"data.source: cannot list {source} at {client.meta.endpoint_url} ({exc}); check the bucket, the AWS "
            "credentials and data.s3_endpoint_url"
        ) from None
