"""One error path for every command: bad configuration or input exits 2 with one message that names the field
or resource and the fix; with --json the last stdout line is the failure object; a --set error names the
--set; a preflight failure comes before any flow run; messages name the endpoint really used."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from grpo_pipeline.cli import EXIT_CONFIG, app


def _failure(result) -> dict:
    assert result.exit_code == EXIT_CONFIG, result.output
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert failure["status"] == "failed" and failure["exit_code"] == EXIT_CONFIG
    assert failure["error"] in result.stderr.replace("\n", " ") or failure["error"].splitlines()[0] in result.stderr
    return failure


@pytest.fixture
def no_flow_run(monkeypatch):
    """Fails the test if a flow starts: a refused input must leave no (failed) flow run behind."""
    import grpo_pipeline.flows.hpo
    import grpo_pipeline.flows.pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("a flow run was started")

    # what the CLI starts: the flows on the config it loaded and preflighted
    monkeypatch.setattr(grpo_pipeline.flows.pipeline, "checked_pipeline", refuse)
    monkeypatch.setattr(grpo_pipeline.flows.hpo, "checked_hpo", refuse)


@pytest.mark.parametrize(
    "command",
    [["run", "--json"], ["hpo", "--json"], ["data", "--json"], ["ab", "status", "--json"], ["ab", "decide", "--json"]],
)
@pytest.mark.parametrize(
    "assignment, says",
    [
        ("train.grpo.lerning_rate=1", "did you mean 'learning_rate'"),
        ("data.sorce=x.jsonl", "did you mean 'source'"),
        ("data.max_prompt_tokens=many", "valid integer"),
        ("notakeyvalue", "expected KEY=VALUE"),
        ("data.system_prompt=a: b: c", "not valid YAML"),
    ],
)
def test_a_bad_set_names_the_set_not_the_file(command, assignment, says, no_flow_run):
    failure = _failure(CliRunner().invoke(app, [*command, "--set", assignment]))
    assert failure["error"].startswith(f"--set {assignment}: ") and says in failure["error"]
    assert "demo-cpu.yaml" not in failure["error"]


def test_several_sets_that_fail_only_together_are_all_named(no_flow_run):
    failure = _failure(
        CliRunner().invoke(app, ["run", "--json", "--set", "data.holdout_share=0.7", "--set", "data.val_share=0.3"])
    )
    assert failure["error"].startswith("--set data.holdout_share=0.7 --set data.val_share=0.3 (together):")


def test_a_bad_config_file_is_named(tmp_path, no_flow_run):
    (tmp_path / "bad.yaml").write_text("train:\n  grpo: {max_steps: [}\n")
    for config, says in ((tmp_path / "missing.yaml", "not found"), (tmp_path / "bad.yaml", "is not valid YAML")):
        failure = _failure(CliRunner().invoke(app, ["run", "--json", "--config", str(config), "--set", "seed=1"]))
        assert str(config) in failure["error"] and says in failure["error"]


def test_a_preflight_failure_comes_before_any_flow_run(tmp_path, no_flow_run):
    for command in ("run", "hpo"):
        failure = _failure(
            CliRunner().invoke(
                app, [command, "--json", "--set", "model.base=/no/such/model", "--set", f"data_dir={tmp_path}"]
            )
        )
        assert "model.base: /no/such/model does not exist" in failure["error"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("through_env", [False, True])
def test_an_unreachable_store_names_the_endpoint_really_used(tmp_path, monkeypatch, no_flow_run, through_env):
    endpoint = "http://127.0.0.1:9"  # nothing listens there
    args = ["run", "--json", "--set", "train.checkpoint_uri=s3://ckpt/run", "--set", f"data_dir={tmp_path}"]
    if through_env:  # boto3 takes AWS_ENDPOINT_URL_S3 when train.s3_endpoint_url is unset (grpo-pipeline stack env)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    else:
        args += ["--set", f"train.s3_endpoint_url={endpoint}"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    failure = _failure(CliRunner().invoke(app, args))
    assert f"cannot write to s3://ckpt/run at {endpoint}" in failure["error"] and "AWS S3" not in failure["error"]
    assert "train.s3_endpoint_url" in failure["error"]  # the fix


def test_a_message_is_printed_as_written_not_read_as_markup(no_flow_run):
    result = CliRunner().invoke(app, ["data", "--json", "--set", "data.source=[/bold]"])
    failure = _failure(result)
    assert "[/bold]" in failure["error"] or "['/bold']" in failure["error"]
    assert failure["error"].splitlines()[0] in result.stderr


def test_commands_without_json_fail_the_same_way():
    result = CliRunner().invoke(app, ["promote", "--version", "1", "--reason", "x"])
    assert result.exit_code == EXIT_CONFIG and "pass --force" in result.stderr and result.stdout == ""
    result = CliRunner().invoke(app, ["config", "--set", "data.sorce=x"])
    assert result.exit_code == EXIT_CONFIG and result.stderr.startswith("--set data.sorce=x: data.sorce: unknown key")


@pytest.mark.parametrize("raised, code", [("config", 2), ("champion", 4), ("bug", 1)])
def test_errors_from_inside_the_flow_end_json_with_the_failure_object(tmp_path, monkeypatch, raised, code):
    import grpo_pipeline.flows.pipeline
    from grpo_pipeline.configs.schema import ConfigError
    from grpo_pipeline.tasks.promote.registry import ChampionMoved

    error = {
        "config": ConfigError("data.source: too much was dropped; fix the source"),
        "champion": ChampionMoved("the champion moved to v3 while this run decided; run again"),
        "bug": RuntimeError("something broke"),
    }[raised]

    def flow(*args, **kwargs):
        print("a line the flow printed")
        raise error

    monkeypatch.setattr(grpo_pipeline.flows.pipeline, "checked_pipeline", flow)
    result = CliRunner().invoke(app, ["run", "--json", "--set", f"data_dir={tmp_path}"])
    assert result.exit_code == code, result.output
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert failure == {
        "status": "failed",
        "exit_code": code,
        "error": str(error) if raised != "bug" else "RuntimeError: something broke",
    }


def test_an_unreadable_data_source_fails_the_data_command_the_same_way(tmp_path):
    (tmp_path / "d.jsonl").write_bytes('{"prompt": "1 + 1?", "answer": "2"}\n'.encode("utf-16"))
    failure = _failure(
        CliRunner().invoke(
            app,
            [
                "data",
                "--json",
                "--out",
                str(tmp_path / "out"),
                "--set",
                f"data.source={tmp_path / 'd.jsonl'}",
                "--set",
                "data.max_prompt_tokens=null",
            ],
        )
    )
    assert "UTF-16 text; JSON Lines must be UTF-8" in failure["error"]
    missing = _failure(CliRunner().invoke(app, ["data", "--json", "--set", f"data.source={tmp_path / 'none.jsonl'}"]))
    assert "data.source:" in missing["error"] and "does not exist" in missing["error"]


# --- every command, the same way -------------------------------------------------------------------------
# Each case: the arguments (built in tmp_path), what the message must say. Commands with --json (and deploy,
# whose stdout is its JSON summary) end stdout with the failure object; the others print nothing on stdout.


def _inputs(tmp_path):
    (tmp_path / "bad.yaml").write_text("gpus: [\n")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text("{")  # a stack state file cut short
    (tmp_path / "notjson.jsonl").write_text("completion: 4\n")
    (tmp_path / "rows.jsonl").write_text('{"completion": "4", "answer": "4"}\n')
    (tmp_path / "tabbed.yaml").write_text("train:\n\tgrpo: {}\n")
    (tmp_path / "rebooted").mkdir()
    mlflow = {"name": "mlflow", "pid": os.getpid(), "url": "http://127.0.0.1:9", "workdir": "w", "log": "l"}
    (tmp_path / "rebooted" / "state.json").write_text(  # this pid runs, but is not the process started at 0.0
        json.dumps({"services": {"mlflow": {**mlflow, "created": 0.0, "extra": {"auth": "basic"}}}})
    )
    return tmp_path


MLFLOW_DOWN = "tracking.mlflow_tracking_uri=http://127.0.0.1:9"  # nothing listens on port 9

JSON_CASES = {
    "plan: unknown model id": (["plan", "--model", "org/no-such-model"], "no model config for 'org/no-such-model'"),
    "plan: bad option value": (
        ["plan", "--model", "qwen2.5-7b", "--quant", "nf5"],
        "--quant: Input should be 'none', 'nf4'",
    ),
    "plan: bad catalog YAML": (
        ["plan", "--model", "qwen2.5-7b", "--catalog", "{tmp}/bad.yaml"],
        "GPU catalog {tmp}/bad.yaml cannot be read",
    ),
    "plan: missing catalog": (
        ["plan", "--model", "qwen2.5-7b", "--catalog", "{tmp}/none.yaml"],
        "{tmp}/none.yaml not found",
    ),
    "plan: unknown GPU": (["plan", "--model", "qwen2.5-7b", "--gpus", "NOPE"], "GPU 'NOPE' is not in the catalog"),
    "plan: bad --set": (["plan", "--set", "data.sorce=x"], "--set data.sorce=x: data.sorce: unknown key"),
    "plan: over budget": (["plan", "--model", "qwen2.5-7b", "--budget", "0.01"], "exceeds plan.budget_usd = $0.01"),
    "data: missing config": (["data", "--config", "{tmp}/none.yaml"], "config file {tmp}/none.yaml not found"),
    "run: unknown model": (
        ["run", "--set", "model.base=/no/such/model", "--set", "data_dir={tmp}/d"],
        "model.base: /no/such/model does not exist",
    ),
    "hpo: bad --set": (["hpo", "--set", "hpo.trials=0"], "--set hpo.trials=0: hpo.trials"),
    "rewards check: unknown reward": (
        ["rewards", "check", "no_such_reward", "--input", "{tmp}/rows.jsonl"],
        "no_such_reward",
    ),
    "rewards check: missing file": (
        ["rewards", "check", "math_answer", "--input", "{tmp}/none.jsonl"],
        "--input {tmp}/none.jsonl: no such file",
    ),
    "rewards check: not JSON": (
        ["rewards", "check", "math_answer", "--input", "{tmp}/notjson.jsonl"],
        "notjson.jsonl:1: not JSON",
    ),
    "rewards check: bad --arg": (
        ["rewards", "check", "math_answer", "--input", "{tmp}/rows.jsonl", "--arg", "x"],
        "--arg 'x': expected KEY=VALUE",
    ),
}
JSON_ALWAYS = {  # deploy prints its summary as JSON on stdout without being asked, so its failure too
    "deploy: bad --set": (["deploy", "--set", "data.sorce=x"], "--set data.sorce=x: data.sorce: unknown key"),
    "deploy: bad option value": (
        ["deploy", "--timezone", "Mars/Olympus"],
        "--timezone: unknown time zone 'Mars/Olympus'",
    ),
    "deploy: missing config": (["deploy", "--config", "{tmp}/none.yaml"], "config file {tmp}/none.yaml not found"),
}
PLAIN_CASES = {
    "config: missing file": (["config", "--config", "{tmp}/none.yaml"], "config file {tmp}/none.yaml not found"),
    "config: a directory": (["config", "-c", "{tmp}"], "config {tmp} is a directory, not a YAML file"),
    "config: tab-indented": (
        ["config", "-c", "{tmp}/tabbed.yaml"],
        "line 2 is indented with a tab: indent with spaces",
    ),
    "registry: MLflow down": (["registry", "--set", MLFLOW_DOWN], "MLflow at http://127.0.0.1:9 does not answer"),
    "rollback: MLflow down": (
        ["rollback", "--reason", "x", "--set", MLFLOW_DOWN],
        "MLflow at http://127.0.0.1:9 does not answer",
    ),
    "promote: MLflow down": (
        ["promote", "--version", "1", "--reason", "x", "--force", "--set", MLFLOW_DOWN],
        "MLflow at http://127.0.0.1:9 does not answer",
    ),
    "promote: no --force": (["promote", "--version", "1", "--reason", "x"], "pass --force to confirm"),
    "stack status: bad state": (
        ["stack", "status", "--dir", "{tmp}/state"],
        "{tmp}/state/state.json is not valid JSON",
    ),
    "stack env: bad state": (["stack", "env", "--dir", "{tmp}/state"], "{tmp}/state/state.json is not valid JSON"),
    "stack env: no stack": (
        ["stack", "env", "--dir", "{tmp}/none"],
        "no stack runs under {tmp}/none: start one with `grpo-pipeline stack up --dir {tmp}/none`",
    ),
    "stack env: every service stopped": (  # a state file left by a reboot: its processes are gone
        ["stack", "env", "--dir", "{tmp}/rebooted"],
        "no stack runs under {tmp}/rebooted: start one with `grpo-pipeline stack up --dir {tmp}/rebooted`",
    ),
    "stack down: bad state": (["stack", "down", "--dir", "{tmp}/state"], "{tmp}/state/state.json is not valid JSON"),
}


def _args(args, tmp_path):
    return [a.replace("{tmp}", str(tmp_path)) for a in args]


def _one_paragraph_on_stderr(result, says):
    assert result.exit_code == EXIT_CONFIG, (result.exit_code, result.output)
    assert says in result.stderr.replace("\n", " ") or says in result.stderr
    assert "Traceback" not in result.stderr and "errors.pydantic.dev" not in result.stderr


@pytest.mark.parametrize("case", [*JSON_CASES, *JSON_ALWAYS])
def test_every_json_command_fails_with_exit_2_the_message_and_the_failure_object_last(case, tmp_path, no_flow_run):
    args, says = JSON_CASES.get(case) or JSON_ALWAYS[case]
    args, says = _args(args, _inputs(tmp_path)), says.replace("{tmp}", str(tmp_path))
    result = CliRunner().invoke(app, [*args, *(["--json"] if case in JSON_CASES else [])])
    _one_paragraph_on_stderr(result, says)
    failure = _failure(result)
    assert says in failure["error"]


@pytest.mark.parametrize("case", PLAIN_CASES)
def test_every_other_command_fails_with_exit_2_and_the_message_alone(case, tmp_path):
    args, says = PLAIN_CASES[case]
    result = CliRunner().invoke(app, _args(args, _inputs(tmp_path)))
    _one_paragraph_on_stderr(result, says.replace("{tmp}", str(tmp_path)))
    assert result.stdout == ""


def test_a_refused_plan_ends_json_with_the_refusal_carrying_the_plan():
    result = CliRunner().invoke(app, ["plan", "--model", "qwen2.5-7b", "--budget", "0.01", "--json"])
    failure = _failure(result)
    assert result.stdout.strip().count("\n") == 0  # the refusal alone: no plan JSON before it
    assert failure["plan"]["model"] == "qwen2.5-7b" and failure["plan"]["estimate"]["usd"] > 0.01


def test_deploy_names_the_prefect_server_it_could_not_reach(tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        result = CliRunner().invoke(app, ["deploy", "--set", f"data_dir={tmp_path}"])
    failure = _failure(result)
    assert "the Prefect server at PREFECT_API_URL=http://127.0.0.1:9/api does not answer" in failure["error"]
    assert "grpo-pipeline stack up" in failure["error"]  # the fix
    assert not (tmp_path / "deploy").exists()  # nothing rendered before the server answered


def test_stack_up_refuses_a_taken_port_before_starting_anything(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["stack", "up", "--dir", str(tmp_path / "stack"), "--mlflow-port", str(port)])
    _one_paragraph_on_stderr(result, f"MLflow port {port} is in use; choose another with --mlflow-port")
    state = tmp_path / "stack" / "state.json"
    assert not state.exists() or json.loads(state.read_text())["services"] == {}  # PostgreSQL was not started


@pytest.mark.parametrize(
    "args, says",
    [
        (["plan", "--lora-rank", "many", "--json"], "Invalid value for '--lora-rank'"),
        (["hpo", "--trials", "0", "--json"], "Invalid value for '--trials'"),
        (["rewards", "check", "math_answer", "--json"], "Missing option '--input'"),
        (["data", "--json", "--no-such-option"], "No such option: --no-such-option"),
    ],
)
def test_a_usage_error_caught_by_the_parser_ends_json_with_the_failure_object_too(args, says):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_CONFIG, result.output
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert failure["status"] == "failed" and failure["exit_code"] == EXIT_CONFIG
    assert says in failure["error"] and says in result.stderr  # click's own message, in its box, on stderr
    assert CliRunner().invoke(app, [a for a in args if a != "--json"]).stdout == ""  # without --json: stderr only


@pytest.mark.parametrize(
    "args, says",
    [
        (["--json", "--bogus"], "No such option: --json"),  # the root has no --json: its parser refuses it first
        (["--bogus", "data", "--json"], "No such option: --bogus"),  # refused before any command is named
        (["nosuch", "--json"], "No such command 'nosuch'"),
        (["rewards", "nosuch", "--json"], "No such command 'nosuch'"),
    ],
)
def test_a_usage_error_at_the_root_ends_json_with_the_failure_object_too(args, says):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_CONFIG, result.output
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert failure == {"status": "failed", "error": failure["error"], "exit_code": EXIT_CONFIG}
    assert says in failure["error"] and says in result.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["data", "--set", "--json", "--bogus"], "No such option: --bogus"),  # --json is the value of --set
        (["data", "--set", "data.source=--json", "--bogus"], "No such option: --bogus"),
        (["data", "--config", "--json", "--bogus"], "No such option: --bogus"),
        (["plan", "--model", "qwen2.5-7b", "--", "--json"], "unexpected extra argument"),  # an argument after --
    ],
)
def test_json_as_an_option_value_asks_for_no_failure_object(args, says):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_CONFIG, result.output
    assert says in result.stderr and result.stdout == ""


@pytest.mark.parametrize("model", [[], ["--model", "qwen2.5-7b"]])  # the config's plan (local), a named model's
@pytest.mark.parametrize("budget", ["-5", "nan"])
def test_a_budget_below_zero_is_refused_by_name_before_any_planning(model, budget):
    result = CliRunner().invoke(app, ["plan", *model, "--budget", budget, "--json"])
    assert result.exit_code == EXIT_CONFIG, result.output
    (line,) = result.stdout.strip().splitlines()  # the failure object alone: no plan was made
    failure = json.loads(line)
    assert failure["exit_code"] == EXIT_CONFIG and "Traceback" not in result.stderr
    assert "'--budget'" in failure["error"] and "0 or more, or leave --budget out" in failure["error"]


@pytest.mark.parametrize("command", [["config"], ["plan", "--json"]])
def test_an_out_of_range_library_field_is_refused_at_load_by_its_dotted_key(command):
    result = CliRunner().invoke(app, [*command, "--set", "train.lora.r=-4"])
    _one_paragraph_on_stderr(result, "--set train.lora.r=-4: train.lora.r: Input should be greater than or equal to 1")
    assert "lora_rank" not in result.stderr  # not the planner's own name for it


def test_version_is_the_installed_distributions_and_h_is_help():
    import tomllib
    from pathlib import Path

    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.stdout) == (0, f"grpo-pipeline {declared}\n")
    for args in ([], ["stack"], ["plan"], ["ab", "status"]):
        short, long = (CliRunner().invoke(app, [*args, flag]) for flag in ("-h", "--help"))
        assert short.exit_code == long.exit_code == 0 and short.stdout == long.stdout and "Usage:" in short.stdout


@pytest.mark.parametrize("group", [[], ["stack"], ["ab"], ["rewards"]], ids=lambda g: " ".join(g) or "root")
def test_a_help_listing_gives_each_command_one_line(group):
    """On a terminal wide enough, each command of a listing is one row: its docstring's first sentence (it was the
    whole first paragraph, broken where the docstring's lines break); the command's own -h keeps its whole text."""
    listing = CliRunner().invoke(app, [*group, "-h"], env={"COLUMNS": "400"}).stdout
    panel = listing[listing.index("Commands") :].splitlines()[1:-1]
    assert panel and all(not row.startswith("│  ") for row in panel), "\n".join(panel)
    if not group:
        assert "│ promote   An operator's promotion without an A/B decision: the version becomes champion" in listing
        assert "Records who and why" not in listing
        assert "Records who and why" in CliRunner().invoke(app, ["promote", "-h"], env={"COLUMNS": "400"}).stdout


def test_the_registry_commands_in_a_folder_where_nothing_ran_create_no_store(tmp_path, monkeypatch):
    """`registry` reads: every alias null, exit 0, and why on stderr; `rollback`, `promote` and `ab decide` would
    move aliases that do not exist, and `serve` would serve a champion that does not exist: exit 2. None of them
    leaves an MLflow database or an A/B request log behind."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("GRPO_AB_LOG_URL", raising=False)
    says = f"no registry yet at sqlite:///{tmp_path / '.grpo' / 'mlflow.db'}: run `grpo-pipeline run` first"
    read = CliRunner().invoke(app, ["registry"])
    assert read.exit_code == 0 and json.loads(read.stdout) == dict.fromkeys(
        ["champion", "challenger", "previous-champion"]
    )
    assert read.stderr.replace("\n", " ").strip() == says
    status = CliRunner().invoke(app, ["ab", "status", "--json"])
    assert status.exit_code == 0 and json.loads(status.stdout)["champion"] is None and says in status.stderr
    assert json.loads(status.stdout)["log"] == {} and "no A/B yet: no request log at" in status.stderr
    for args in (["rollback", "--reason", "x"], ["promote", "--version", "1", "--reason", "x", "--force"]):
        _one_paragraph_on_stderr(CliRunner().invoke(app, args), says)
    assert _failure(CliRunner().invoke(app, ["ab", "decide", "--json"]))["error"] == says
    serve = CliRunner().invoke(app, ["serve"])
    _one_paragraph_on_stderr(serve, says)
    assert "INFO" not in serve.stderr  # MLflow's "Creating initial MLflow database tables..."
    assert not (tmp_path / ".grpo").exists()  # no MLflow database, no A/B request log, not even their folder


def test_serve_without_the_engines_python_is_refused_before_the_registry_or_the_request_log(tmp_path, monkeypatch):
    """After `make demo` without `make serve-env`: exit 2 naming the Python it looked for and both fixes, before
    any alias is resolved or adapter downloaded (it asked the registry first, and after the downloads exited 1)."""
    import socket

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GRPO_AB_LOG_URL", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens: asked first, it would say so
    serve = CliRunner().invoke(app, ["serve", "--set", f"tracking.mlflow_tracking_uri={uri}"])
    python = tmp_path / ".venv-serve" / "bin" / "python"
    _one_paragraph_on_stderr(serve, f"no engine Python at {python}: run `make serve-env`")
    assert "or set ab.serve.engine_python" in serve.stderr and uri not in serve.stderr
    assert not (tmp_path / ".grpo").exists()  # the request log is opened only for a serve that can start


def test_a_registry_read_migrating_an_older_store_prints_no_mlflow_info_lines(tmp_path):
    """A store from an older MLflow is brought up to date when opened; MLflow says so at INFO on stderr, which a
    read command keeps to its own output (a fresh interpreter: MLflow reads its log level when imported)."""
    import subprocess
    import sys

    import mlflow
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.MlflowClient(uri).search_registered_models()  # the tables, at the current schema
    command.downgrade(_get_alembic_config(uri), "-1")  # as an older MLflow left them
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    result = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.cli", "registry", "--set", f"data_dir={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0 and json.loads(result.stdout)["champion"] is None
    assert result.stderr == ""


def test_every_command_module_takes_its_exit_codes_from_the_one_contract():
    """failure.py holds the exit codes (cli/__init__.py's docstring says what each means); no command module (`rewards`,
    `ab`, ...) assigns an exit-code name of its own, whose value could drift from the contract."""
    import ast
    from pathlib import Path

    package = Path(__file__).parents[2] / "grpo_pipeline"
    own = {
        f"{path.name}: {target.id}"
        for path in package.rglob("*.py")  # the command modules are in cli/
        if path.name != "failure.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        for assigned in node.targets
        for target in (assigned.elts if isinstance(assigned, ast.Tuple) else [assigned])
        if isinstance(target, ast.Name) and target.id.startswith("EXIT_")
    }
    assert own == set()


@pytest.mark.parametrize(
    ("assignment", "says"),
    [
        ("train.rewards=[number_only]", "train.rewards has no skill reward"),
        (
            "train.rewards=[correct_answer, math_answer]",
            "train.rewards has 2 skill rewards (correct_answer, math_answer)",
        ),
        ("train.reward_weights={number_only: 0.2}", "train.reward_weights: a reward's weight and arguments are set"),
        ("train.reward_args={correct_answer: {}}", "train.reward_args: a reward's weight and arguments are set"),
        ("train.grpo.reward_weights=[1.0, 0.2]", "train.grpo.reward_weights: a reward's weight and arguments are set"),
    ],
)
def test_a_reward_set_without_one_skill_or_in_the_old_keys_exits_2_with_the_fix(assignment, says, no_flow_run):
    """Before any work: the message names train.rewards and its rewards, and shows the entry form."""
    failure = _failure(CliRunner().invoke(app, ["run", "--json", "--set", assignment]))
    assert says in failure["error"] and "{name: number_only, weight: 0.2}" in failure["error"]
    if "skill reward" in says:
        assert "its rewards are" in failure["error"] and "role: skill" in failure["error"]
