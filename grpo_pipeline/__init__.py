"""grpo-pipeline's command line (`grpo_pipeline.cli`), the top of the house: it calls the flows, and nothing
below imports it."""
