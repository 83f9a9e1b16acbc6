"""The data stage against hostile input: every JSON line judged by one set of rules wherever it lands, bounded
nesting and line length, byte order marks, NUL, a configured token bound that must apply, and no work
directory left behind by a failure or a signal."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pytest

import grpo_pipeline.tasks.data.sources as data_io
from grpo_pipeline.configs.schema import ConfigError, DataConfig
from grpo_pipeline.tasks.data.sources import DataSourceError, iter_jsonl
from grpo_pipeline.tasks.data.stage import build_dataset
from tests.unit.test_data import VOCAB, question, read

ROOT = Path(__file__).resolve().parents[2]


def _prompt(rng: random.Random, tag: str) -> str:
    return f"{tag}: " + " ".join(rng.choice(VOCAB) for _ in range(20)) + "?"


def _nested(depth: int) -> bytes:
    """A JSON value `depth` arrays deep."""
    return b"[" * depth + b"]" * depth


def hostile_lines(rng: random.Random) -> dict[str, tuple[bytes, str]]:
    """name -> (one JSONL line, the outcome every block position must give it: 'kept' or a reason)."""

    def row(tag: str, **fields) -> bytes:
        return json.dumps({"id": tag, "prompt": _prompt(rng, tag), "answer": "7", **fields}).encode()

    def raw(tag: str, body: str) -> bytes:  # a line written by hand: the prompt left to the caller
        return body.replace("PROMPT", _prompt(rng, tag)).encode()

    deep_field = lambda tag, depth: row(tag).replace(b'"answer"', b'"x": ' + _nested(depth) + b', "answer"')  # noqa: E731
    return {
        "bom": (b"\xef\xbb\xbf" + row("bom"), "kept"),
        "crlf": (row("crlf") + b"\r", "kept"),
        "int-answer": (row("int-answer", answer=7), "kept"),
        "int-key": (raw("int-key", '{"id": 12345, "prompt": "PROMPT", "answer": "7"}'), "kept"),
        "messages": (
            json.dumps(
                {"id": "messages", "prompt": [{"role": "user", "content": _prompt(rng, "m")}], "answer": "7"}
            ).encode(),
            "kept",
        ),
        "duplicate-key": (
            raw("duplicate-key", '{"id": "duplicate-key", "prompt": "first", "prompt": "PROMPT", "answer": "7"}'),
            "kept",
        ),
        "depth-64": (deep_field("depth-64", 63), "kept"),  # the object itself is the first level
        "depth-65": (deep_field("depth-65", 64), "too_deep"),
        "depth-2500": (deep_field("depth-2500", 2500), "too_deep"),
        "depth-20000": (deep_field("depth-20000", 20_000), "too_deep"),  # Arrow's reader crashed (SIGSEGV)
        "braces-in-text": (row("braces-in-text", note="{[" * 200), "kept"),  # brackets inside a string: no depth
        "two-objects": (row("two-objects") + b'{"id": "second", "prompt": "x", "answer": "1"}', "bad_json"),
        "nan": (raw("nan", '{"id": "nan", "prompt": "PROMPT", "answer": NaN}'), "bad_json"),
        "trailing-comma": (
            raw("trailing-comma", '{"id": "trailing-comma", "prompt": "PROMPT", "answer": "7",}'),
            "bad_json",
        ),
        "raw-nul": (row("raw-nul").replace(b'"7"', b'"7\x00"'), "bad_json"),
        "escaped-nul": (row("escaped-nul").replace(b'"7"', b'"7\\u0000"'), "nul_character"),
        "lone-surrogate": (row("lone-surrogate").replace(b'"7"', b'"\\ud800"'), "bad_json"),
        "latin1": (row("latin1").replace(b"7", b"\xe9", 1), "invalid_utf8"),
        "array": (b'[{"id": "array", "prompt": "x", "answer": "7"}]', "bad_json"),
        "null-answer": (row("null-answer", answer=None), "missing_field"),
        "no-answer": (raw("no-answer", '{"id": "no-answer", "prompt": "PROMPT"}'), "missing_field"),
        "number-prompt": (raw("number-prompt", '{"id": "number-prompt", "prompt": 12, "answer": "7"}'), "wrong_type"),
        "date-answer": (row("date-answer", answer="2020-01-01"), "answer_unverifiable"),  # Arrow made it a timestamp
        "float-answer": (
            row("float-answer", answer=3.5),
            "answer_unverifiable",
        ),  # Arrow turned a neighbour's 7 into 7.0
        "bool-key": (raw("bool-key", '{"id": true, "prompt": "PROMPT", "answer": "7"}'), "wrong_type"),
        "long": (row("long", note="z" * 60_000), "line_too_long"),  # over the limit the test sets
    }


KEPT_AS = {"int-key": "12345"}  # the key a kept row is written with, where it is not its name


def _outcomes(
    path: Path, lines: list[bytes], names: list[str | None], out: Path, tiny_model: Path, batch_rows: int
) -> tuple[dict[str, str], dict]:
    """Build the dataset and say what happened to each named line (by its position in the file)."""
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(
        source=str(path),
        key_column="id",
        max_dropped_fraction=1.0,
        batch_rows=batch_rows,
        near_dup_threshold=None,
        contamination_threshold=None,
    )
    version = build_dataset(cfg, out, str(tiny_model))
    by_position = {q["position"]: q["reason"] for q in read(version.quarantine)}
    kept = {r["key"]: r for p in version.splits.values() for r in read(p)}
    outcome = {}
    for line_no, name in enumerate(names, start=1):
        if name is not None:
            outcome[name] = by_position.get(line_no, "kept" if KEPT_AS.get(name, name) in kept else "lost")
    return outcome, {"kept": kept, "report": version.report}


def test_a_rows_outcome_does_not_depend_on_its_block_or_neighbours(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setattr(data_io, "MAX_LINE_BYTES", 50_000)
    rng = random.Random(5)
    hostile = hostile_lines(rng)
    fillers = [
        json.dumps({"id": f"f{i}", "prompt": p, "answer": a}).encode()
        for i, (p, a) in enumerate(question(rng, i) for i in range(600))
    ]
    names = list(hostile)
    arrangements = {
        "first": [*names, *[None] * len(fillers)],
        "last": [*[None] * len(fillers), *names],
        "spread": [x for i, name in enumerate(names) for x in ([None] * 23 + [name])]
        + [None] * (600 - 23 * len(names)),
        "reversed-among-blanks": [x for name in reversed(names) for x in (None, "", name)]
        + [None] * (600 - len(names)),
    }
    seen = {}
    for label, layout in arrangements.items():
        for batch_rows in (64, 8192):  # 64 KiB blocks and batches of 64 rows; one 4 MiB block
            filler = iter(fillers)
            lines = [hostile[x][0] if x else (b"  \t" if x == "" else next(filler)) for x in layout]
            outcome, result = _outcomes(
                tmp_path / f"{label}-{batch_rows}.jsonl",
                lines,
                [x or None for x in layout],
                tmp_path / f"out-{label}-{batch_rows}",
                tiny_model,
                batch_rows,
            )
            seen[(label, batch_rows)] = outcome
            assert result["report"].rows_read == sum(1 for x in layout if x != ""), label  # blank lines are no rows
            assert result["kept"]["duplicate-key"]["prompt"][-1]["content"].startswith(
                "duplicate-key:"
            )  # the last wins
    expected = {name: want for name, (_, want) in hostile.items()}
    for key, outcome in seen.items():
        assert outcome == expected, (key, {n: (outcome[n], expected[n]) for n in expected if outcome[n] != expected[n]})


def test_deep_and_long_lines_are_refused_with_their_reason_while_streaming(tmp_path, monkeypatch):
    """A line longer than the limit is skipped as it streams by, never held: here one of 40 blocks' length
    with no newline before the end of the file, one just over the limit, and one in the middle of a block."""
    monkeypatch.setattr(data_io, "MAX_LINE_BYTES", 100_000)
    good = b'{"prompt": "p", "answer": "1"}'
    lines = [
        good,
        b'{"x": "' + b"a" * 100_001 + b'"}',
        good,
        b'{"x": ' + _nested(40_000) + b"}",
        good,
        b'{"x": "' + b"b" * 2_600_000 + b'"}',
        good,
        b'{"x": "' + b"c" * 2_600_000,
    ]  # the last: no newline, EOF
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines))
    batches = list(iter_jsonl(path, "d", 64))
    rejects = {r.position: (r.reason, r.detail) for b in batches for r in b.rejects}
    positions = [p for b in batches for p in b.positions]
    assert positions == [1, 3, 5, 7]
    assert {p: reason for p, (reason, _) in rejects.items()} == {
        2: "line_too_long",
        4: "too_deep",
        6: "line_too_long",
        8: "line_too_long",
    }
    assert f"{len(lines[5]):,} bytes" in rejects[6][1] and "100,000" in rejects[6][1]
    assert f"{len(lines[7]):,} bytes" in rejects[8][1] and f"{len(lines[1]):,} bytes" in rejects[2][1]
    assert all(len(r.row) < 3000 for b in batches for r in b.rejects)  # the quarantine holds a preview


def test_a_line_nested_deeper_than_the_parser_allows_is_too_deep(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "1", "x": ' + _nested(30_000) + b"}\n" + b"[" * 30_000 + b"\n")
    rejects = [r for b in iter_jsonl(path, "d", 64) for r in b.rejects]
    assert [(r.position, r.reason) for r in rejects] == [(1, "too_deep"), (2, "too_deep")]


def test_a_bom_on_the_first_line_is_dropped_in_jsonl_and_csv(tmp_path, tiny_model):
    rng = random.Random(6)
    rows = [{"prompt": p, "answer": a} for p, a in (question(rng, i) for i in range(20))]
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    buffer = pa.BufferOutputStream()
    pcsv.write_csv(pa.Table.from_pylist(rows), buffer)
    (tmp_path / "d.csv").write_bytes(b"\xef\xbb\xbf" + buffer.getvalue().to_pybytes())  # as spreadsheets export
    for name in ("d.jsonl", "d.csv"):
        version = build_dataset(DataConfig(source=str(tmp_path / name)), tmp_path / "out" / name, str(tiny_model))
        assert version.report.rows_kept == 20 and version.report.dropped == {}, (name, version.report.dropped)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_utf16_or_utf32_file_is_refused_whole_naming_the_fix(tmp_path, tiny_model, encoding):
    (tmp_path / "d.jsonl").write_bytes('{"prompt": "What is 1 + 1?", "answer": "2"}\n'.encode(encoding))
    with pytest.raises(DataSourceError, match=f"{encoding.upper()} text; JSON Lines must be UTF-8"):
        build_dataset(DataConfig(source=str(tmp_path / "d.jsonl")), tmp_path / "out", str(tiny_model))
    assert not list((tmp_path / "out").iterdir())  # nothing half-written


def test_csv_that_cannot_be_read_is_a_clear_error(tmp_path, tiny_model):
    (tmp_path / "twice.csv").write_text("prompt,answer,prompt\nWhat is 1 + 1?,2,x\n")
    with pytest.raises(DataSourceError, match="names 'prompt' more than once"):
        build_dataset(DataConfig(source=str(tmp_path / "twice.csv")), tmp_path / "out", str(tiny_model))
    (tmp_path / "quote.csv").write_text('prompt,answer\n"What is 1 + 1?,2\n' + "x,1\n" * 50_000)
    with pytest.raises(DataSourceError, match="quote.csv"):
        build_dataset(DataConfig(source=str(tmp_path / "quote.csv"), batch_rows=64), tmp_path / "out", str(tiny_model))
    assert not list((tmp_path / "out").iterdir())


def test_nul_is_refused_in_every_format_and_messages_name_null_and_kinds(tmp_path, tiny_model):
    (tmp_path / "d.csv").write_bytes(
        b"prompt,answer,id\nWhat is 1\x00 + 1?,2,a\nWhat is 2 + 2?,,b\nWhat is 3 + 3?,6,\n"
    )
    version = build_dataset(
        DataConfig(source=str(tmp_path / "d.csv"), key_column="id", max_dropped_fraction=1.0),
        tmp_path / "out",
        str(tiny_model),
    )
    found = {q["position"]: (q["reason"], q["detail"]) for q in read(version.quarantine)}
    assert found[2][0] == "nul_character"
    (tmp_path / "d.jsonl").write_text(
        '{"question": null, "answer": "1"}\n{"answer": "1", "id": 3}\n{"question": "q", "answer": [1]}\n'
        '{"question": "q2", "answer": "1", "id": null}\n{"question": "q3", "answer": "1", "id": 2.5}\n'
    )
    cfg = DataConfig(
        source=str(tmp_path / "d.jsonl"), prompt_column="question", key_column="id", max_dropped_fraction=1.0
    )
    details = [q["detail"] for q in read(build_dataset(cfg, tmp_path / "out2", str(tiny_model)).quarantine)]
    assert details == [
        "'question' is null",
        "no 'question' (the row has: answer, id)",
        "'answer' is an array, not text, a number or a JSON object",
        "'id' is null",
        "'id' is a number with a fraction, not text or an integer",
    ]


def test_a_configured_token_bound_applies_or_the_stage_refuses(tmp_path):
    """As on a fresh clone: no tokenizer on disk. The bound is not skipped: the stage refuses, names the fix."""
    rows = [{"prompt": "x " * 200_000, "answer": "1"}, {"prompt": "What is 1 + 1?", "answer": "2"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(source=str(tmp_path / "d.jsonl"), max_dropped_fraction=1.0)
    with pytest.raises(
        ConfigError, match=r"data\.max_prompt_tokens=512.*--tokenizer DIR.*data\.max_prompt_tokens=null"
    ):
        build_dataset(cfg, tmp_path / "out", None)
    with pytest.raises(ConfigError, match="does not load as one"):
        build_dataset(cfg, tmp_path / "out", str(tmp_path))  # a directory, but no tokenizer in it
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    off = build_dataset(cfg.model_copy(update={"max_prompt_tokens": None}), tmp_path / "out", None)
    assert off.report.rows_kept == 2 and off.report.checks["tokens"].startswith("off")


def test_grpo_pipeline_data_resolves_the_models_tokenizer_or_exits_2(tmp_path, tiny_model):
    from typer.testing import CliRunner

    from grpo_pipeline.cli import app

    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    args = [
        "data",
        "--json",
        "--out",
        str(tmp_path / "out"),
        "--set",
        f"data.source={tmp_path / 'd.jsonl'}",
        "--set",
        f"data_dir={tmp_path / 'data'}",
    ]
    for base, found in (
        ("/no/such/model", "could not be resolved here"),
        ("some-org/not-on-this-machine", "does not load"),
    ):
        result = CliRunner().invoke(app, [*args, "--set", f"model.base={base}"])
        assert result.exit_code == 2, result.output
        failure = json.loads(result.stdout.strip().splitlines()[-1])
        assert failure["status"] == "failed" and found in failure["error"] and "--tokenizer" in failure["error"]
    ok = CliRunner().invoke(app, [*args, "--set", f"model.base={tiny_model}"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["report"]["checks"]["tokens"].startswith(str(tiny_model))


_SLOW_BUILD = """
import signal, sys, time
from pathlib import Path
import grpo_pipeline.tasks.data.chain as chain
import grpo_pipeline.tasks.data.stage as data
from grpo_pipeline.configs.schema import DataConfig

# As in a terminal, whatever this test runs under (nohup, or a shell's background job ignoring SIGINT).
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)

real = chain.Chain.feed
def feed(self, raw):
    real(self, raw)
    Path(sys.argv[2]).write_text("working")
    time.sleep(600)  # until the signal
chain.Chain.feed = feed
data.build_dataset(DataConfig(source=sys.argv[1], max_prompt_tokens=None), Path(sys.argv[3]), None)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_no_work_directory_survives_a_signal(tmp_path, sig):
    rng = random.Random(7)
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in (question(rng, i) for i in range(50)))
    )
    marker, out = tmp_path / "marker", tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_SLOW_BUILD), str(tmp_path / "d.jsonl"), str(marker), str(out)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(3000):  # the build reaches its first batch at its own pace (a hang guard, not a timing)
            if marker.exists():
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        assert [p.name for p in out.iterdir() if ".tmp-" in p.name]  # the work directory, while it works
        proc.send_signal(sig)
        assert proc.wait(timeout=120) != 0
    finally:
        proc.kill()
    assert list(out.iterdir()) == []


def test_a_build_killed_outright_is_swept_by_the_next_one(tmp_path, tiny_model):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = out / f".0123456789abcdef.tmp-{socket.gethostname()}-{dead.pid}"  # what SIGKILL leaves
    (left / "train.pending.arrow").parent.mkdir(parents=True)
    (left / "train.pending.arrow").write_bytes(b"x")
    alive = out / f".0123456789abcdef.tmp-{socket.gethostname()}-{os.getpid()}"  # a build in progress: kept
    alive.mkdir()
    elsewhere = out / ".0123456789abcdef.tmp-another-host-1"  # another machine's: not ours to judge
    elsewhere.mkdir()
    build_dataset(DataConfig(source=str(tmp_path / "d.jsonl")), out, str(tiny_model))
    assert not left.exists() and alive.exists() and elsewhere.exists()
