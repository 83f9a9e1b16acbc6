"""`grpo-pipeline`: the console script. This module makes the command tree and holds the contract every command
keeps; each command group lives in a module of its own in this package: `run` (run, hpo), `plan`, `data`, `registry`
(registry, rollback, promote), `deploy`, `serve`, and the sub-apps `stack`, `rewards`, `ab`, `task`. `python -m
grpo_pipeline.cli` runs it too (`__main__.py`).

Exit codes (for CI): 0 completed; 1 the pipeline failed; 2 the configuration or an input is invalid
(unknown key, wrong type, missing model, unreachable or unwritable checkpoint store, no SkyPilot cloud);
3 the candidate was not promoted and --fail-on-reject was given; 4 the champion moved while the run was
deciding (another run promoted first): nothing was moved, run again.

Every command (`stack`, `deploy` and `rewards` included) fails the same way (`_fail`, grpo_pipeline/failure.py):
one paragraph on stderr that names the field or resource, what was found and the fix, and with --json (and
from `deploy`, whose stdout is JSON) the failure object {"status": "failed", "error", "exit_code"} as the last
line of stdout. `run` and `hpo` run the preflight checks before the flow starts, so a refused input leaves no
failed flow run behind; `stack up` checks its ports before it starts anything.

Every command module is imported here at start-up, so each command imports what it runs (flows, stages, the
registry, the stack) inside its function: `config` and `plan` load no torch and no Prefect (tests/unit/test_layers.py,
test_plan.py), and `--help` answers at once.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from typing import Annotated

import typer

from grpo_pipeline.cli import ab, data, deploy, plan, registry, rewards, run, serve, stack, task
from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.failure import EXIT_CHAMPION_MOVED, EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_REJECTED, Commands
from grpo_pipeline.loading import ConfigOpt, SetOpt, load

# the contract: the exit codes this docstring describes, defined once in failure.py
__all__ = ["EXIT_CHAMPION_MOVED", "EXIT_CONFIG", "EXIT_FAILED", "EXIT_OK", "EXIT_REJECTED", "app", "main"]

app = typer.Typer(
    cls=Commands,
    add_completion=False,
    no_args_is_help=True,
    help="GRPO fine-tuning pipeline.",
    context_settings={"help_option_names": ["-h", "--help"]},  # the sub-commands' contexts inherit it
)


def _print_version(asked: bool) -> None:
    if asked:
        print(f"grpo-pipeline {importlib.metadata.version('grpo-pipeline')}")  # the installed distribution's
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    # only the options above: every command is a sub-command
    ...


def show_config(config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """Print the resolved configuration (defaults + YAML + --set, `auto` as the source's answers choose it) as JSON."""
    _, cfg = load(config, overrides)
    if cfg.data.source is not None:
        from grpo_pipeline.tasks.data.shape import task_rewards

        try:
            cfg = task_rewards(cfg)
        except ConfigError as exc:  # shown as configured, with why the skill reward is not resolved
            print(f"train.rewards not resolved: {exc}", file=sys.stderr)
    print(cfg.model_dump_json(indent=2))


# The commands, in the order `--help` lists them
app.command()(run.run)
app.command()(registry.rollback)
app.command()(registry.promote)
app.command()(registry.registry)
app.command()(run.hpo)
app.command("plan")(plan.plan_cmd)
app.command("data")(data.data_cmd)
app.command("config")(show_config)
app.command("deploy")(deploy.deploy_cmd)
app.command()(serve.serve)
app.add_typer(stack.app, name="stack")
app.add_typer(rewards.app, name="rewards")
app.add_typer(ab.app, name="ab")
app.add_typer(task.app, name="task")


def summary(doc: str) -> str:
    """A command's line in a `-h` listing: its docstring's first sentence, on one line. Typer lists a command's
    whole first paragraph with the docstring's own line breaks, so the listing came out ragged and long.

    >>> summary("Serve the champion (see /v1/models). Exit 2: no champion;\\n    e.g. after a fresh clone.\\n\\nMore.")
    'Serve the champion (see /v1/models).'
    """
    return re.split(r"(?<=[.!?])\s+(?=[A-Z`])", " ".join(doc.split("\n\n")[0].split()))[0]


def _summarized(group: typer.Typer) -> None:
    for command in group.registered_commands:
        doc = command.help or (command.callback.__doc__ if command.callback else None)
        if command.short_help is None and doc:
            command.short_help = summary(doc)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _summarized(sub.typer_instance)


_summarized(app)  # once every command is registered


def main() -> None:  # pragma: no cover - `python -m grpo_pipeline.cli` (__main__.py)
    sys.exit(app())
