"""The run's rewards as one value (`grpo_pipeline.configs.rewards.RewardSet`): resolved once from the config, and every stage
that ranks models ranks by its weighted total, the one GRPO optimises and promotion compares. Before it, the
search's scorer, base selection and the quantization cost summed the rewards unweighted.

Two models whose unweighted and weighted totals order differently, with no model loaded (generation is
replaced; scoring, selection, the search and the quantization verdict are the real ones):

- "wordy" answers every question right in words: correct_answer 1, number_only 0; 1.0 either way.
- "terse" gives a bare number, right on even answers only: correct_answer 0.5, number_only 1; 1.5 unweighted,
  0.7 with number_only weighed 0.2.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from pydantic import ValidationError

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ConfigError, PipelineConfig, QuantizationBound, load_config
from grpo_pipeline.tasks.data.demo_task import make_row

WEIGHED = "train.rewards=[correct_answer, {name: number_only, weight: 0.2}]"
UNWEIGHTED = "train.rewards=[correct_answer, number_only]"  # the default is the skill alone
ENGINE = "evaluate.engine=transformers"  # "auto" would import torch to look for a GPU


def _answer(model: str, row: dict) -> str:
    if model.endswith("wordy"):
        return f"The answer is {row['answer']}."
    return row["answer"] if int(row["answer"]) % 2 == 0 else "-1"


class _FakeModel:
    """What `load_model` returns for a name: generation is `_answer`'s, by the model's (or adapter's) name."""

    def __init__(self, name: str, quantization: str = "none"):
        self.name, self.quantization = name, quantization

    def eval(self) -> _FakeModel:
        return self

    def get_memory_footprint(self) -> int:
        return 100 if self.quantization == "none" else 30


@pytest.fixture
def val8(tmp_path) -> Path:
    """8 rows whose answers are 1..8: half of them even."""
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(make_row(a, 1)) + "\n" for a in range(8)))
    return path


@pytest.fixture
def fake_generation(monkeypatch, val8):
    """Generation by model name, for `grpo_pipeline.tasks.evaluate` and `grpo_pipeline.tasks.quantize`, without loading anything; and no
    transformers either: `grpo_pipeline.trainer.callbacks` (progress bars, the libraries' loading bars) would import it."""
    import grpo_pipeline.tasks.evaluate
    import grpo_pipeline.tasks.quantize

    quiet = types.SimpleNamespace(interactive=lambda: False, hide_library_bars=lambda: None)
    monkeypatch.setitem(sys.modules, "grpo_pipeline.trainer.callbacks", quiet)

    rows = {json.dumps(r["prompt"]): r for r in map(json.loads, val8.read_text().splitlines())}

    def load_model(path, load, adapter=None):
        return _FakeModel(adapter or path, load.quantization), None

    def generate(model, tokenizer, prompts, max_new_tokens, batch_size, label=""):
        # the quantization cost measures one base twice: quantized, it answers tersely
        name = model.name if model.quantization == "none" else "terse"
        texts = [_answer(name, rows[json.dumps(p)]) for p in prompts]
        return texts, [len(t.split()) for t in texts]

    for module in (grpo_pipeline.tasks.evaluate, grpo_pipeline.tasks.quantize):
        monkeypatch.setattr(module, "load_model", load_model)
        monkeypatch.setattr(module, "generate", generate)
    monkeypatch.setattr(grpo_pipeline.tasks.quantize, "answer_perplexity", lambda *a, **k: 2.0)


def test_the_config_resolves_one_frozen_value_with_trls_weights():
    rewards = load_config(None, [WEIGHED]).train.reward_set()
    assert rewards == RewardSet(names=("correct_answer", "number_only"), weights=(1.0, 0.2))
    assert load_config(None, [UNWEIGHTED]).train.reward_set().weights == (1.0, 1.0)  # unweighted: TRL's default
    assert rewards.total({"correct_answer": 0.0, "number_only": 1.0}) == 0.2
    with pytest.raises(ValidationError, match="frozen"):
        rewards.entries = ()
    with pytest.raises(ValidationError, match="every reward weight is 0"):
        RewardSet(names=("correct_answer",), weights=(0.0,))
    with pytest.raises(ValidationError, match="arguments for think_format, which are not among the rewards"):
        RewardSet(names=("correct_answer",), args={"think_format": {}})


# A job spec as the pipeline wrote it before the RewardSet travelled whole (printed by that commit's
# `build_job_spec`): the rewards as three loose fields, their weights in TRL's own `grpo.reward_weights`.
SPEC_BEFORE = """{"model_path": "/models/base", "model": {"quantization": "none", "double_quant": false,
 "compute_dtype": "float32", "trust_remote_code": false}, "train": {"grpo": {"max_steps": 20,
 "per_device_train_batch_size": 8, "reward_weights": [1.0, 0.25]}, "lora": {}, "rewards": ["math_answer",
 "think_format"], "reward_args": {"math_answer": {"answer_tag": "final"}}, "checkpoint_every": 10,
 "keep_checkpoints": 2, "early_stopping_patience": null, "s3_endpoint_url": null, "distributed": {"nodes": 1,
 "processes_per_node": null, "strategy": "ddp", "timeout_s": 600, "accelerate": {}, "vllm_server_gpus": 0,
 "vllm_server_node": false}, "health": {"zero_variance": {"action": "warn", "window": 5, "threshold": 0.9},
 "entropy_collapse": {"action": "warn", "window": 5, "threshold": 0.1}, "length_drift": {"action": "warn",
 "window": 5, "threshold": 3.0}, "clipped_completions": {"action": "warn", "window": 5, "threshold": 0.5},
 "kl_blowup": {"action": "stop", "window": 3, "threshold": 1.0}, "reward_collapse": {"action": "warn", "window": 5,
 "threshold": 0.01}, "non_finite": {"action": "rollback", "window": 1, "threshold": 0.0}, "max_rollbacks": 2,
 "rollback_lr_factor": 0.5}, "curriculum": {"enabled": true, "patience": 2, "max_skips": 2}, "dynamic_sampling":
 {"enabled": true, "oversample": 2.0}}, "train_file": "/data/train.jsonl", "val_file": null, "work_dir":
 "/runs/20261201-0300-abcd/train", "checkpoint_uri": "/runs/20261201-0300-abcd/checkpoints", "adapter_dir":
 "/runs/20261201-0300-abcd/adapter", "init_adapter": null, "init_adapter_files": null, "mlflow_tracking_uri": null,
 "mlflow_experiment": "grpo-pipeline", "mlflow_run_id": null}"""
SETS_BEFORE = [  # the configuration that spec was built from, in today's entry form
    "train.rewards=[{name: math_answer, args: {answer_tag: final}}, {name: think_format, weight: 0.25}]",
    "train.grpo.max_steps=20",
    "train.grpo.per_device_train_batch_size=8",
    "train.health.kl_blowup.action=stop",
    "train.curriculum.patience=2",
    "train.dynamic_sampling.enabled=true",
]


def test_the_job_spec_carries_the_rewards_whole_and_the_trainer_gives_trl_their_weights(tmp_path):
    from grpo_pipeline.tasks.job import build_job_spec
    from grpo_pipeline.trainer.spec import JobSpec
    from grpo_pipeline.trainer.train import grpo_args

    cfg = load_config(None, [*SETS_BEFORE, "train.grpo.bf16=false"])
    spec = build_job_spec(cfg.train, cfg.model, "m", {"train": tmp_path / "t", "val": tmp_path / "v"}, tmp_path / "run")
    read = JobSpec.read(spec.write(tmp_path / "job.json"))
    assert read.train.rewards == cfg.train.reward_set()
    assert read.train.rewards.args_for("math_answer") == {"answer_tag": "final"}
    assert "reward_weights" not in read.train.grpo  # one place for the weights
    assert grpo_args(read, tmp_path / "hf").reward_weights == [1.0, 0.25]


def test_a_job_spec_written_before_reads_as_the_same_job():
    from grpo_pipeline.tasks.job import train_settings
    from grpo_pipeline.trainer.spec import JobSpec

    before = JobSpec.model_validate_json(SPEC_BEFORE)
    assert before.train == train_settings(load_config(None, SETS_BEFORE).train)
    unweighted = json.loads(SPEC_BEFORE)
    del unweighted["train"]["grpo"]["reward_weights"]
    assert JobSpec.model_validate(unweighted).train.rewards.weights == (1.0, 1.0)
    twice = before.model_dump(mode="json")
    twice["train"]["grpo"]["reward_weights"] = [1.0, 0.25]
    with pytest.raises(ValidationError, match="grpo.reward_weights: the weights travel in rewards' entries"):
        JobSpec.model_validate(twice)


def test_a_version_1_spec_reads_as_entries_and_one_whose_skill_cannot_be_told_is_refused_whole():
    """Version 1 carried the RewardSet as parallel lists (names, args, weights): read, each role the reward's
    default. A set with no skill reward by those defaults is refused with the version and the fix, never read in
    part."""
    from grpo_pipeline.tasks.job import train_settings
    from grpo_pipeline.trainer.spec import SPEC_VERSION, JobSpec

    v1 = json.loads(SPEC_BEFORE)
    train = v1["train"]
    train["rewards"] = {"names": train["rewards"], "args": train.pop("reward_args"), "weights": [1.0, 0.25]}
    del train["grpo"]["reward_weights"]
    read = JobSpec.model_validate(v1)
    assert read.train == train_settings(load_config(None, SETS_BEFORE).train) and read.version == SPEC_VERSION
    assert read.train.rewards.skill == "math_answer"
    train["rewards"] = {"names": ["think_format"], "args": {}, "weights": [1.0]}
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(v1)
    message = str(err.value)
    assert "a job spec of version 1" in message and f"version {SPEC_VERSION}" in message
    assert "train.rewards has no skill reward" in message and "role: skill" in message
    v0 = json.loads(SPEC_BEFORE)
    v0["train"]["rewards"] = ["math_answer", "remote_verifier"]
    v0["train"]["grpo"]["reward_weights"] = [1.0, 1.0]
    with pytest.raises(ValidationError, match="a job spec of version 0 .* 2 skill rewards"):
        JobSpec.model_validate(v0)
    newer = {**json.loads(read.model_dump_json()), "version": SPEC_VERSION + 1}
    with pytest.raises(ValidationError, match=f"job spec version {SPEC_VERSION + 1} is newer than this trainer"):
        JobSpec.model_validate(newer)


def test_base_selection_picks_by_the_weighted_total(fake_generation, val8, tmp_path, monkeypatch):
    import grpo_pipeline.tasks.select
    from grpo_pipeline.tasks.select import CandidateRow, select_base_model

    monkeypatch.setattr(grpo_pipeline.tasks.select, "resolve_base_model", lambda model, cache: model.base)
    monkeypatch.setattr(
        grpo_pipeline.tasks.select,
        "price",
        lambda model, train, planning, path, rows=None: CandidateRow(
            base=model.base, path=path, fits=True, within_budget=True, cost_usd=1.0, params_b=0.1
        ),
    )

    def chosen(*overrides: str) -> tuple[str, dict[str, float]]:
        cfg = load_config(None, ["model.candidates=[terse, wordy]", ENGINE, UNWEIGHTED, *overrides])
        selection = select_base_model(
            cfg.model, cfg.train, cfg.plan, cfg.evaluate, cfg.train.reward_set(), val8, tmp_path
        )
        return selection.chosen, {r.base: r.reward for r in selection.rows}

    assert chosen() == ("terse", {"terse": 1.5, "wordy": 1.0})
    assert chosen(WEIGHED) == ("wordy", {"terse": pytest.approx(0.7), "wordy": 1.0})


def test_the_quantization_cost_is_the_weighted_totals_drop(fake_generation, val8):
    from grpo_pipeline.tasks.quantize import measure_quantization_cost

    def cost(*overrides: str):
        cfg = load_config(None, ["model.quantization=nf4", UNWEIGHTED, *overrides])
        return measure_quantization_cost(
            "wordy", cfg.model, val8, cfg.train.reward_set(), cfg.evaluate, QuantizationBound(rows=8)
        )

    unweighted = cost()  # terse scores higher unweighted: quantizing looks free
    assert (unweighted.unquantized.reward, unweighted.quantized.reward) == (1.0, 1.5) and unweighted.accepted
    weighted = cost(WEIGHED)  # ... and costs 0.3 of what training optimises
    assert weighted.reward_drop == pytest.approx(0.3) and not weighted.accepted
    assert weighted.reasons[0].startswith("reward drops by 0.300 (1.000 -> 0.700)")


def test_the_search_scores_and_picks_trials_by_the_skill_whatever_the_formats_weight(fake_generation, val8, tmp_path):
    """The terse trial wins on the total unweighted (1.5 against 1.0) by its format alone; the search scores the
    skill (correct_answer), where the wordy trial is right twice as often, with the format weighed or not."""
    from grpo_pipeline.tasks.hpo import TrialOutcome, suggest
    from tests.unit.test_hpo import run_search

    def run_one(trial, job):
        suggest(trial, job.hpo.space)
        adapter = tmp_path / f"{trial.number}-{('terse', 'wordy')[trial.number]}"
        adapter.mkdir(exist_ok=True)
        return TrialOutcome(value=0.0, steps=job.hpo.steps, adapter_dir=str(adapter))

    def searched(name: str, *overrides: str):
        cfg: PipelineConfig = load_config(
            None,
            [
                f"data_dir={tmp_path / name}",
                "hpo.trials=2",
                "hpo.trial_score=greedy",
                "hpo.keep_configured=false",
                "hpo.pruner=none",
                "hpo.reward_sd=1.0",
                "hpo.target_standard_error=0.5",
                "hpo.rescore_top_k=2",
                ENGINE,
                *overrides,
            ],
        )
        return run_search(cfg, "base", {"val": val8}, tmp_path / name, rewards=cfg.train.reward_set(), run_one=run_one)

    unweighted = searched("unweighted")
    assert unweighted.best_trial == 1 and unweighted.rescored == {0: 0.5, 1: 1.0}
    weighted = searched("weighted", WEIGHED)
    assert weighted.best_trial == 1 and weighted.rescored == {0: 0.5, 1: 1.0}
    assert {t.number: t.value for t in weighted.trials} == {0: 0.5, 1: 1.0}


def test_the_search_sizes_its_prompts_by_the_skills_spread():
    from grpo_pipeline.configs.schema import HPOConfig
    from grpo_pipeline.tasks.hpo import prompts_needed

    hpo = HPOConfig(target_standard_error=0.05)
    # the skill, a score in [0, 1]: SD at most 0.5, whatever the shaping rewards and their weights
    assert prompts_needed(hpo, load_config(None).train.reward_set()) == (100, 0.5)
    assert prompts_needed(hpo, load_config(None, [WEIGHED]).train.reward_set()) == (100, 0.5)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "evaluate.accuracy_reward=corect_answer",
            "evaluate.accuracy_reward: unknown reward 'corect_answer'; did you mean 'correct_answer'?",
        ),
        (
            "evaluate.format_reward=nomber_only",
            "evaluate.format_reward: unknown reward 'nomber_only'; did you mean 'number_only'?",
        ),
        (
            "evaluate.format_reward=nowhere.module:fn",
            "evaluate.format_reward: reward 'nowhere.module:fn' cannot be imported",
        ),
        (
            "evaluate.accuracy_reward=remote_verifier",
            "evaluate.accuracy_reward (not in train.rewards, so bound with no "
            "arguments): reward 'remote_verifier' needs the argument url",
        ),
        (
            "train.rewards=[correct_answr]",
            "train.rewards: unknown reward 'correct_answr'; did you mean 'correct_answer'?",
        ),
        (
            "promote.metric=corect_answer",
            "promote.metric: 'corect_answer' is not a column of the evaluation "
            "(correct_answer, number_only, total, length); did you mean 'correct_answer'?",
        ),
        ("promote.guardrails={lenght: 0.5}", "promote.guardrails.lenght: 'lenght' is not a column of the evaluation"),
    ],
)
def test_preflight_checks_every_reward_name_the_config_holds(override, message):
    from grpo_pipeline.flows.preflight import preflight

    with pytest.raises(ConfigError) as err:
        preflight(load_config(None, [override]))
    assert str(err.value).startswith(message)


def _resolved(path, tmp_path):
    """A shipped recipe as a run resolves it: `auto` on a source (the daily recipe's dated files) is chosen from
    the source's answers at the run's start, here from a day's file of the demo's rows."""
    import json

    from grpo_pipeline.tasks.data.demo_task import make_row
    from grpo_pipeline.tasks.data.shape import task_rewards

    cfg = load_config(path)
    if cfg.data.source is None or all(e.name != "auto" for e in cfg.train.rewards):
        return cfg
    folder = tmp_path / path.stem
    folder.mkdir(parents=True)
    rows = "".join(json.dumps(make_row(a, b)) + "\n" for a in range(8) for b in range(8))
    (folder / "2026-12-07.jsonl").write_text(rows)
    return task_rewards(load_config(path, [f"data.source={folder}"]))


def test_every_shipped_recipe_names_rewards_and_columns_that_exist(tmp_path):
    from grpo_pipeline.configs.files import recipes
    from grpo_pipeline.tasks.evaluate import score_columns
    from grpo_pipeline.tasks.job import check_rewards
    from grpo_pipeline.tasks.promote.decide import check_policy

    for path in recipes():
        cfg = _resolved(path, tmp_path)
        check_rewards(cfg.train.reward_set(), cfg.evaluate)
        check_policy(cfg.promote, score_columns(cfg.train.reward_set(), cfg.evaluate), cfg.train.reward_set())


def test_a_typo_in_an_evaluation_reward_exits_2_before_any_flow_runs():
    from typer.testing import CliRunner

    from grpo_pipeline.cli import app

    result = CliRunner().invoke(app, ["hpo", "--set", "evaluate.accuracy_reward=corect_answer", "--json"])
    assert result.exit_code == 2, result.output
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert failure["exit_code"] == 2
    assert failure["error"].startswith(
        "evaluate.accuracy_reward: unknown reward 'corect_answer'; did you mean 'correct_answer'?"
    )


def test_early_stopping_and_the_published_checkpoint_follow_the_skill_not_the_total(tmp_path, capsys):
    """Validation every 10 steps: the total peaks at step 20 on the format alone, the skill at step 30. HF's own
    best-metric choice (what the published adapter and the kept checkpoint follow) and its early stopping, with
    the trainer's arguments, pick step 30; the rung report a search prunes on carries the skill."""
    from types import SimpleNamespace

    from transformers import EarlyStoppingCallback, Trainer, TrainerControl, TrainerState

    from grpo_pipeline.tasks.job import build_job_spec
    from grpo_pipeline.trainer.callbacks import ReportValidation, skill_metric
    from grpo_pipeline.trainer.spec import parse_progress
    from grpo_pipeline.trainer.train import grpo_args

    sets = ["train.early_stopping_patience=2", "train.checkpoint_every=10", "train.grpo.max_steps=60"]
    cfg = load_config(None, [*sets, "train.grpo.bf16=false"])
    spec = build_job_spec(cfg.train, cfg.model, "m", {"train": tmp_path / "t", "val": tmp_path / "v"}, tmp_path / "run")
    args = grpo_args(spec, tmp_path / "hf")
    assert args.metric_for_best_model == skill_metric(spec.train.rewards) == "rewards/correct_answer/mean"
    state, control = TrainerState(), TrainerControl()
    trainer, stopper = SimpleNamespace(args=args, state=state), EarlyStoppingCallback(2)
    report = ReportValidation(skill_metric(spec.train.rewards))
    evaluations = {10: (0.2, 0.1), 20: (1.3, 0.1), 30: (1.2, 0.4), 40: (1.1, 0.3), 50: (1.0, 0.2)}  # total, skill
    stopped_at = None
    for step, (total, skill) in evaluations.items():
        state.global_step = step
        metrics = {"eval_reward": total, "eval_rewards/correct_answer/mean": skill}
        # HF's order: the evaluation's callbacks, then the best metric (Trainer._maybe_log_save_evaluate)
        stopper.on_evaluate(args, state, control, metrics=metrics)
        report.on_evaluate(args, state, control, metrics=metrics)
        Trainer._determine_best_metric(trainer, metrics, None)
        if control.should_training_stop:
            stopped_at = step
            break
    # on the total, the same patience would have kept step 20 and stopped at 40
    assert (state.best_global_step, state.best_metric, stopped_at) == (30, 0.4, 50)
    printed = [parse_progress(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["val_reward"] for p in printed if p] == [0.1, 0.1, 0.4, 0.3, 0.2]


def test_every_registered_reward_has_a_role_and_each_shipped_task_names_its_skill(tmp_path):
    """The roles' table (configs/rewards.py) covers the registry (trainer/rewards), and every shipped recipe, the
    demo and a data.source task with the shipped rewards resolve the skill they are judged by."""
    from grpo_pipeline.configs.files import recipes
    from grpo_pipeline.configs.rewards import default_role
    from grpo_pipeline.trainer.rewards import REWARDS

    assert {name: default_role(name) is not None for name in REWARDS} == dict.fromkeys(REWARDS, True)
    skills = {path.name: _resolved(path, tmp_path / "skills").train.reward_set().skill for path in recipes()}
    assert set(skills.values()) <= {"correct_answer", "math_answer"} and skills
    assert load_config(None).train.reward_set().skill == "correct_answer"  # the demo and the arithmetic tasks
    source = load_config(None, ["data.source=rows.jsonl", "train.rewards=[math_answer, think_format]"])
    assert (source.train.reward_set().skill, source.train.reward_set().shaping) == ("math_answer", ("think_format",))
    custom = load_config(None, ["train.rewards=['pkg.mod:grade', number_only]"]).train.reward_set()
    assert (custom.skill, custom.shaping) == ("pkg.mod:grade", ("number_only",))
    declared = load_config(None, ["train.rewards=[correct_answer, {name: remote_verifier, role: skill}]"])
    assert (declared.train.reward_set().skill, declared.train.reward_set().shaping) == (
        "remote_verifier",
        ("correct_answer",),
    )
