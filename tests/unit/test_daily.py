"""Daily retraining, without a model or an MLflow server: the warm start's reference and checks (model.init_adapter),
the configuration hash, the skip decision and the incremental train split (issue #26)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.flows.warm_start import warm_start_stage
from grpo_pipeline.tasks.data.splits import incremental_rows
from grpo_pipeline.tasks.data.stage import config_hash, incremental_split, unchanged_reason
from grpo_pipeline.tasks.promote.registry import Registry
from grpo_pipeline.trainer.loading import adapter_mismatch

ADAPTER = {"base_model_name_or_path": "org/base", "r": 4, "target_modules": ["q_proj", "v_proj"]}


class Missing(Exception):
    error_code = "RESOURCE_DOES_NOT_EXIST"


class FakeClient:
    """The registry calls a warm start makes, answered from a dict of versions."""

    errors = (Missing,)

    def __init__(self, versions: dict[str, SimpleNamespace], aliases: dict[str, str]):
        self.versions, self.alias = versions, aliases

    def get_model_version_by_alias(self, name, alias):
        if alias not in self.alias:
            raise Missing(alias)
        return SimpleNamespace(version=self.alias[alias])

    def get_model_version(self, name, version):
        if version not in self.versions:
            raise Missing(version)
        return self.versions[version]


def _adapter(tmp_path: Path, **config) -> Path:
    directory = tmp_path / "adapter-src"
    directory.mkdir(exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({**ADAPTER, **config}))
    return directory


def _registry(tmp_path, tags=None, aliases=None, **config) -> Registry:
    version = SimpleNamespace(source=str(_adapter(tmp_path, **config)), tags=tags or {"base_config": "org/base"})
    return Registry(FakeClient({"3": version}, aliases if aliases is not None else {"champion": "3"}), "grpo-adapter")


def _cfg(tmp_path, *overrides):
    return load_config(
        None,
        [
            f"data_dir={tmp_path}",
            "model.base=org/base",
            "train.lora.r=4",
            "train.lora.target_modules=[q_proj, v_proj]",
            *overrides,
        ],
    )


def test_champion_resolves_to_its_version_and_adapter(tmp_path):
    ws = warm_start_stage(_cfg(tmp_path, "model.init_adapter=champion"), _registry(tmp_path), tmp_path / "run")
    assert (ws.uri, ws.version, ws.parent) == ("models:/grpo-adapter/3", "3", "v3")
    assert json.loads((Path(ws.adapter_dir) / "adapter_config.json").read_text())["r"] == 4


def test_no_champion_yet_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"no 'champion' alias yet.*model.init_adapter=none.*models:/grpo-adapter/"):
        warm_start_stage(_cfg(tmp_path, "model.init_adapter=champion"), _registry(tmp_path, aliases={}), tmp_path)


def test_unknown_version_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no version 9"):
        warm_start_stage(_cfg(tmp_path, "model.init_adapter=models:/grpo-adapter/9"), _registry(tmp_path), tmp_path)


@pytest.mark.parametrize(
    "config, tags, expected",
    [
        ({"r": 16}, None, "LoRA rank r=16, train.lora.r is 4; set train.lora.r=16"),
        ({"target_modules": ["o_proj"]}, None, "target_modules are \\['o_proj'\\]"),
        ({"base_model_name_or_path": "org/other"}, {"base_config": "org/other"}, "trained on base 'org/other'"),
    ],
)
def test_another_shape_or_base_is_refused_before_any_work(tmp_path, config, tags, expected):
    registry = _registry(tmp_path, tags=tags, **config)
    with pytest.raises(ConfigError, match=f"model.init_adapter \\(models:/grpo-adapter/3\\): .*{expected}"):
        warm_start_stage(_cfg(tmp_path, "model.init_adapter=champion"), registry, tmp_path / "run")
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()  # no data stage, no run


def test_all_linear_matches_a_named_module_list():
    assert adapter_mismatch(ADAPTER, {"org/base"}, {"r": 4, "target_modules": "all-linear"}) is None
    assert adapter_mismatch(ADAPTER, None, {"r": 8}).startswith("the adapter has LoRA rank r=4")  # PEFT's default 8


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.init_adapter=/tmp/adapter", "model.init_adapter: '/tmp/adapter' is not 'none', 'champion'"),
        ("data.replay_fraction=1.5", "data.replay_fraction: Input should be less than or equal to 1"),
        ("data.incremental=true", "data.incremental .* needs one: set model.init_adapter=champion"),
        (
            "model.init_adapter=champion hpo.enabled=true hpo.space.lora_r=null",
            "hpo.space.lora_alpha_ratio: a warm start .* keeps its adapter's LoRA rank and alpha; set "
            "hpo.space.lora_alpha_ratio=null",
        ),
        ("model.init_adapter=champion hpo.enabled=true", "hpo.space.lora_r: a warm start"),
    ],
)
def test_bad_input_names_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())


def test_config_hash_ignores_where_and_how_a_run_happens():
    same = load_config(
        None,
        [
            "data_dir=/elsewhere",
            "tracking.experiment=x",
            "plan.budget_usd=5",
            "train.launcher=sky",
            "data.skip_unchanged=true",
            "deploy.schedule_hour=1",
        ],
    )
    assert config_hash(same) == config_hash(load_config(None))
    assert config_hash(load_config(None, ["train.lora.r=8"])) != config_hash(load_config(None))


def test_skip_only_when_rows_and_configuration_are_the_champions():
    tags = {"dataset_fingerprint": "f1", "config_hash": "c1"}
    assert "champion v2 was trained on this dataset" in unchanged_reason("2", tags, "f1", "c1", None)
    assert "no train row of dataset f2 is new" in unchanged_reason("2", tags, "f2", "c1", 0)  # only holdout rows grew
    assert unchanged_reason("2", tags, "f2", "c1", 3) is None  # new rows
    assert unchanged_reason("2", tags, "f1", "c9", 0) is None  # another configuration
    assert unchanged_reason("2", {}, "f1", "c1", None) is None  # a champion from before: no hash recorded


def test_incremental_split_is_new_rows_plus_a_reproducible_replay(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": str(i), "key": f"k{i}"}) + "\n" for i in range(100))
    )
    seen = {f"k{i}" for i in range(80)}
    path, new, replayed = incremental_split(train, seen, 0.25, "fp1", tmp_path / "out" / "train.jsonl")
    keys = [json.loads(line)["key"] for line in path.read_text().splitlines()]
    assert (new, replayed, len(keys)) == (20, 20, 40)
    assert {f"k{i}" for i in range(80, 100)} <= set(keys)
    again, *_ = incremental_split(train, seen, 0.25, "fp1", tmp_path / "again.jsonl")
    assert again.read_text() == path.read_text()  # the same sample on a rerun
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert incremental_rows(rows[::-1], seen, 0.25, "fp1")[0] == incremental_rows(rows, seen, 0.25, "fp1")[0][::-1]
    assert incremental_rows(rows, seen, 0.0, "fp1")[1:] == (20, 0) and incremental_rows(rows, seen, 1.0, "fp1")[2] == 80


def test_champion_or_base_continues_the_champion_once_there_is_one(tmp_path):
    """The daily recipe's warm start: the champion when the registry has one; none yet (a schedule's first day) is a
    cold run, said in words (`cold_start_note`), where `champion` refuses it."""
    from grpo_pipeline.flows.warm_start import cold_start_note

    cfg = _cfg(tmp_path, "model.init_adapter=champion_or_base", "data.incremental=true")  # incremental allowed
    ws = warm_start_stage(cfg, _registry(tmp_path), tmp_path / "run")
    assert (ws.uri, ws.version) == ("models:/grpo-adapter/3", "3") and cold_start_note(cfg, ws) is None
    assert warm_start_stage(cfg, _registry(tmp_path, aliases={}), tmp_path / "run") is None
    assert "no champion in registered model 'grpo-adapter' yet: a cold run" in cold_start_note(cfg, None)
    # a champion of another shape is still refused, not silently replaced by a cold run
    with pytest.raises(ConfigError, match="LoRA rank r=16"):
        warm_start_stage(cfg, _registry(tmp_path, r=16), tmp_path / "run")


def test_the_daily_recipe_without_its_folder_says_where_to_put_the_files(tmp_path, monkeypatch):
    """configs/daily-cpu.yaml reads data/daily where the runs work: missing or empty, preflight stops naming it."""
    from grpo_pipeline.tasks.data.sources import DataSourceError, check_local_sources

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "daily-cpu.yaml")
    assert cfg.model.init_adapter == "champion_or_base" and cfg.data.incremental and cfg.data.skip_unchanged
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataSourceError, match=r"data\.source: \./data/daily does not exist: create the folder \(.*"):
        check_local_sources(cfg.data)
    (tmp_path / "data" / "daily").mkdir(parents=True)
    (tmp_path / "data" / "daily" / "2026-12-07.jsonl.part").write_text("{}\n")  # still being written: not read
    with pytest.raises(
        DataSourceError, match=r"\./data/daily holds no .* file yet: put the rows there.*2026-12-07\.jsonl"
    ):
        check_local_sources(cfg.data)
    (tmp_path / "data" / "daily" / "2026-12-07.jsonl.part").rename(tmp_path / "data" / "daily" / "2026-12-07.jsonl")
    check_local_sources(cfg.data)
