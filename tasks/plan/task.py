"""The plan stage as a Prefect task, in a module of its own: `grpo_pipeline.tasks.plan` itself never imports Prefect
(~2 s), so `grpo-pipeline plan` answers in well under a second."""

from prefect import task

from grpo_pipeline.tasks.plan.stage import plan_run

plan_task = task(name="plan")(plan_run)
