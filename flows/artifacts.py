"""What a flow run shows in the Prefect UI beside its logs: Markdown reports and charts, as artifacts.

Only inside a flow or task run: a stage called outside one (a notebook, a script, a test) has no run to show
them on, and Prefect would start a temporary server just to hold them (a use it has deprecated). The same
reports are in the MLflow run either way."""

from __future__ import annotations

from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.context import FlowRunContext, TaskRunContext


def in_a_run() -> bool:
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def show_markdown(markdown: str, key: str, description: str) -> None:
    if in_a_run():
        create_markdown_artifact(markdown, key=key, description=description)


def show_image(url: str, key: str, description: str) -> None:
    """`url`: where the UI loads it from (an MLflow server serves run artifacts by URL)."""
    if in_a_run():
        create_image_artifact(url, key=key, description=description)
