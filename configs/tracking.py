"""`tracking.*`: where MLflow records runs and which registered model holds the candidates and the aliases."""

from __future__ import annotations

from pydantic import Field

from grpo_pipeline.configs.base import StrictModel


class TrackingConfig(StrictModel):
    mlflow_tracking_uri: str | None = Field(
        None,
        description="default: $MLFLOW_TRACKING_URI (e.g. from `grpo-pipeline stack env`), else a sqlite file under data_dir",
    )
    experiment: str = "grpo-pipeline"
    registered_model: str = Field("grpo-adapter", description="MLflow registered model holding candidates and aliases")
