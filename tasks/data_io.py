"""Data sources for the data stage: where rows come from, read in bounded Arrow batches.

A source is a JSONL, Parquet or CSV file (or a glob or directory of them, local or `s3://`), a directory
written by `datasets.save_to_disk`, or a hub dataset id. Every reader yields `RawBatch`es of at most
`batch_rows` rows, so memory stays bounded however large the source is. Lines that are not JSON, or
not UTF-8, come back as `Reject`s with their position instead of stopping the read.
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
from typing import Any

import orjson
import pyarrow as pa

from configs.schema import ConfigError, DataConfig

_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet",
            ".csv": "csv", ".tsv": "csv"}
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
    for field_name, sources in (("data.source", [data.source] if data.source else []),
                                ("data.eval_sources", data.eval_sources)):
        for source in sources:
            path = str(Path(source).expanduser())
            if looks_local(source) and not (glob.glob(path) if glob.has_magic(path) else Path(path).exists()):
                raise DataSourceError(
                    f"{field_name}: {source} does not exist; give a JSONL/Parquet/CSV file, a glob or directory of "
                    "them, a datasets.save_to_disk directory, s3://bucket/key or a hub id such as 'openai/gsm8k'"
                )


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
        return {"reason": self.reason, "detail": self.detail, "source": self.source, "position": self.position,
                "row": self.row}


@dataclass
class RawBatch:
    """Rows as read: an Arrow table (fast path) or parsed records (after a block needed line-by-line care)."""

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


def s3_client(endpoint_url: str | None):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url or None)


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def is_datasets_dir(path: Path) -> bool:
    """A directory written by `datasets.save_to_disk` (a Dataset or a DatasetDict)."""
    return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json"))


def resolve_files(source: str, declared: str, s3=None) -> list[SourceFile]:
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
        raise DataSourceError(f"data.source: {source} does not exist; give a file, a glob, a directory or s3://bucket/key")
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
    source: str, declared: str, batch_rows: int, *, split: str | None = "train", config: str | None = None,
    s3_endpoint_url: str | None = None,
) -> Iterator[RawBatch]:
    """Every row of a source, in bounded batches, in a stable order. `split` picks one split of a
    DatasetDict (a save_to_disk directory or a hub dataset); None reads them all (evaluation sets)."""
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
        with _local_copy(f.uri, client) as path:
            if f.fmt == "jsonl":
                yield from iter_jsonl(path, f.uri, batch_rows)
            elif f.fmt == "parquet":
                yield from iter_parquet(path, f.uri, batch_rows)
            else:
                yield from iter_csv(path, f.uri, batch_rows, f.delimiter)


@contextmanager
def _local_copy(uri: str, client) -> Iterator[Path]:
    """A local path for a file: itself, or an S3 object downloaded to a temporary file (removed after)."""
    if not uri.startswith("s3://"):
        yield Path(uri)
        return
    bucket, key = _split_s3(uri)
    fd, tmp = tempfile.mkstemp(suffix="-" + Path(key).name)
    os.close(fd)
    try:
        try:
            client.download_file(bucket, key, tmp)
        except Exception as exc:
            raise DataSourceError(f"cannot read {uri}: {exc}; check the key, the credentials and data.s3_endpoint_url") from None
        yield Path(tmp)
    finally:
        os.unlink(tmp)


def _arrow_json(block: bytes) -> pa.Table | None:
    """A block of JSON lines parsed by Arrow, or None when Arrow cannot take all of it as one table."""
    import pyarrow.json as pj

    try:
        block.decode("utf-8")  # Arrow's JSON reader does not check UTF-8 itself
        return pj.read_json(io.BytesIO(block), read_options=pj.ReadOptions(block_size=len(block) + 1))
    except (UnicodeDecodeError, pa.ArrowInvalid):
        return None


def iter_jsonl(path: Path, name: str, batch_rows: int) -> Iterator[RawBatch]:
    """JSON Lines in blocks: Arrow's JSON reader parses a clean block in C++; a block with a bad line,
    invalid UTF-8, blank lines or types that change between rows is parsed line by line instead, so
    each bad line is rejected alone and the rest of the block is kept.
    """
    block_bytes = max(1 << 16, min(JSON_BLOCK_BYTES, batch_rows * 512))
    line_no = 1
    with pa.input_stream(str(path), compression="detect") as stream:
        carry = b""
        while True:
            chunk = stream.read(block_bytes)
            data = carry + chunk
            if not chunk:
                block, carry = data, b""
            else:
                cut = data.rfind(b"\n")
                if cut < 0:
                    carry = data
                    continue
                block, carry = data[: cut + 1], data[cut + 1 :]
            if block.strip():
                n_lines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
                table = _arrow_json(block)
                # Arrow skips blank lines, so a row count short of the line count sends the block line by line
                # too, where positions stay exact.
                if table is not None and table.num_rows == n_lines:
                    for start in range(0, table.num_rows, batch_rows):
                        part = table.slice(start, batch_rows)
                        yield RawBatch(name, range(line_no + start, line_no + start + part.num_rows), table=part)
                else:
                    yield from _jsonl_line_by_line(block, name, line_no, batch_rows)
                line_no += n_lines
            if not chunk:
                break


def _jsonl_line_by_line(block: bytes, name: str, first_line: int, batch_rows: int) -> Iterator[RawBatch]:
    """Find the bad lines of a block one by one; the good ones still go to Arrow together when they can."""
    good: list[bytes] = []
    records: list[Any] = []
    positions: list[int] = []
    rejects: list[Reject] = []

    def batch() -> RawBatch:
        table = _arrow_json(b"\n".join(good))
        if table is not None and table.num_rows == len(good):
            return RawBatch(name, positions, table=table, rejects=rejects)
        return RawBatch(name, positions, records=records, rejects=rejects)

    for i, line in enumerate(block.split(b"\n")):
        if not line.strip():
            continue
        pos = first_line + i
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            rejects.append(Reject("invalid_utf8", f"byte {exc.start}: {exc.reason}", name, pos,
                                  line.decode("utf-8", "backslashreplace")))
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            rejects.append(Reject("bad_json", str(exc), name, pos, line.decode("utf-8")))
            continue
        if not isinstance(record, dict):
            rejects.append(Reject("bad_json", f"a line must hold a JSON object, not {type(record).__name__}",
                                  name, pos, record))
            continue
        good.append(line)
        records.append(record)
        positions.append(pos)
        if len(records) == batch_rows:
            yield batch()
            good, records, positions, rejects = [], [], [], []
    if records or rejects:
        yield batch()


def iter_parquet(path: Path, name: str, batch_rows: int) -> Iterator[RawBatch]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataSourceError(f"{name} is not a readable Parquet file: {exc}") from None
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows):
        yield RawBatch(name, range(row, row + batch.num_rows), table=pa.Table.from_batches([batch]))
        row += batch.num_rows


def iter_csv(path: Path, name: str, batch_rows: int, delimiter: str = ",") -> Iterator[RawBatch]:
    """CSV streamed by Arrow; every column read as bytes so that invalid UTF-8 is one row's problem, and
    rows with the wrong number of fields rejected through Arrow's invalid-row handler."""
    import pyarrow.csv as pcsv

    bad_rows: list[Reject] = []

    def on_invalid(row) -> str:
        bad_rows.append(Reject("bad_csv", f"expected {row.expected_columns} fields, got {row.actual_columns}",
                               name, row.number or -1, row.text))
        return "skip"

    with pa.input_stream(str(path), compression="detect") as head:
        header = head.read(1 << 16).split(b"\n", 1)[0].decode("utf-8", "replace")
    columns = next(csv.reader(io.StringIO(header), delimiter=delimiter), [])
    reader = pcsv.open_csv(
        pa.input_stream(str(path), compression="detect"),
        read_options=pcsv.ReadOptions(block_size=max(1 << 16, batch_rows * 256)),
        parse_options=pcsv.ParseOptions(delimiter=delimiter, newlines_in_values=True, invalid_row_handler=on_invalid),
        convert_options=pcsv.ConvertOptions(column_types={c: pa.binary() for c in columns}, strings_can_be_null=False),
    )
    row = 2  # line 1 is the header; positions are data lines, approximate when values span lines
    for batch in reader:
        table = pa.Table.from_batches([batch])
        yield RawBatch(name, range(row, row + table.num_rows), table=table, rejects=bad_rows[:])
        bad_rows.clear()
        row += table.num_rows
    if bad_rows:
        yield RawBatch(name, [], table=None, records=[], rejects=bad_rows[:])


def _splits_of(ds, split: str | None, name: str) -> list[tuple[str, Any]]:
    """(name, Dataset) pairs: the one split asked for, or every split of a DatasetDict."""
    from datasets import DatasetDict

    if not isinstance(ds, DatasetDict):
        return [(name, ds)]
    if split is None:
        return [(f"{name}[{s}]", ds[s]) for s in sorted(ds)]
    if split not in ds:
        raise DataSourceError(f"data.source_split: {name} has splits {sorted(ds)}, not '{split}'")
    return [(name, ds[split])]


def _load_hub(name: str, config: str | None):
    from datasets import load_dataset

    try:
        return load_dataset(name, config)
    except Exception as exc:
        raise DataSourceError(
            f"data.source: cannot load '{name}' from the hub ({type(exc).__name__}: {str(exc)[:300]}); on a machine "
            "without hub access, save it elsewhere with datasets' save_to_disk (or as JSONL) and point data.source at it"
        ) from None


def _iter_dataset(ds, name: str, batch_rows: int) -> Iterator[RawBatch]:
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
    try:
        s3_client(s3_endpoint_url).list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    except Exception as exc:
        raise ConfigError(
            f"data.source: cannot list {source} ({exc}); check the bucket, the AWS credentials and data.s3_endpoint_url"
        ) from None


