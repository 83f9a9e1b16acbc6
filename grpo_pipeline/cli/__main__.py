"""`python -m grpo_pipeline.cli`: the console script `grpo-pipeline` without its launcher script."""

from grpo_pipeline.cli import main

main()
