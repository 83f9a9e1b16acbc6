"""SkyPilot's side of the launcher: run by the python of SkyPilot's own environment (.venv-sky, `make install`),
never imported by the pipeline's.

SkyPilot pins click<8.2 while current huggingface-hub needs a newer click, so SkyPilot cannot share the training
stack's environment. `grpo_pipeline.infra.launch.skypilot` runs this file as a script in that environment (isolated
mode: nothing of the caller's path leaks in). `serve` is one long-lived process for all calls (importing SkyPilot
takes seconds, so it is imported once): each request is one JSON line on standard input,
`{"command": ..., "request": {...}}` (secrets go there, never on a command line), each answer one JSON line on
standard output, `{"error": ...}` when SkyPilot raised. Any command also runs once on its own:
`python sky_driver.py COMMAND < request.json`. SkyPilot's own progress output goes to standard error, so it never
mixes with the answers; `logs`, run on its own, is the one command whose standard output is the job's log text
itself, streamed as it comes.

Only the standard library and SkyPilot are imported here (the pipeline's packages are not installed in that
environment), and SkyPilot only inside the commands, so the pipeline's test run can import this module for its
doctests without SkyPilot.
"""

from __future__ import annotations

import enum
import json
import sys
from collections.abc import Iterable
from typing import Any, cast


def _field(record: Any, name: str) -> Any:
    """A field of a SkyPilot record, whether it arrives as a dict or as a model object."""
    return record.get(name) if isinstance(record, dict) else getattr(record, name, None)


def _plain(value: Any) -> Any:
    """A JSON-safe copy: enums by value, mappings and sequences element by element, anything else as text.

    >>> import enum
    >>> class S(enum.Enum):
    ...     OK = "SUCCEEDED"
    >>> _plain({"s": S.OK, "n": (1, 2.5, None), "k": {3: True}})
    {'s': 'SUCCEEDED', 'n': [1, 2.5, None], 'k': {'3': True}}
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):  # ManagedJobStatus
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    return str(value)


def _task(request: dict) -> Any:  # a sky.Task
    import sky

    secrets = [(k, v) for k, v in (request.get("secrets") or {}).items()]
    return sky.Task.from_yaml_config(request["config"], secrets_overrides=secrets)


def task(request: dict) -> dict:
    """The task SkyPilot's parser makes of a config: the fields the launcher sets, read back."""
    t = _task(request)
    secrets = {k: getattr(v, "get_secret_value", lambda v=v: v)() for k, v in (t.secrets or {}).items()}
    return {
        "name": t.name,
        "num_nodes": t.num_nodes,
        "run": t.run,
        "envs": _plain(dict(t.envs or {})),
        "file_mounts": _plain(dict(t.file_mounts or {})),
        "secrets": {k: v for k, v in secrets.items() if v is not None},
        "resources": [
            {
                "accelerators": _plain(dict(r.accelerators or {})),
                "use_spot": bool(r.use_spot),
                "job_recovery": _plain(r.job_recovery or {}),
            }
            for r in t.resources
        ],
    }


def launch(request: dict) -> dict:
    """Submits the task as a managed job; its id."""
    import sky

    job_ids, _ = sky.stream_and_get(sky.jobs.launch(_task(request), name=request["name"]))
    if not job_ids:
        raise LookupError(f"SkyPilot accepted the managed job {request['name']} but returned no job id")
    return {"job_id": int(job_ids[0])}


def queue(request: dict) -> dict:
    """One managed job's record: the fields the launcher's state loop reads."""
    import sky

    records = sky.get(sky.jobs.queue(refresh=False, job_ids=[request["job_id"]]))
    records = records[0] if isinstance(records, tuple) else records
    if not records:
        raise LookupError(f"managed job {request['job_id']} is not in SkyPilot's queue")
    record = records[0]
    fields = ("status", "recovery_count", "failure_reason", "accelerators", "job_duration")
    return {name: _plain(_field(record, name)) for name in fields}


def logs(request: dict) -> dict:
    """The job's log text on standard output: followed across recoveries until the job ends, or its last lines."""
    import sky

    sky.jobs.tail_logs(
        job_id=request["job_id"],
        follow=bool(request.get("follow")),
        tail=request.get("tail"),
        output_stream=cast(Any, _ANSWER),
    )  # a text stream is what it writes to; typed narrower
    return {}


def cancel(request: dict) -> dict:
    import sky

    sky.get(sky.jobs.cancel(job_ids=[request["job_id"]]))
    return {}


def check(request: dict) -> dict:
    """Refreshes the clouds' credentials (starting a local API server if none runs); the clouds enabled."""
    from sky.client import sdk

    sdk.get(sdk.check(None, verbose=False))
    return {"enabled_clouds": _plain(sdk.get(sdk.enabled_clouds()))}


COMMANDS = {f.__name__: f for f in (task, launch, queue, logs, cancel, check)}
_ANSWER = sys.stdout  # the real standard output, kept before main() points sys.stdout at standard error


def answer(command: str, request: dict) -> dict:
    """A command's answer, or {"error": ...} with SkyPilot's message (the caller raises it in its environment).

    >>> answer("rm", {})
    {'error': "unknown command 'rm'"}
    """
    if command not in COMMANDS:
        return {"error": f"unknown command {command!r}"}
    try:
        return COMMANDS[command](request)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def serve(requests: Iterable[str]) -> None:
    """Answers each request line in turn, until standard input closes (the caller is done, or gone)."""
    for line in requests:
        if line.strip():
            message = json.loads(line)
            command = message.get("command")
            reply = (
                {"error": "logs streams: run it on its own"}
                if command == "logs"
                else answer(command, message.get("request") or {})
            )
            _ANSWER.write(json.dumps(reply) + "\n")
            _ANSWER.flush()


def main(argv: list[str]) -> int:
    global _ANSWER
    if len(argv) != 2 or argv[1] not in {*COMMANDS, "serve"}:
        print(f"usage: python sky_driver.py {{serve,{','.join(COMMANDS)}}} < request(s)", file=sys.stderr)
        return 2
    _ANSWER, sys.stdout = sys.stdout, sys.stderr  # SkyPilot's own prints must not reach the answers
    if argv[1] == "serve":
        serve(sys.stdin)
        return 0
    reply = answer(argv[1], json.load(sys.stdin))
    if argv[1] != "logs":
        _ANSWER.write(json.dumps(reply) + "\n")
    elif "error" in reply:  # the log text already went to standard output: the error goes beside SkyPilot's
        print(reply["error"], file=sys.stderr)
    _ANSWER.flush()
    return 1 if "error" in reply else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
