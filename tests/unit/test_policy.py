"""The trigger policy (configs/policy.py, flows/trigger.py) and secrets kept out of the configuration.

A run triggered through a deployment (form, API, schedule, CI key) may set only what its deployment allows;
anything that loads code, names a host or URL, reads or writes a path, or carries a credential is refused with
the field, the reason and the fix, before any work. An operator calling the flow directly keeps full power.
No Prefect server: the flow run's record is stood in for, and the flow's body is called as `grpo_pipeline.fn`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import pytest
import yaml
from pydantic import ValidationError

from grpo_pipeline.configs.policy import CODE, CREDENTIAL, HOST, PATH, POLICY, TriggerPolicy, check_trigger, risk
from grpo_pipeline.configs.schema import ConfigError, PipelineConfig, load_config
from grpo_pipeline.flows import pipeline, trigger

SECRET = "hf_grpoSentinelPolicyToken0a1b2c3d4e5f6a7b"
OWN = ["train.grpo.max_steps=4", "data.demo.n_train=64"]  # the deployment's deploy-time overrides (like `ci`)


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The worker's project root (the cwd), the deployment's own config and a second recipe it allows, a module
    whose import leaves a mark, and the flow's stages (its preflight too) replaced by a recorder (so a refused run
    is seen not to start them, and an allowed one is seen to get its config)."""
    monkeypatch.chdir(tmp_path)
    data_dir = tmp_path / "data"
    own = {"data_dir": str(data_dir), "deploy": {"trigger": {"recipes": ["recipes/alt.yaml"]}}}
    (tmp_path / "deploy.yaml").write_text(yaml.safe_dump(own))
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "alt.yaml").write_text(
        yaml.safe_dump({"data_dir": str(data_dir), "train": {"lora": {"r": 4}}})
    )
    (tmp_path / "evil.yaml").write_text(yaml.safe_dump({"model": {"trust_remote_code": True}}))
    (tmp_path / "environ").write_text(f"HF_TOKEN={SECRET}\n[not: yaml")  # stands in for /proc/self/environ
    mark = tmp_path / "imported"
    (tmp_path / "evil_reward.py").write_text(
        f"open({str(mark)!r}, 'w').close()\ndef reward(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    started: list[PipelineConfig] = []
    monkeypatch.setattr(pipeline, "preflight", lambda cfg: None)  # the run's first check: a stage here too
    monkeypatch.setattr(pipeline, "run_pipeline", lambda cfg, priced=None: started.append(cfg))
    deployment = trigger.Deployment(
        name="grpo-pipeline/manual", parameters={"config_path": "deploy.yaml", "overrides": OWN, "budget_usd": 25.0}
    )
    monkeypatch.setattr(trigger, "started_by", lambda: deployment)
    return SimpleNamespace(root=tmp_path, data_dir=data_dir, mark=mark, started=started)


def _run(config_path: str | None = "deploy.yaml", overrides: list[str] | None = None, **form: Any) -> None:
    pipeline.grpo_pipeline.fn(
        config_path=config_path, overrides=[*OWN, *(overrides or [])], **{"budget_usd": 25.0, **form}
    )


def _nothing_happened(worker: SimpleNamespace) -> None:
    assert worker.started == []  # no stage, so no MLflow run, no data, no training
    assert not worker.data_dir.exists() and not worker.mark.exists()
    assert "evil_reward" not in sys.modules


# field -> the reason its refusal gives
REFUSED = {
    "model.trust_remote_code=true": CODE,
    "train.rewards=[evil_reward:reward]": CODE,
    "train.grpo.model_init_kwargs={trust_remote_code: true}": CODE,
    "train.sky.task_yaml=/tmp/run-anything.yaml": CODE,
    "tracking.mlflow_tracking_uri=http://collector.example:5000": HOST,
    "train.grpo.push_to_hub=true": HOST,
    "train.grpo.hub_model_id=someone/else": HOST,
    "train.rewards=[correct_answer, {name: remote_verifier, role: shaping, args: {url: 'http://collector.example/score'}}]": CODE,
    "data.s3_endpoint_url=http://collector.example:9000": HOST,
    "data.source=/proc/self/environ": PATH,
    "data_dir=/etc": PATH,
    "train.checkpoint_uri=s3://someone-elses/bucket": PATH,
    "model.base=/home/someone/model": PATH,
    "plan.gpu_catalog=/etc/passwd": PATH,
    f"train.grpo.hub_token={SECRET}": CREDENTIAL,
    f"train.rewards=[correct_answer, {{name: remote_verifier, role: shaping, args: {{headers: {{Authorization: Bearer {SECRET}}}}}}}]": CODE,
    "deploy.trigger.allow=[model.base]": POLICY,
    "train={rewards: [evil_reward:reward]}": CODE,  # a whole section holds what it holds
}


@pytest.mark.parametrize("assignment", REFUSED, ids=lambda a: a.partition("=")[0])
def test_a_trigger_cannot_set_code_hosts_paths_or_credentials(worker, assignment):
    field = assignment.partition("=")[0]
    with pytest.raises(ConfigError) as refused:
        _run(overrides=["train.grpo.learning_rate=1e-4", assignment])
    message = str(refused.value)
    assert f"{field}: {REFUSED[assignment]}" in message  # the field and why
    assert "change the deployment" in message and "grpo-pipeline run --set" in message  # the fix, both ways
    assert "grpo-pipeline/manual" in message and "learning_rate" not in message  # allowed fields pass
    assert SECRET not in message and assignment.partition("=")[2] not in message  # names, never values
    _nothing_happened(worker)


def test_every_refusal_at_once_each_with_its_field_reason_and_fix(worker):
    with pytest.raises(ConfigError) as refused:
        _run(overrides=list(REFUSED) + ["promote.min_effect=-1", "no assignment"])
    lines = [line.strip() for line in str(refused.value).splitlines()[1:]]
    assert len(lines) == len(REFUSED) + 2
    assert any(
        line.startswith("promote.min_effect: is not among the fields this deployment lets a trigger set")
        and "add it to deploy.trigger.allow" in line
        and "deploy.yaml" in line
        for line in lines
    )
    assert any(line.startswith("overrides[") and "KEY=VALUE" in line for line in lines)
    _nothing_happened(worker)


@pytest.mark.parametrize("config_path", ["evil.yaml", "environ", "/etc/passwd", None, "recipes/../evil.yaml"])
def test_a_trigger_picks_only_among_the_deployments_own_recipes(worker, config_path):
    with pytest.raises(ConfigError) as refused:
        _run(config_path)
    message = str(refused.value)
    assert (
        message.count("\n") == 1
        and "  config_path: this deployment runs deploy.yaml or one of recipes/alt.yaml" in message
    )
    assert "add it to deploy.trigger.recipes" in message and "grpo-pipeline run --config" in message
    assert SECRET not in message  # the file was never read
    _nothing_happened(worker)


def test_allowed_fields_and_recipes_pass(worker):
    _run(
        overrides=[
            "train.grpo.learning_rate=1e-4",
            "train.lora.r=8",
            "train.lora.lora_alpha=16",
            "train.grpo.seed=7",
            "train.grpo.max_steps=6",
        ],
        launcher="local",
        budget_usd=10.0,
    )
    _run("recipes/alt.yaml")
    _run("./recipes/../deploy.yaml")  # the same file, however it is written
    first, alt, same = worker.started
    assert first.train.grpo["max_steps"] == 6 and first.train.grpo["learning_rate"] == 1e-4
    assert (first.train.lora, first.train.grpo["seed"]) == ({"r": 8, "lora_alpha": 16}, 7)
    assert (first.train.launcher, first.plan.budget_usd) == ("local", 10.0)
    assert alt.train.lora == {"r": 4} and same.data.demo.n_train == 64


def test_a_shipped_recipe_named_in_the_policy_runs_on_a_worker_without_a_checkout(worker):
    """The worker's folder has no configs/ (a `pip install`ed project): `configs/NAME` in deploy.trigger.recipes and
    in the run's form is the shipped recipe, found in the installed package as `--config configs/NAME` is."""
    from grpo_pipeline.configs.files import packaged

    assert not (worker.root / "configs").exists()
    own = yaml.safe_load((worker.root / "deploy.yaml").read_text())
    own["deploy"]["trigger"]["recipes"] = ["configs/gsm8k-calc-cpu.yaml"]
    (worker.root / "deploy.yaml").write_text(yaml.safe_dump(own))
    _run("configs/gsm8k-calc-cpu.yaml")
    _run(str(packaged("gsm8k-calc-cpu.yaml")))  # the same file, however it is written
    (by_name, by_path) = worker.started
    assert by_name == by_path == load_config(packaged("gsm8k-calc-cpu.yaml"), [*OWN, "plan.budget_usd=25.0"])


def test_deploy_refuses_a_recipe_no_run_could_load_before_registering_anything(worker, monkeypatch):
    from grpo_pipeline.flows import deploy

    monkeypatch.setattr(deploy, "check_server", lambda: pytest.fail("the server was asked"))
    cfg = load_config(None, ["deploy.trigger.recipes=[configs/gsm8k-calc-cpu.yaml, configs/no-such.yaml]"])
    with pytest.raises(ConfigError) as refused:
        deploy.deploy(cfg, cfg.deploy, None, [])
    message = str(refused.value)
    assert message.startswith("deploy.trigger.recipes: configs/no-such.yaml is no file in")
    assert "configs/demo-cpu.yaml" in message and "nothing was registered" in message  # the shipped ones, the fix


def test_a_trigger_adds_to_what_the_deployment_pins_and_cannot_drop_it(worker):
    pipeline.grpo_pipeline.fn(config_path="deploy.yaml", overrides=["train.lora.r=8"], budget_usd=None)
    (cfg,) = worker.started
    assert (cfg.train.grpo["max_steps"], cfg.data.demo.n_train, cfg.train.lora["r"]) == (4, 64, 8)


def test_the_deployment_widens_its_own_policy(worker):
    """How to allow a field: the deployment's config lists it (a redeploy), never the run."""
    own = yaml.safe_load((worker.root / "deploy.yaml").read_text())
    own["deploy"]["trigger"]["allow"] = ["promote.min_effect"]
    (worker.root / "deploy.yaml").write_text(yaml.safe_dump(own))
    _run(overrides=["promote.min_effect=0.02"])
    assert worker.started[0].promote.min_effect == 0.02
    with pytest.raises(ConfigError, match="train.grpo.learning_rate: is not among"):  # the list replaces the default
        _run(overrides=["train.grpo.learning_rate=1e-4"])


def test_an_operator_on_the_workers_shell_keeps_full_power(worker, monkeypatch):
    monkeypatch.undo()  # the real `started_by`, the real stages' places: called directly, no deployment
    monkeypatch.chdir(worker.root)
    started: list[PipelineConfig] = []
    monkeypatch.setattr(pipeline, "preflight", lambda cfg: None)
    monkeypatch.setattr(pipeline, "run_pipeline", lambda cfg, priced=None: started.append(cfg))
    pipeline.grpo_pipeline.fn(
        "evil.yaml",
        [
            "tracking.mlflow_tracking_uri=http://mlflow.internal:5000",
            "data.source=/srv/data/train.jsonl",
            "train.grpo.push_to_hub=true",
            "train.rewards=[pkg.mod:fn]",
        ],
    )
    (cfg,) = started
    assert cfg.model.trust_remote_code and cfg.tracking.mlflow_tracking_uri == "http://mlflow.internal:5000"
    assert cfg.data.source == "/srv/data/train.jsonl" and cfg.train.reward_set().names == ("pkg.mod:fn",)


def test_who_started_the_run_comes_from_the_flow_runs_record(monkeypatch):
    """Not from prefect.runtime.deployment, which an environment variable mocks."""
    from prefect.context import FlowRunContext

    deployment_id = uuid4()
    read: list = []
    monkeypatch.setattr(
        trigger,
        "_read_deployment",
        lambda i: read.append(i) or trigger.Deployment(name="grpo-pipeline/ci", parameters={}),
    )
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "")
    monkeypatch.setattr(
        FlowRunContext,
        "get",
        classmethod(lambda cls: SimpleNamespace(flow_run=SimpleNamespace(deployment_id=deployment_id))),
    )
    assert trigger.started_by().name == "grpo-pipeline/ci" and read == [deployment_id]
    monkeypatch.setattr(
        FlowRunContext, "get", classmethod(lambda cls: SimpleNamespace(flow_run=SimpleNamespace(deployment_id=None)))
    )
    assert trigger.started_by() is None  # `grpo-pipeline run`: the flow called directly
    monkeypatch.setattr(FlowRunContext, "get", classmethod(lambda cls: None))
    assert trigger.started_by() is None


def test_the_hpo_flow_is_bound_the_same_way(worker, monkeypatch):
    from grpo_pipeline.flows import hpo

    monkeypatch.setattr(hpo, "load_config", lambda *a: pytest.fail("the config was loaded"))
    with pytest.raises(ConfigError, match="model.trust_remote_code: loads code"):
        hpo.hpo_flow.fn("deploy.yaml", [*OWN, "model.trust_remote_code=true"])
    _nothing_happened(worker)


@pytest.mark.parametrize(
    "field",
    [
        "model.base",
        "train.grpo.report_to",
        "train.grpo.output_dir",
        "train.lora.base_model_name_or_path",
        "train.grpo.vllm_server_host",
        "deploy.work_pool",
        "train.grpo",
        "hpo.storage",
    ],
)
def test_a_deployment_cannot_open_a_risky_field(field):
    assert risk(field)
    with pytest.raises(ValidationError, match="a trigger may never set it; set its value in the deployment's config"):
        TriggerPolicy(allow=[field])


def test_a_misspelled_allowed_field_fails_at_load():
    with pytest.raises(ConfigError, match="'max_step' is not a GRPOConfig field; did you mean 'max_steps'"):
        load_config(None, ["deploy.trigger.allow=[train.grpo.max_step]"])
    with pytest.raises(ConfigError, match="no field 'evaluat' in the configuration; did you mean 'evaluate'"):
        load_config(None, ["deploy.trigger.allow=[evaluat.seed]"])
    assert load_config(None, ["deploy.trigger.allow=[evaluate.seed, promote]"]).deploy.trigger.allow == [
        "evaluate.seed",
        "promote",
    ]


def test_the_default_policy_is_the_documented_one():
    policy = TriggerPolicy()
    assert (
        policy.allow
        == [
            "train.grpo.max_steps",
            "train.grpo.learning_rate",
            "train.grpo.seed",
            "train.lora.r",
            "train.lora.lora_alpha",
            "train.launcher",
            "plan.budget_usd",
        ]
        and policy.recipes == []
    )
    assert all(risk(field) is None for field in policy.allow)
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    assert all(f"`{field}`" in text for field in policy.allow)


# ------------------------------------------------------------------------------------------------ secrets

LEAKS = {
    f"train.grpo.hub_token={SECRET}": "train.grpo.hub_token",
    f"train.grpo.push_to_hub_token={SECRET}": "train.grpo.push_to_hub_token",
    f"train.rewards=[correct_answer, {{name: remote_verifier, role: shaping, args: {{headers: {{Authorization: Bearer {SECRET}}}}}}}]": "train.rewards[1].args.headers.Authorization",
    f"train.rewards=[correct_answer, {{name: remote_verifier, role: shaping, args: {{headers: {{X-Api-Key: {SECRET[3:]}}}}}}}]": "train.rewards[1].args.headers.X-Api-Key",
    f"train.grpo.learning_rate={SECRET}": "train.grpo.learning_rate",  # a token typed into a number field
    f"hpo.storage=grpo:{SECRET[3:]}@db.internal:5432/optuna": "hpo.storage",  # user:password@ without a scheme
    f"tracking.mlflow_tracking_uri=https://bob:{SECRET[3:]}@mlflow.internal": "tracking.mlflow_tracking_uri",
    f"data.source=https://x.example/d.jsonl?access_token={SECRET[3:]}": "data.source",
}


@pytest.mark.parametrize("assignment", LEAKS, ids=lambda a: a.partition("=")[0])
def test_a_secret_in_the_config_or_an_override_is_refused_with_the_fix(assignment, tmp_path):
    for config_path, overrides in ((None, [assignment]), (_as_file(assignment, tmp_path), [])):
        with pytest.raises(ConfigError) as refused:
            load_config(config_path, overrides)
        message = str(refused.value)
        assert f"{LEAKS[assignment]} holds a credential" in message
        assert "headers_from_env: {Authorization: VERIFIER_TOKEN}" in message and "environment variable" in message
        assert SECRET[3:] not in message


def _as_file(assignment: str, tmp_path: Path) -> Path:
    from grpo_pipeline.configs.schema import apply_override

    tree: dict = {"train": {"rewards": ["correct_answer", {"name": "remote_verifier", "role": "shaping"}]}}
    apply_override(tree, assignment)
    path = tmp_path / "leaky.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_a_secret_in_a_forms_overrides_is_refused_before_any_work(worker):
    """A token typed into a field the deployment allows: refused by the loader, never shown, nothing run."""
    with pytest.raises(ConfigError) as refused:
        _run(overrides=[f"train.grpo.learning_rate={SECRET}"])
    assert "train.grpo.learning_rate holds a credential" in str(refused.value) and SECRET not in str(refused.value)
    _nothing_happened(worker)


def test_names_of_environment_variables_and_ordinary_values_pass():
    cfg = load_config(
        None,
        [
            "train.rewards=[correct_answer, {name: remote_verifier, role: shaping, args: {headers_from_env: {Authorization: VERIFIER_TOKEN}, "
            "headers: {X-Request-Source: grpo-pipeline}}}]",
            "data.min_prompt_tokens=2",
            "train.grpo.hub_token=",
            "data.source=s3://bucket/key.jsonl",
            "data.system_prompt='Token limits apply: answer briefly.'",
            "hpo.storage=sqlite:///x.db",
            "train.lora.trainable_token_indices=[1, 2]",
        ],
    )
    assert cfg.train.reward_set().args["remote_verifier"]["headers_from_env"] == {"Authorization": "VERIFIER_TOKEN"}
    assert risk("train.lora.trainable_token_indices") is None


def test_only_a_variables_name_goes_where_a_name_belongs():
    with pytest.raises(ConfigError) as refused:
        load_config(
            None,
            [
                f"train.rewards=[correct_answer, {{name: remote_verifier, role: shaping, args: {{headers_from_env: {{Authorization: {SECRET[3:]}-x}}}}}}]"
            ],
        )
    message = str(refused.value)
    assert (
        "headers_from_env.Authorization holds a credential (a value where the name of an environment variable"
        in message
    )
    assert SECRET[3:] not in message


def test_the_policy_check_is_cheap():
    """Its cost per run, measured: the pure check of a typical form (the figure goes to docs/security.md)."""
    import timeit

    policy = TriggerPolicy()
    runs = ["train.grpo.learning_rate=1e-4", "train.lora.r=8", *OWN]
    n = 2000
    seconds = timeit.timeit(lambda: check_trigger(policy, "deploy.yaml", OWN, "deploy.yaml", runs), number=n) / n
    assert seconds < 0.01, seconds


def test_the_cli_refuses_a_secret_in_a_set_without_printing_it():
    """The operator's path: exit 2, the --set named by its key, the secret nowhere in the output."""
    from typer.testing import CliRunner

    from grpo_pipeline.cli import app

    result = CliRunner().invoke(
        app, ["config", "--set", "train.grpo.max_steps=3", "--set", f"train.grpo.hub_token={SECRET}"]
    )
    assert result.exit_code == 2
    assert "--set train.grpo.hub_token=...: train.grpo.hub_token holds a credential" in " ".join(result.output.split())
    assert SECRET not in result.output
