import pytest

from grpo_pipeline.config import ConfigError, load_config


def test_defaults_are_the_demo():
    cfg = load_config(None)
    assert cfg.model.base == "smollm2-135m-instruct"
    assert cfg.model.quantization == "none"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  grpo:\n    max_steps: 5\n    beta: 0.1\n")
    cfg = load_config(path, ["train.grpo.max_steps=7", "model.quantization=nf4"])
    assert cfg.train.grpo == {"max_steps": 7, "beta": 0.1}
    assert cfg.model.quantization == "nf4"


def test_every_shipped_config_parses():
    from pathlib import Path

    configs = sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml"))
    assert len(configs) >= 2
    for path in configs:
        load_config(path)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.dmo=1", "data.dmo: unknown key; did you mean 'demo'?"),
        ("model.quantization=nf5", "'none', 'nf4', 'fp4' or 'int8' (got 'nf5')"),
        ("train.grpo.learnin_rate=0.1", "'learnin_rate' is not a GRPOConfig field; did you mean 'learning_rate'?"),
        ("train.grpo.max_steps=many", "'max_steps'='many' does not fit GRPOConfig"),
        ("train.lora.r=big", "'r'='big' does not fit LoraConfig"),
        ("train.grpo.output_dir=/x", "'output_dir' is set by the pipeline itself"),
        ("train.rewards=[bogus]", "unknown reward 'bogus'"),
        ("train.checkpoint_every=0", "train.checkpoint_every: Input should be greater than or equal to 1"),
    ],
)
def test_bad_values_name_the_field(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


def test_missing_file_and_malformed_set(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["train.grpo.max_steps"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)
