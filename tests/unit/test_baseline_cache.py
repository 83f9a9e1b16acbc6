"""The baseline's scores computed once (`grpo_pipeline.tasks.baseline_cache`): every part of the key recomputes when it
changes, a corrupt or foreign entry is ignored with a warning, a store that cannot be read or written costs the
cache and not the run, and the switch turns it off. No model: the evaluation is a counted stand-in."""

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import EvalConfig, ModelConfig, load_config
from grpo_pipeline.tasks import baseline_cache as bc
from grpo_pipeline.tasks.evaluate import EvalResult, score, write_jsonl

REWARDS = RewardSet(entries=["correct_answer", {"name": "number_only", "weight": 0.2}])
CFG = EvalConfig(engine="transformers", max_new_tokens=6, batch_size=4)
ROWS = [{"key": f"k{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]


@pytest.fixture
def world(tmp_path):
    """A base directory, an adapter directory and a holdout file: what the key reads (no model is loaded)."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    (base / "model.safetensors").write_bytes(b"\0" * 64)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"\1" * 32)
    holdout = write_jsonl(tmp_path / "holdout.jsonl", ROWS)
    return {"model_path": str(base), "adapter": str(adapter), "holdout": holdout, "tmp": tmp_path}


def _key(world, model_cfg=None, rows=None, rewards=REWARDS, cfg=CFG, adapter="same", model_path=None):
    parts = bc.baseline_parts(
        model_path or world["model_path"],
        model_cfg or ModelConfig(),
        ROWS if rows is None else rows,
        rewards,
        cfg,
        world["adapter"] if adapter == "same" else adapter,
    )
    return bc.cache_key(parts)


def _other_path(world):
    shutil.copytree(world["model_path"], world["tmp"] / "base2")
    return {"model_path": str(world["tmp"] / "base2")}


def _rewritten_weights(world):
    (Path(world["model_path"]) / "model.safetensors").write_bytes(b"\0" * 65)
    return {}


def _other_adapter(world):
    (Path(world["adapter"]) / "adapter_model.safetensors").write_bytes(b"\2" * 32)
    return {}


def _changed_code(world, monkeypatch):
    module = world["tmp"] / "scoring_extra.py"
    module.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(world["tmp"]))
    monkeypatch.setattr(bc, "SCORING_CODE", (*bc.SCORING_CODE, "scoring_extra"))
    before = _key(world)
    module.write_text("X = 2\n")
    return before


SAMPLED = CFG.model_copy(update={"samples_k": 4})

# each: (what changed, the config's before/after, or a function that changes the world and returns _key's arguments)
CHANGES = {
    "model path": _other_path,
    "model files (a rewritten weight)": _rewritten_weights,
    "adapter content": _other_adapter,
    "no adapter": lambda w: {"adapter": None},
    "quantization": lambda w: {"model_cfg": ModelConfig(quantization="nf4")},
    "dtype": lambda w: {"model_cfg": ModelConfig(compute_dtype="bfloat16")},
    "holdout answer": lambda w: {"rows": [ROWS[0] | {"answer": "9"}, *ROWS[1:]]},
    "holdout order": lambda w: {"rows": ROWS[::-1]},
    "holdout row removed": lambda w: {"rows": ROWS[:-1]},
    "max_new_tokens": lambda w: {"cfg": CFG.model_copy(update={"max_new_tokens": 7})},
    "batch_size": lambda w: {"cfg": CFG.model_copy(update={"batch_size": 2})},
    "engine": lambda w: {"cfg": CFG.model_copy(update={"engine": "vllm"})},
    "sampling turned on": lambda w: {"cfg": SAMPLED},
    "reward weight": lambda w: {
        "rewards": RewardSet(entries=["correct_answer", {"name": "number_only", "weight": 0.3}])
    },
    "reward argument": lambda w: {
        "rewards": RewardSet(entries=[{"name": "correct_answer", "args": {"tolerance": 0.5}}, "number_only"])
    },
    "reward added": lambda w: {"rewards": RewardSet(entries=["correct_answer", "number_only", "overlong_penalty"])},
    "accuracy reward": lambda w: {"cfg": CFG.model_copy(update={"accuracy_reward": "math_answer"})},
    "format reward": lambda w: {"cfg": CFG.model_copy(update={"format_reward": None})},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_part_of_the_key_recomputes_when_it_changes(world, change):
    before = _key(world)
    assert _key(world) == before  # the same inputs: the same key
    assert _key(world, **CHANGES[change](world)) != before


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", 0.5), ("seed", 1), ("samples_k", 8)], ids=["temperature", "seed", "k"]
)
def test_sampling_settings_count_only_when_the_evaluation_samples(world, field, value):
    assert _key(world, cfg=SAMPLED.model_copy(update={field: value})) != _key(world, cfg=SAMPLED)
    if field != "samples_k":  # greedy only: the sampling settings change nothing
        assert _key(world, cfg=CFG.model_copy(update={field: value})) == _key(world)


def test_the_code_and_the_libraries_are_in_the_key(world, monkeypatch):
    before = _changed_code(world, monkeypatch)  # a scoring module's source edited
    assert _key(world) != before
    before = _key(world)
    monkeypatch.setattr(bc, "library_versions", lambda engine: {"torch": "0.0"})
    assert _key(world) != before


def test_a_custom_rewards_module_is_in_the_code_version(world, monkeypatch):
    (world["tmp"] / "team_reward.py").write_text("def grade(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(world["tmp"]))
    rewards = RewardSet(entries=[{"name": "team_reward:grade", "role": "skill"}])
    before = _key(world, rewards=rewards)
    (world["tmp"] / "team_reward.py").write_text("def grade(completions, **kw):\n    return [0.0] * len(completions)\n")
    assert _key(world, rewards=rewards) != before


def test_what_does_not_change_the_scores_keeps_the_key(world):
    before = _key(world)
    # the champion's adapter downloaded afresh each run: new files, same bytes
    again = world["tmp"] / "adapter-again"
    shutil.copytree(world["adapter"], again)
    os.utime(again / "adapter_model.safetensors", (1, 1))
    assert _key(world, adapter=str(again)) == before
    assert _key(world, cfg=CFG.model_copy(update={"examples": 7})) == before  # the examples are picked again
    assert _key(world, rows=[{k: r[k] for k in reversed(list(r))} for r in ROWS]) == before  # a row's field order


# ------------------------------------------------------------------------------------------------ reuse


class Counted:
    """A stand-in evaluation: scores fixed completions with the real `score`, and counts its calls."""

    def __init__(self, completions=("1", "2", "x", "4")):
        self.calls = 0
        self.completions = list(completions)

    def __call__(self) -> EvalResult:
        self.calls += 1
        result = score(ROWS, self.completions, REWARDS, [1] * len(ROWS), extra=["correct_answer", "number_only"])
        return result.model_copy(update={"metrics": {"accuracy": 0.5}})


def _scores(world, evaluate, data_dir, cfg=CFG, say=None, holdout=None):
    return bc.baseline_scores(
        evaluate,
        data_dir=data_dir,
        model_path=world["model_path"],
        model_cfg=ModelConfig(),
        holdout=holdout or world["holdout"],
        rewards=REWARDS,
        cfg=cfg,
        label="base",
        say=say or (lambda line: None),
    )


def test_the_second_run_reads_the_scores_the_first_computed(world):
    data_dir, evaluate, said = world["tmp"] / "data", Counted(), []
    first = _scores(world, evaluate, data_dir, say=said.append)
    second = _scores(world, evaluate, data_dir, say=said.append)
    assert evaluate.calls == 1
    assert (first.cached, second.cached) == (False, True) and first.cache_key == second.cache_key
    assert second.rows == first.rows and second.reward == first.reward and second.per_reward == first.per_reward
    assert second.metrics == first.metrics and second.n == first.n
    assert "not in the cache yet" in said[0] and "come from the cache" in said[1]
    entries = list(bc.store_dir(data_dir).iterdir())
    assert [p.name for p in entries] == [f"{first.cache_key[:32]}.json"]  # written aside, renamed: no stray file
    # the examples are picked again with the run's own count
    assert len(_scores(world, evaluate, data_dir, cfg=CFG.model_copy(update={"examples": 1})).examples) == 2
    assert evaluate.calls == 1


def test_a_changed_holdout_recomputes_and_the_log_says_so(world):
    data_dir, evaluate, said = world["tmp"] / "data", Counted(), []
    _scores(world, evaluate, data_dir)
    changed = write_jsonl(world["tmp"] / "other.jsonl", [ROWS[0] | {"answer": "7"}, *ROWS[1:]])
    result = _scores(world, evaluate, data_dir, say=said.append, holdout=changed)
    assert evaluate.calls == 2 and not result.cached
    assert said == [
        "base's holdout scores are not in the cache: the closest kept entry differs in holdout; recomputing"
    ]
    _scores(world, evaluate, data_dir, cfg=CFG.model_copy(update={"max_new_tokens": 9}), say=said.append)
    assert "differs in generation settings" in said[-1]


def test_the_switch_turns_the_cache_off(world):
    evaluate = Counted()
    off = [_scores(world, evaluate, None) for _ in range(2)]
    assert evaluate.calls == 2 and [r.cached for r in off] == [False, False] and off[0].cache_key is None
    assert not (world["tmp"] / "baseline-scores").exists()
    assert EvalConfig().cache_baseline is True
    assert load_config(None, ["evaluate.cache_baseline=false"]).evaluate.cache_baseline is False


# ------------------------------------------------------------------------------------------------ bad input


def _entry(world, data_dir) -> Path:
    _scores(world, Counted(), data_dir)
    (path,) = bc.store_dir(data_dir).iterdir()
    return path


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


CORRUPT = {
    "not JSON": lambda p: p.write_text("{not json"),
    "JSON, not an entry": lambda p: p.write_text('{"rows": []}'),
    "another key inside": lambda p: _edit(p, lambda d: d.update(key="0" * 64)),
    "a row missing": lambda p: _edit(p, lambda d: d["result"]["rows"].pop()),
    "keys not the holdout's": lambda p: _edit(p, lambda d: d["result"]["rows"][0].update(key="elsewhere")),
    "a score that is not a number": lambda p: _edit(p, lambda d: d["result"]["rows"][0].update(total="1.0")),
    "a reward column missing": lambda p: _edit(p, lambda d: d["result"]["rows"][1].pop("number_only")),
    "a mean that is not its rows'": lambda p: _edit(p, lambda d: d["result"].update(reward=9.0)),
    "another format": lambda p: _edit(p, lambda d: d.update(format=2)),
}


@pytest.mark.parametrize("corruption", list(CORRUPT))
def test_a_corrupt_or_foreign_entry_is_ignored_with_a_warning_and_replaced(world, corruption, caplog):
    data_dir = world["tmp"] / "data"
    path = _entry(world, data_dir)
    CORRUPT[corruption](path)
    evaluate = Counted()
    with caplog.at_level(logging.WARNING, logger=bc.__name__):
        result = _scores(world, evaluate, data_dir)
    assert evaluate.calls == 1 and not result.cached  # never trusted: computed afresh
    assert f"ignoring the baseline cache entry {path}" in caplog.text
    assert _scores(world, evaluate, data_dir).cached and evaluate.calls == 1  # the fresh scores replaced it


def test_an_unwritable_store_costs_the_cache_not_the_run(world, caplog):
    data_dir = world["tmp"] / "data"
    data_dir.mkdir()
    bc.store_dir(data_dir).write_text("a file where the store should be")
    evaluate, said = Counted(), []
    with caplog.at_level(logging.WARNING, logger=bc.__name__):
        results = [_scores(world, evaluate, data_dir, say=said.append) for _ in range(2)]
    assert evaluate.calls == 2 and not any(r.cached for r in results)
    assert results[0].rows == results[1].rows
    assert "cannot be read" in caplog.text and "cannot be written" in caplog.text
    assert any("the run goes on without" in line for line in said)  # in the run's log too


def test_an_unreadable_entry_is_computed_without_it(world, caplog):
    data_dir = world["tmp"] / "data"
    path = _entry(world, data_dir)
    path.unlink()
    path.mkdir()  # reading it fails (IsADirectoryError), as a permission error would
    evaluate = Counted()
    with caplog.at_level(logging.WARNING, logger=bc.__name__):
        assert not _scores(world, evaluate, data_dir).cached
    assert evaluate.calls == 1 and "cannot be read" in caplog.text


def test_the_store_keeps_the_newest_entries_and_only_its_own_names(world, monkeypatch):
    data_dir = world["tmp"] / "data"
    store = bc.store_dir(data_dir)
    store.mkdir(parents=True)
    (store / "notes.json").write_text("{}")  # not a name the cache writes: left alone
    monkeypatch.setattr(bc, "KEEP", 2)
    keys = []
    for tokens in (5, 6, 7):
        result = _scores(world, Counted(), data_dir, cfg=CFG.model_copy(update={"max_new_tokens": tokens}))
        keys.append(result.cache_key[:32])
        os.utime(store / f"{keys[-1]}.json", (tokens, tokens))  # distinct ages, whatever the clock's resolution
    assert sorted(p.name for p in store.iterdir()) == sorted(["notes.json", f"{keys[1]}.json", f"{keys[2]}.json"])
