"""Every command the README and docs/ show exists as shown: each `grpo-pipeline <command> [<subcommand>]` answers
`-h` (in-process, through typer's CliRunner) and has every `--flag` the docs give it; each `python -m bench.<name>`
and `python -m bench <what>` answers `-h` with every flag the docs give it; each `make <target>` is a Makefile
target. A renamed command or flag fails here with the page that still shows the old one."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import runpy
import shlex
import sys
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"^--?[A-Za-z][\w-]*$")
# where one shell command ends and the next begins, inside a line of a code block or a backticked span
SEPARATORS = re.compile(r"&&|\|\||;|\$\(|\)|\"|\|(?=\s)|(?<=\s)\|")


def _commands(text: str) -> list[str]:
    """Each shell command of a page: code blocks' lines (continuations joined, comments dropped), and backticked
    spans of the prose; split at `&&`, `;`, `|` and `$(`."""
    out: list[str] = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            out += SEPARATORS.split(re.split(r"(?:^|\s)#", line, maxsplit=1)[0])
    prose = FENCE.sub("", text)
    for span in SPAN.findall(prose):
        out += SEPARATORS.split(span)
    return [c.strip() for c in out if c.strip()]


def _tokens(command: str) -> list[str]:
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote in a shortened example
        words = command.split()
    return [w.strip("[]") for w in words]


def _documented(program: re.Pattern[str]) -> dict[tuple[str, ...], dict[str, set[str]]]:
    """(the command's words after the program) -> {flag: the pages that show it with that command}, for every
    occurrence of the program; the words stop at the first flag, placeholder or value."""
    found: dict[tuple[str, ...], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for command in _commands(page.read_text()):
            words = _tokens(command)
            starts = [i for i, w in enumerate(words) if program.fullmatch(w)]
            if not starts:
                continue
            rest = words[starts[0] + 1 :]
            if rest and rest[0].startswith("<"):
                continue  # `grpo-pipeline <UTC date and time> ...`: a run's name, not a command
            path: list[str] = []
            for word in rest:
                if word.startswith("-") or not re.fullmatch(r"[a-z][\w|-]*", word):
                    break
                path.append(word)
            flags = {w.split("=")[0] for w in rest if FLAG.match(w.split("=")[0])}
            found[tuple(path)][""].add(name)
            for flag in flags:
                found[tuple(path)][flag].add(name)
    return found


# ------------------------------------------------------------------------------------------------ grpo-pipeline


def _app() -> typer.Typer:
    """The console script `grpo-pipeline` as pyproject.toml declares it, wherever its module lives."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["grpo-pipeline"]
    module, _, attr = target.partition(":")
    app = getattr(importlib.import_module(module), attr)
    assert isinstance(app, typer.Typer), f"{target} is the typer application"
    return app


def _is_group(command: Any) -> bool:
    return isinstance(getattr(command, "commands", None), dict)  # typer carries its own copy of click's classes


def _resolve(root: Any, words: tuple[str, ...]) -> tuple[list[str], Any, list[str]]:
    """The command the words name (subcommands followed while they exist), and the words left over (arguments,
    such as a reward's name after `rewards check`)."""
    path, command = [], root
    for i, word in enumerate(words):
        if not _is_group(command):
            return path, command, list(words[i:])
        # `ab status|decide`: each alternative must exist; the first is followed
        choices = word.split("|")
        missing = [c for c in choices if c not in command.commands]
        if missing:
            raise LookupError(f"`{' '.join(['grpo-pipeline', *path, word])}`: no command {missing}")
        path.append(choices[0])
        command = command.commands[choices[0]]
    return path, command, []


def _options(command: Any) -> set[str]:
    names = {"--help", "-h"}
    for param in command.params:
        names |= set(param.opts) | set(param.secondary_opts)
    return names


CLI = _documented(re.compile(r"(?:\S*/)?grpo-pipeline"))


def test_the_docs_show_commands():
    assert ("run",) in CLI and ("stack", "up") in CLI and len(CLI) > 10, "the parser finds the documented commands"


@pytest.mark.parametrize("words", sorted(CLI), ids=lambda w: " ".join(w) or "grpo-pipeline")
def test_each_documented_grpo_pipeline_command_exists_with_its_flags(words):
    app = _app()
    pages = sorted(CLI[words][""])
    try:
        path, command, _ = _resolve(typer.main.get_command(app), words)
    except LookupError as exc:
        pytest.fail(f"{exc}, shown in {pages}")
    result = CliRunner().invoke(app, [*path, "-h"], prog_name="grpo-pipeline")
    assert result.exit_code == 0, f"`grpo-pipeline {' '.join(path)} -h` failed: {result.output}"
    known = _options(command)
    if _is_group(command):  # flags given after a group's name belong to its subcommands
        for sub in command.commands.values():
            known |= _options(sub)
    wrong = {flag: sorted(p) for flag, p in CLI[words].items() if flag and flag not in known}
    assert wrong == {}, f"`grpo-pipeline {' '.join(path)}` has no such options (option: pages): {wrong}"


# ------------------------------------------------------------------------------------------------ bench


def _bench_commands() -> dict[str, dict[str, set[str]]]:
    """`python -m bench.<name>` -> {flag: pages}, from every page (the word after `-m`)."""
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for command in _commands(page.read_text()):
            words = _tokens(command)
            for i, word in enumerate(words[:-1]):
                if word == "-m" and words[i + 1].startswith("bench"):
                    module, rest = words[i + 1], words[i + 2 :]
                    if module == "bench" and rest and re.fullmatch(r"[a-z_]+", rest[0]):
                        module = f"bench {rest[0]}"
                    out[module][""].add(name)
                    for word in rest:
                        if FLAG.match(word.split("=")[0]):
                            out[module][word.split("=")[0]].add(name)
    return out


BENCH = _bench_commands()


def _help(module: str) -> str:
    """`python -m <module> -h`, run in this process: its help text."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, "-h"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
            if module == "bench":  # the suite's own parser (runpy would execute an imported __main__ again)
                importlib.import_module("bench.__main__").main(["-h"])
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = argv
    assert stop.value.code in (0, None), f"`python -m {module} -h` exited {stop.value.code}"
    return out.getvalue()


def test_the_docs_show_benchmarks():
    assert "bench.recipe_seeds" in BENCH and "bench table" in BENCH


@pytest.mark.parametrize("module", sorted(BENCH))
def test_each_documented_benchmark_command_exists_with_its_flags(module):
    pages = sorted(BENCH[module][""])
    if module.startswith("bench "):  # python -m bench <what>: a benchmark's name or one of the suite's words
        from bench.__main__ import available

        what = module.split()[1]
        assert what in {"all", "table", "list"} | {b.name for b in available()}, (
            f"`python -m {module}`, shown in {pages}: no such benchmark"
        )
        module = "bench"
    elif module != "bench":
        name = module.removeprefix("bench.")
        assert (ROOT / "bench" / f"{name}.py").is_file(), f"`python -m {module}`, shown in {pages}: no such module"
    text = _help(module)
    flags = {
        f: p for key, v in BENCH.items() for f, p in v.items() if f and (key == module or key.startswith(f"{module} "))
    }
    wrong = {
        flag: sorted(p) for flag, p in flags.items() if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
    }
    assert wrong == {}, f"`python -m {module} -h` does not list (option: pages): {wrong}"


# ------------------------------------------------------------------------------------------------ make


def test_each_documented_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    shown: dict[str, set[str]] = defaultdict(set)
    for page in PAGES:
        for command in _commands(page.read_text()):
            words = _tokens(command)
            for i, word in enumerate(words[:-1]):
                if word == "make" and re.fullmatch(r"[a-z][\w-]*", words[i + 1]):
                    shown[words[i + 1]].add(page.relative_to(ROOT).as_posix())
    assert {"demo", "test", "test-slow", "bench"} <= shown.keys()
    missing = {target: sorted(p) for target, p in shown.items() if target not in targets}
    assert missing == {}, f"the docs show make targets the Makefile lacks (target: pages): {missing}"
