"""The Prefect UI's run form: every field opens with a value (none as "Property is type None"), `overrides`
says which keys exist and gives only examples the trigger policy accepts, and the daily deployment says its hour
and time zone."""

import re

import pytest
import yaml
from prefect.utilities.callables import parameter_schema

from grpo_pipeline.configs.policy import DEFAULT_ALLOW, TriggerPolicy, check_trigger
from grpo_pipeline.configs.schema import DeployConfig, load_config
from grpo_pipeline.flows.ab import ab_decide
from grpo_pipeline.flows.deploy import AB_ENTRYPOINT, DAILY, PIPELINE_ENTRYPOINT, PREFECT_YAML, render
from grpo_pipeline.flows.pipeline import grpo_pipeline

FLOWS = {PIPELINE_ENTRYPOINT: grpo_pipeline, AB_ENTRYPOINT: ab_decide}


def test_every_form_field_opens_with_a_value():
    spec = render(
        yaml.safe_load(PREFECT_YAML.read_text()), DeployConfig(), "configs/demo-cpu.yaml", [], budget_usd=25.0
    )
    for deployment in spec["deployments"]:
        schema = parameter_schema(FLOWS[deployment["entrypoint"]].fn).model_dump()["properties"]
        params = deployment["parameters"]
        assert set(params) <= set(schema), deployment["name"]  # a parameter the flow lacks fails every run
        for name, prop in schema.items():
            assert prop.get("default") is not None or params.get(name) is not None, (deployment["name"], name)
            assert prop.get("description"), (deployment["name"], name)  # the form says what each field is
    assert parameter_schema(grpo_pipeline.fn).model_dump()["properties"]["launcher"]["default"] == "config"


def _overrides_description(flow) -> str:
    return parameter_schema(flow.fn).model_dump()["properties"]["overrides"]["description"]


def test_overrides_name_the_keys_they_take():
    description = _overrides_description(grpo_pipeline)
    for hint in (
        "train.grpo.",
        "train.lora.",
        "deploy.trigger.allow",
        "grpo-pipeline run --set",
        "grpo-pipeline config",
    ):
        assert hint in description
    for field in DEFAULT_ALLOW:  # what a run may set by default, every field of it
        assert field in description, field


@pytest.mark.parametrize(
    ("flow", "allowed"),
    [(grpo_pipeline, ()), (ab_decide, ("ab.alpha",))],  # ab's form says to allow ab.alpha before setting it
    ids=["grpo-pipeline", "ab-decide"],
)
def test_every_example_the_form_gives_passes_the_trigger_policy(flow, allowed):
    """A person who types an example from the form's description gets a run, not a refusal."""
    found = re.findall(r"`([a-z_][\w.]*=[^`\s]+)`", _overrides_description(flow))
    examples = [e for e in found if e != "section.key=value"]  # the syntax, not an example
    assert examples
    policy = TriggerPolicy(allow=[*DEFAULT_ALLOW, *allowed])
    assert check_trigger(policy, "own.yaml", [], "own.yaml", examples) == [], examples
    load_config(None, examples)  # and valid values


def test_the_daily_deployment_says_when_and_where():
    spec = render(yaml.safe_load(PREFECT_YAML.read_text()), DeployConfig(schedule_hour=4, timezone="Asia/Tokyo"))
    daily = next(d for d in spec["deployments"] if d["name"] == DAILY)
    assert daily["schedules"][0]["timezone"] == "Asia/Tokyo"
    assert daily["description"].startswith("Daily at 04:00 Asia/Tokyo.")
