"""One error path for every command: bad configuration or input exits 2 with one message that names the field
or resource and the fix; with --json the last stdout line is the failure object; a --set error names the
--set; a preflight failure comes before any flow run; messages name the endpoint really used."""

from __future__ import annotations

import json

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
    import flows.hpo
    import flows.pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("a flow run was started")

    monkeypatch.setattr(flows.pipeline, "grpo_pipeline", refuse)
    monkeypatch.setattr(flows.hpo, "hpo_flow", refuse)


@pytest.mark.parametrize("command", [["run", "--json"], ["hpo", "--json"], ["data", "--json"]])
@pytest.mark.parametrize("assignment, says", [
    ("train.grpo.lerning_rate=1", "did you mean 'learning_rate'"),
    ("data.sorce=x.jsonl", "did you mean 'source'"),
    ("data.max_prompt_tokens=many", "valid integer"),
    ("notakeyvalue", "expected KEY=VALUE"),
    ("data.system_prompt=a: b: c", "not valid YAML"),
])
def test_a_bad_set_names_the_set_not_the_file(command, assignment, says, no_flow_run):
    failure = _failure(CliRunner().invoke(app, [*command, "--set", assignment]))
    assert failure["error"].startswith(f"--set {assignment}: ") and says in failure["error"]
    assert "demo-cpu.yaml" not in failure["error"]


def test_several_sets_that_fail_only_together_are_all_named(no_flow_run):
    failure = _failure(CliRunner().invoke(app, ["run", "--json", "--set", "data.holdout_share=0.7",
                                                "--set", "data.val_share=0.3"]))
    assert failure["error"].startswith("--set data.holdout_share=0.7 --set data.val_share=0.3 (together):")


def test_a_bad_config_file_is_named(tmp_path, no_flow_run):
    (tmp_path / "bad.yaml").write_text("train:\n  grpo: {max_steps: [}\n")
    for config, says in ((tmp_path / "missing.yaml", "not found"), (tmp_path / "bad.yaml", "is not valid YAML")):
        failure = _failure(CliRunner().invoke(app, ["run", "--json", "--config", str(config), "--set", "seed=1"]))
        assert str(config) in failure["error"] and says in failure["error"]


def test_a_preflight_failure_comes_before_any_flow_run(tmp_path, no_flow_run):
    for command in ("run", "hpo"):
        failure = _failure(CliRunner().invoke(app, [command, "--json", "--set", "model.base=/no/such/model",
                                                    "--set", f"data_dir={tmp_path}"]))
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
    import flows.pipeline
    from configs.schema import ConfigError
    from tasks.registry import ChampionMoved

    error = {"config": ConfigError("data.source: too much was dropped; fix the source"),
             "champion": ChampionMoved("the champion moved to v3 while this run decided; run again"),
             "bug": RuntimeError("something broke")}[raised]

    def flow(**kwargs):
        print("a line the flow printed")
        raise error

    monkeypatch.setattr(flows.pipeline, "grpo_pipeline", flow)
    result = CliRunner().invoke(app, ["run", "--json", "--set", f"data_dir={tmp_path}"])
    assert result.exit_code == code, result.output
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert failure == {"status": "failed", "exit_code": code,
                       "error": str(error) if raised != "bug" else "RuntimeError: something broke"}


def test_an_unreadable_data_source_fails_the_data_command_the_same_way(tmp_path):
    (tmp_path / "d.jsonl").write_bytes('{"prompt": "1 + 1?", "answer": "2"}\n'.encode("utf-16"))
    failure = _failure(CliRunner().invoke(app, ["data", "--json", "--out", str(tmp_path / "out"),
                                                "--set", f"data.source={tmp_path / 'd.jsonl'}",
                                                "--set", "data.max_prompt_tokens=null"]))
    assert "UTF-16 text; JSON Lines must be UTF-8" in failure["error"]
    missing = _failure(CliRunner().invoke(app, ["data", "--json", "--set", f"data.source={tmp_path / 'none.jsonl'}"]))
    assert "data.source:" in missing["error"] and "does not exist" in missing["error"]
