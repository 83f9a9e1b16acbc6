import pytest

from grpo_pipeline.configs.schema import ConfigError, load_config


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

    # gpus.yaml is the planner's GPU catalog, not a pipeline config (tests/unit/test_plan.py parses it)
    configs = sorted(p for p in Path(__file__).parents[2].joinpath("configs").glob("*.yaml") if p.name != "gpus.yaml")
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
        ("train.checkpoint_every=0", "train.checkpoint_every: Input should be greater than or equal to 1"),
        # the TRL/PEFT fields users set most: out of range is refused at load time, by the dotted key, with the fix
        ("train.lora.r=-4", "train.lora.r: Input should be greater than or equal to 1 (got -4); the LoRA rank"),
        ("train.lora.lora_alpha=0", "train.lora.lora_alpha: Input should be greater than 0 (got 0)"),
        ("train.lora.lora_dropout=2", "train.lora.lora_dropout: Input should be less than 1 (got 2); a probability"),
        ("train.grpo.learning_rate=-1", "train.grpo.learning_rate: Input should be greater than 0 (got -1)"),
        ("train.grpo.max_steps=-5", "train.grpo.max_steps: Input should be greater than or equal to 1, or -1 (got -5)"),
        ("train.grpo.per_device_train_batch_size=0", "train.grpo.per_device_train_batch_size: Input should be"),
        ("train.grpo.num_generations=1", "train.grpo.num_generations: Input should be greater than or equal to 2"),
        ("train.grpo.max_completion_length=0", "train.grpo.max_completion_length: Input should be greater than"),
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
    # the loader itself turns a value's YAML error into a ConfigError (the Prefect form's overrides reach it too)
    with pytest.raises(ConfigError, match=r"not valid YAML .* quote it"):
        load_config(None, ["data.system_prompt=a: b: c"])
    with pytest.raises(ConfigError, match="empty part"):
        load_config(None, ["train..max_steps=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_a_tab_in_the_indentation_and_a_directory_are_told_with_their_fix(tmp_path):
    tabbed = tmp_path / "tabbed.yaml"
    tabbed.write_text("seed: 1\ntrain:\n\tgrpo:\n\t\tmax_steps: 3\n")
    with pytest.raises(ConfigError, match="line 3 is indented with a tab: indent with spaces"):
        load_config(tabbed)
    (tmp_path / "mine.yaml").write_text("data_dir: mine\n")
    with pytest.raises(ConfigError, match=f"config {tmp_path} is a directory, not a YAML file; pass a file, e.g. "):
        load_config(tmp_path)
    assert str(load_config(tmp_path / "mine.yaml").data_dir) == "mine"
    spaced = tmp_path / "spaced.yaml"
    spaced.write_text('data:\n  system_prompt: "a\\tb"\n')  # a tab in a value is no indentation: loads
    assert load_config(spaced).data.system_prompt == "a\tb"


def test_each_run_checkpoints_under_its_own_name(tmp_path):
    from grpo_pipeline.tasks.job import build_job_spec

    cfg = load_config(None, ["train.checkpoint_uri=s3://bucket/grpo/"])
    splits = {"train": tmp_path / "train.jsonl", "val": tmp_path / "val.jsonl"}
    one = build_job_spec(cfg.train, cfg.model, "m", splits, tmp_path / "runs" / "20261130-0300-aaaa")
    two = build_job_spec(cfg.train, cfg.model, "m", splits, tmp_path / "runs" / "20261201-0300-bbbb")
    assert one.checkpoint_uri == "s3://bucket/grpo/20261130-0300-aaaa"
    assert one.checkpoint_uri != two.checkpoint_uri
    local = build_job_spec(load_config(None).train, load_config(None).model, "m", splits, tmp_path / "r")
    assert local.checkpoint_uri == str((tmp_path / "r" / "checkpoints").resolve())


def test_vllm_engine_without_vllm_says_how_to_get_it(tmp_path):
    from grpo_pipeline.configs.rewards import RewardSet
    from grpo_pipeline.configs.schema import EvalConfig, ModelConfig
    from grpo_pipeline.tasks.evaluate import evaluate_model, vllm_usable

    if vllm_usable():
        pytest.skip("vLLM is usable here")
    holdout = tmp_path / "holdout.jsonl"
    holdout.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "answer": "2"}\n')
    with pytest.raises(RuntimeError, match=r"pip install '.\[gpu\]'"):
        evaluate_model(
            "unused", ModelConfig(), holdout, RewardSet(names=("correct_answer",)), EvalConfig(engine="vllm")
        )


def test_reward_names_are_resolved_before_any_work_not_when_parsing():
    """Parsing stays free of project imports; the run's preflight resolves each reward and names the field."""
    from grpo_pipeline.tasks.job import check_rewards

    cfg = load_config(None, ["train.rewards=[bogus]"])
    with pytest.raises(ConfigError, match="train.rewards: unknown reward 'bogus'"):
        check_rewards(cfg.train.reward_set(), cfg.evaluate)


def test_the_library_fields_snapshot_is_the_installed_trl_and_peft():
    """configs/library_fields.json is what the installed TRL and PEFT declare; after an upgrade, refresh it with
    `python -m grpo_pipeline.configs.library_fields`."""
    import json

    from grpo_pipeline.configs.library_fields import SNAPSHOT, take_snapshot

    assert take_snapshot() == json.loads(SNAPSHOT.read_text())


def test_a_range_is_one_entry_of_a_real_numeric_library_field():
    """Each bound in configs/library_ranges.py names a field its class declares (a TRL or PEFT release that
    drops one fails here), of a numeric type; the values TRL's and PEFT's own defaults hold pass."""
    import typing

    from grpo_pipeline.configs.library_fields import fields
    from grpo_pipeline.configs.library_ranges import RANGES, problem

    for cls_name, bounds in RANGES.items():
        declared = fields(cls_name)
        for name in bounds:
            assert name in declared, f"{cls_name}.{name} is not a field of the installed library"
            assert {int, float} & {declared[name].type, *typing.get_args(declared[name].type)}, (cls_name, name)
            assert problem(cls_name, name, declared[name].default) is None, (cls_name, name)


@pytest.mark.parametrize("value, fits", [("-1", True), ("1", True), ("0", False), ("-2", False)])
def test_max_steps_minus_one_is_trls_train_by_epochs(value, fits):
    if fits:
        assert load_config(None, [f"train.grpo.max_steps={value}"]).train.grpo["max_steps"] == int(value)
    else:
        with pytest.raises(ConfigError, match="train.grpo.max_steps: .* or -1"):
            load_config(None, [f"train.grpo.max_steps={value}"])


def _literals_of(path, values: set) -> list[int]:
    """Lines of a file that spell `Literal[...]` with exactly `values`: a second definition of a typed-once set."""
    import ast

    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Literal"
        and isinstance(node.slice, ast.Tuple)
        and {e.value for e in node.slice.elts if isinstance(e, ast.Constant)} == values
    ]


def test_the_bases_quantization_modes_and_dtypes_are_typed_once():
    """`configs/dtypes.py` holds them; the config, the job spec the trainer reads and the planner's workload use
    those types (each once spelled its own Literal, and a new mode had to be added in each)."""
    from pathlib import Path
    from typing import get_args

    from grpo_pipeline.configs import dtypes
    from grpo_pipeline.configs.merge import MergeConfig
    from grpo_pipeline.configs.model import ModelConfig
    from grpo_pipeline.tasks.plan.workload import Workload
    from grpo_pipeline.trainer.spec import ModelLoad

    for cls in (ModelConfig, ModelLoad, Workload):
        assert cls.model_fields["quantization"].annotation == dtypes.Quantization, cls
    for cls, field in ((ModelConfig, "compute_dtype"), (ModelLoad, "compute_dtype"), (MergeConfig, "dtype")):
        assert cls.model_fields[field].annotation == dtypes.DType, cls
    assert Workload.model_fields["dtype"].annotation == dtypes.DType
    root = Path(__file__).parents[2]
    own = root / "configs" / "dtypes.py"
    sources = [
        p for d in ("configs", "trainer", "tasks", "infra", "flows", "grpo_pipeline") for p in (root / d).rglob("*.py")
    ]
    spelled = {
        f"{p.relative_to(root)}:{line}"
        for values in (set(get_args(dtypes.Quantization)), set(get_args(dtypes.DType)))
        for p in sources
        if p != own
        for line in _literals_of(p, values)
    }
    assert spelled == set()
    assert _literals_of(own, set(get_args(dtypes.Quantization))), "the scan finds a spelled Literal"


# One value other than its default for every train.* field the trainer reads (TrainerFields, which both build on)
NOT_DEFAULT = {
    "grpo": {"max_steps": 7, "learning_rate": 1.0e-4},
    "lora": {"r": 4},
    "checkpoint_every": 3,
    "keep_checkpoints": 5,
    "early_stopping_patience": 2,
    "s3_endpoint_url": "http://127.0.0.1:9000",
    "merged_generation": False,
    "prefill_once": False,
    "share_prompt_forward": False,
    "compact_lm_head": False,
    "skip_zero_advantage": False,
    "cpu_threads": 3,
    "distributed": {"timeout_s": 900},
    "health": {"kl_blowup": {"window": 4}, "format_hacking": {"action": "stop"}},
    "curriculum": {"enabled": False},
    "dynamic_sampling": {"oversample": 3.0},
}


def test_every_train_field_the_trainer_reads_reaches_its_job_spec_with_the_users_value(tmp_path):
    """TrainSettings is TrainConfig's projection: each field the trainer reads is declared once (TrainerFields) and
    neither side declares it again; set to a value other than its default, it comes back from the written spec as
    set (a field the copy missed would ship its default)."""
    from grpo_pipeline.configs.schema import TrainConfig
    from grpo_pipeline.configs.trainer_fields import TrainerFields
    from grpo_pipeline.tasks.job import build_job_spec
    from grpo_pipeline.trainer.spec import JobSpec, TrainSettings

    assert set(NOT_DEFAULT) == set(TrainerFields.model_fields)  # a new field the trainer reads must be added above
    assert set(TrainSettings.model_fields) == {*TrainerFields.model_fields, "rewards"}
    for name, declared in TrainerFields.model_fields.items():
        for side in (TrainConfig, TrainSettings):  # a re-declaration would be a field of its own, maybe unlike
            assert repr(side.model_fields[name]) == repr(declared), (side.__name__, name)
    default = TrainConfig()
    cfg = load_config(None, [f"train={NOT_DEFAULT}"])
    for name in NOT_DEFAULT:
        assert getattr(cfg.train, name) != getattr(default, name), name
    splits = {"train": tmp_path / "t.jsonl", "val": tmp_path / "v.jsonl"}
    spec = build_job_spec(cfg.train, cfg.model, "m", splits, tmp_path / "run")
    read = JobSpec.read(spec.write(tmp_path / "job.json")).train
    for name in NOT_DEFAULT:
        assert getattr(read, name) == getattr(cfg.train, name), name
    assert read.rewards == cfg.train.reward_set()
