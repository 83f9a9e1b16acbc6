"""Prefect artifacts are shown on the run that made them (tests/integration/test_ab_flow.py reads one back) and
never start a server outside one."""

import pytest
from prefect.artifacts import create_markdown_artifact
from prefect.settings import PREFECT_API_URL, temporary_settings

from grpo_pipeline.flows.artifacts import show_image, show_markdown

UNREACHABLE = "http://127.0.0.1:9/api"  # the discard port: nothing answers


def test_outside_a_run_no_artifact_is_sent_anywhere():
    with temporary_settings({PREFECT_API_URL: UNREACHABLE}):
        with pytest.raises(Exception, match="connect|Connect"):  # what Prefect itself would do here
            create_markdown_artifact("# report", key="report")
        show_markdown("# report", key="report", description="a stage called from a script")
        show_image("http://127.0.0.1:5000/chart.png", key="chart", description="its chart")
