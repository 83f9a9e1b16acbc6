"""What runs on the training node: `python -m grpo_pipeline.trainer --spec job.json`. Imports nothing from Prefect."""
