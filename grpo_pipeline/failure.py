"""How every `grpo-pipeline` command fails: one paragraph on stderr, and with --json the failure object as the
last stdout line. A module of its own so that `rewards` (a sub-app that `cli` imports) shares it without an
import cycle."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from typer.core import TyperGroup

try:  # recent typer releases carry their own copy of click, and raise its exceptions
    from typer._click.exceptions import UsageError
except ImportError:
    from click import UsageError  # type: ignore[assignment]  # older typer: click's own class, the same role

# The exit codes of every command (grpo_pipeline/cli/__init__.py's docstring says what each means)
EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_REJECTED, EXIT_CHAMPION_MOVED = 0, 1, 2, 3, 4
err = Console(stderr=True, soft_wrap=True)


def fail(as_json: bool, message: str, code: int, **extra: object) -> NoReturn:
    """The one way a command fails: the message on stderr (as written: no markup is read from it), and with
    --json the failure object {"status": "failed", "error", "exit_code"}, `extra` fields included, as the last
    line of stdout."""
    if as_json:
        print(failure_line(message, code, **extra), flush=True)
    err.print(message, style="red", markup=False, highlight=False)
    raise typer.Exit(code)


def failure_line(message: str, code: int, **extra: object) -> str:
    """The failure object, one line of JSON.

    >>> failure_line("no such file", 2)
    '{"status": "failed", "error": "no such file", "exit_code": 2}'
    """
    return json.dumps({"status": "failed", "error": message, "exit_code": code, **extra})


class Commands(TyperGroup):
    """A command group whose usage errors (an option value of the wrong type, a missing option, an unknown
    command or option, at the root as in a command) end --json with the failure object too: click still prints
    its own message, which names the option, and exits 2. Usage errors of sub-groups (`rewards check`) pass
    through here as well."""

    args: list[str] = []

    def main(self, args: Sequence[str] | None = None, *rest: Any, **options: Any) -> Any:
        self.args = list(sys.argv[1:] if args is None else args)  # as click reads its arguments
        return super().main(args, *rest, **options)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with self._told():  # the root's own options: `grpo-pipeline --json --bogus`
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with self._told():  # the command's name, and the command's options
            return super().invoke(ctx)

    @contextmanager
    def _told(self) -> Iterator[None]:
        try:
            yield
        except UsageError as exc:
            if json_asked(self, self.args):
                print(failure_line(exc.format_message(), exc.exit_code), flush=True)
            raise


def json_asked(command: object, args: list[str]) -> bool:
    """Whether `args` give `--json` as an option: not as the value of an option that takes one
    (`--set --json`), nor as an argument after `--`. Options are looked up on the command the arguments name,
    through sub-groups; where there is none (an unknown command), a `--json` typed counts as asked.

    >>> from grpo_pipeline.cli import app
    >>> import typer
    >>> root = typer.main.get_command(app)
    >>> [json_asked(root, a.split()) for a in ("data --json", "data --set --json", "--json --bogus",
    ...                                        "nosuch --json", "plan -- --json", "rewards check x --json")]
    [True, False, True, True, False, True]
    """
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            return False
        if token == "--json":
            return True
        if token.startswith("-") and len(token) > 1:
            name = token.partition("=")[0] if token.startswith("--") else token[:2]
            attached = "=" in token if token.startswith("--") else len(token) > 2  # --set=x, -cfile
            option = _option(command, name)
            if option is not None and not (option.is_flag or option.count or attached):
                for _ in range(option.nargs):
                    next(tokens, None)  # its value, whatever it looks like
        elif command is not None and hasattr(command, "commands"):
            command = command.commands.get(token)  # the sub-command; None when there is no such command
    return False


def _option(command: object, name: str) -> Any:  # click's Option, from typer's copy of click or click's own
    for param in getattr(command, "params", ()):
        if param.param_type_name == "option" and name in (*param.opts, *param.secondary_opts):
            return param
    return None


def options_error(exc: ValidationError, flags: dict[str, str]) -> str:
    """A pydantic error on command options, told by the option a user typed rather than pydantic's report
    (model name, error URL): `--quant: Input should be 'none', 'nf4', 'fp4' or 'int8' (got 'nf5')`.

    >>> from pydantic import BaseModel
    >>> class M(BaseModel):
    ...     lora_rank: int
    >>> try:
    ...     M(lora_rank="x")
    ... except ValidationError as e:
    ...     print(options_error(e, {"lora_rank": "--lora-rank"}))
    --lora-rank: Input should be a valid integer, unable to parse string as an integer (got 'x')
    """
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        where = flags.get(field, f"--{field.replace('_', '-')}") if field else "options"
        shown = f" (got {error['input']!r})" if "input" in error and not isinstance(error["input"], dict) else ""
        lines.append(f"{where}: {error['msg'].removeprefix('Value error, ')}{shown}")
    return "\n".join(lines)
