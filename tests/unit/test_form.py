"""The Prefect UI's run form: every field opens with a value (none as "Property is type None"), `overrides`
says which keys exist, and the daily deployment says its hour and time zone."""

import yaml
from prefect.utilities.callables import parameter_schema

from grpo_pipeline.configs.schema import DeployConfig
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


def test_overrides_name_the_keys_they_take():
    description = parameter_schema(grpo_pipeline.fn).model_dump()["properties"]["overrides"]["description"]
    for hint in ("train.grpo.", "train.lora.", "model.base=", "grpo-pipeline config"):
        assert hint in description


def test_the_daily_deployment_says_when_and_where():
    spec = render(yaml.safe_load(PREFECT_YAML.read_text()), DeployConfig(schedule_hour=4, timezone="Asia/Tokyo"))
    daily = next(d for d in spec["deployments"] if d["name"] == DAILY)
    assert daily["schedules"][0]["timezone"] == "Asia/Tokyo"
    assert daily["description"].startswith("Daily at 04:00 Asia/Tokyo.")
