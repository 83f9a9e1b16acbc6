"""What runs on the training node: `python -m trainer --spec job.json`. Imports nothing from Prefect."""
