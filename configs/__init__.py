"""The configuration layer: `schema` (the typed pipeline configuration, pure pydantic: `PipelineConfig` composed of
one module per section, `load_config`) and the shipped YAML recipes, GPU catalogue and model architectures beside it,
found through `grpo_pipeline.configs.files`."""
