"""How every `grpo-pipeline` command fails: one paragraph on stderr, and with --json the failure object as the
last stdout line. A module of its own so that `rewards` (a sub-app that `cli` imports) shares it without an
import cycle."""

from __future__ import annotations

import json
from typing import NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console

err = Console(stderr=True, soft_wrap=True)


def fail(as_json: bool, message: str, code: int, **extra) -> NoReturn:
    """The one way a command fails: the message on stderr (as written: no markup is read from it), and with
    --json the failure object {"status": "failed", "error", "exit_code"}, `extra` fields included, as the last
    line of stdout."""
    if as_json:
        print(json.dumps({"status": "failed", "error": message, "exit_code": code, **extra}), flush=True)
    err.print(message, style="red", markup=False, highlight=False)
    raise typer.Exit(code)


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
