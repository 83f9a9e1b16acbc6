"""`deploy.*`: how `grpo-pipeline deploy` registers the Prefect deployments (schedule, work pool, image,
notifications) and what a run started through Prefect may set (`deploy.trigger`, `configs/policy.py`)."""

from __future__ import annotations

from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator

from grpo_pipeline.configs.base import StrictModel
from grpo_pipeline.configs.policy import TriggerPolicy


class DeployConfig(StrictModel):
    """How `grpo-pipeline deploy` registers the Prefect deployments (prefect.yaml); the flow ignores it."""

    schedule_hour: int = Field(3, ge=0, le=23, description="hour of the daily-retrain run: pick an off-peak one")
    timezone: str = Field("UTC", description="IANA time zone of schedule_hour, e.g. 'Europe/Berlin'")
    work_pool: str = Field("grpo-process", description="Prefect work pool; created as a process pool when missing")
    image: str | None = Field(
        None, description="image for a Docker or Kubernetes work pool (built from infra/docker/Dockerfile)"
    )
    notify_block: str | None = Field(
        None,
        description="Prefect notification block 'type-slug/name' (e.g. 'slack-webhook/grpo-alerts') told of failed runs",
    )
    trigger: TriggerPolicy = Field(
        TriggerPolicy(),
        description="what a run started through Prefect (form, API, schedule, CI key) may set; read "
        "from the deployment's own config, never from the run's parameters (docs/security.md)",
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, v: str) -> str:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {v!r}; use an IANA name such as 'UTC' or 'Europe/Berlin'") from None
        return v
