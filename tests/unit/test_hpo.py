"""The search's pure parts and its study bookkeeping (storage, budget, warm start, failure summary), with no
trainer: `search` takes the function that runs one trial, and these tests hand it a quick one."""

import optuna
import pytest

from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.infra.launch import BadTrainingInput
from grpo_pipeline.tasks.hpo import (
    HPOFailed,
    TrialFailed,
    TrialOutcome,
    apply_best,
    open_storage,
    open_study,
    requeue_orphans,
    run_trial,
    search,
    seconds_spent,
    steps_committed,
    steps_spent,
    suggest,
    threads_per_trial,
    to_overrides,
    trial_train,
)

REWARDS = load_config(None).train.reward_set()  # the default rewards, which every config here keeps


def run_search(c, model_path, splits, run_dir, **kwargs):
    """`search` on a loaded config's sections, as the flow calls it."""
    return search(c.hpo, c.train, c.model, c.evaluate, model_path, splits, run_dir, data_dir=c.data_dir, **kwargs)


def study_of(c):
    return open_study(c.hpo, c.model.base, c.data_dir)


def storage_of(c):
    return open_storage(c.hpo, c.data_dir)


# The bookkeeping tests: trainer-reported values, no configured control (both have tests of their own below).
PLAIN = ["hpo.trial_score=trainer", "hpo.keep_configured=false", "hpo.pruner=none"]


@pytest.fixture
def cfg(tmp_path):
    def make(*overrides):
        return load_config(None, [f"data_dir={tmp_path}", "hpo.study_name=s-{date}", *PLAIN, *overrides])

    return make


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "hpo.space.learning_rate={low: 0, high: 1.0e-3, log: true}",
            "hpo.space.learning_rate: a log-scale range needs low > 0",
        ),
        ("hpo.space.learning_rate={low: 1.0e-3, high: 1.0e-4}", "low (0.001) must be below high (0.0001)"),
        ("hpo.space.lora_r={choices: [0, 8]}", "hpo.space.lora_r: 0 is out of range; it must be >= 1"),
        ("hpo.space.lora_r={choices: [4.5]}", "hpo.space.lora_r: 4.5 is not an integer"),
        ("hpo.space.temperature={low: 0.7}", "give low and high (a range) or choices (a list)"),
        ("hpo.space.num_generations={choices: [3, 4]}", "[3] do not divide the generation batch (8 completions)"),
        ("hpo.steps=7", "steps (7) must be a multiple of eval_every (5)"),
        ("hpo.pruner=threshold", "pruner 'threshold' needs prune_below"),
        ("hpo.storage=optuna.db", "is not a database URL"),
        ("hpo.study_name=x-{day}", "the only placeholder is {date}"),
        ("hpo.space={lora_r: null, lora_alpha_ratio: null, learning_rate: null}", "nothing to search"),
        ("hpo.space.lora_r={choices: []}", "hpo.space.lora_r: choices must not be empty"),
        ("hpo.space.lora_r={choices: [8, 16, 8]}", "hpo.space.lora_r: choices repeat [8]"),
        ("hpo.space.temperature={choices: [0.7, 0.70]}", "hpo.space.temperature: choices repeat [0.7]"),
        ("hpo.space.beta={low: 0.0, high: 0.1, log: true}", "hpo.space.beta: a log-scale range needs low > 0"),
        ("hpo.space.learning_rate={low: 1.0e-4, high: 1.0e-4}", "low (0.0001) must be below high (0.0001)"),
    ],
)
def test_invalid_search_settings_fail_validation_with_the_field_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, ["train.grpo.per_device_train_batch_size=8", override])
    assert message in str(err.value)


def test_parameters_become_training_overrides_and_a_trial_config(cfg):
    base = cfg(
        "hpo.space.beta={low: 0.0, high: 0.1}",
        "hpo.space.num_generations={choices: [4, 8]}",
        "train.grpo.per_device_train_batch_size=16",
        "train.max_restarts=3",
        "train.early_stopping_patience=2",
    )
    params = suggest(
        optuna.trial.FixedTrial(
            {"lora_r": 32, "lora_alpha_ratio": 2, "learning_rate": 5e-4, "beta": 0.02, "num_generations": 4}
        ),
        base.hpo.space,
    )
    overrides = to_overrides(params, base.train.lora)
    assert overrides == {
        "train.lora.r": 32,
        "train.lora.lora_alpha": 64,
        "train.grpo.learning_rate": 5e-4,
        "train.grpo.beta": 0.02,
        "train.grpo.num_generations": 4,
    }

    best = apply_best(base, overrides)
    assert best.train.lora["r"] == 32 and best.train.grpo["num_generations"] == 4
    assert base.train.lora.get("r") is None  # pure: the input is untouched

    trial = trial_train(base.train, base.hpo, overrides)
    assert trial.grpo["max_steps"] == base.hpo.steps and trial.grpo["eval_steps"] == base.hpo.eval_every
    assert trial.grpo["per_device_eval_batch_size"] % base.hpo.eval_generations == 0
    assert (trial.max_restarts, trial.early_stopping_patience) == (0, None)  # a crash is a result; the pruner decides
    assert trial.grpo["eval_strategy"] == "steps"  # the trainer's rung rewards are the trials' values here
    one_rung = cfg("hpo.trial_score=sampled", f"hpo.steps={base.hpo.steps}", f"hpo.eval_every={base.hpo.steps}")
    # a single rung at the last step, and a scorer that ranks the trial: no evaluation in the trainer
    assert trial_train(one_rung.train, one_rung.hpo, overrides).grpo["eval_strategy"] == "no"

    sky_cfg = cfg("train.launcher=sky", "train.sky.accelerators=[H100:1]")
    sky = trial_train(sky_cfg.train, sky_cfg.hpo, {}).sky
    assert (sky.task_yaml, sky.accelerators) == ("sky/hpo-trial.yaml", None)
    own = cfg("train.launcher=sky", "hpo.trial_task_file=sky/my-trial.yaml")
    assert trial_train(own.train, own.hpo, {}).sky.task_yaml == "sky/my-trial.yaml"
    with pytest.raises(Exception, match="sky_task_yaml is now trial_task_file"):  # the old name, refused with the fix
        cfg("hpo.sky_task_yaml=sky/my-trial.yaml")


def test_apply_best_validates_what_it_applies(cfg):
    with pytest.raises(Exception, match="learnin_rate"):
        apply_best(cfg(), {"train.grpo.learnin_rate": 1e-4})


def _quick(values):
    """A trial runner that returns the next value (a number, 'prune' or 'crash') without training."""
    values = iter(values)

    def run_one(trial, job):
        if not trial.user_attrs.get("configured"):
            suggest(trial, job.hpo.space)
        value = next(values)
        if value == "crash":
            trial.set_user_attr("reason", "trainer exited with code 1 ... ValueError: boom")
            raise TrialFailed("boom")
        if value == "prune":
            trial.report(0.0, 1)
            trial.set_user_attr("reason", "pruned at step 1")
            return TrialOutcome(value=None, pruned_at=1, steps=1)
        return TrialOutcome(value=value, steps=job.hpo.steps)

    return run_one


def test_the_study_resumes_with_the_rest_of_its_budget(cfg, tmp_path):
    c = cfg("hpo.trials=3")
    with pytest.raises(KeyboardInterrupt):  # the search process dies after one trial
        run_search(c, "m", {}, tmp_path, rewards=c.train.reward_set(), run_one=_dies_after(1))
    # the budget left: 3 - 2 finished
    result = run_search(c, "m", {}, tmp_path, rewards=c.train.reward_set(), run_one=_quick([0.9]))
    stored = optuna.load_study(study_name=result.study_name, storage=storage_of(c))
    assert [t.state.name for t in stored.trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert (result.best_value, result.best_trial) == (0.9, 2)


def _dies_after(n):
    count = {"n": 0}

    def run_one(trial, job):
        suggest(trial, job.hpo.space)
        count["n"] += 1
        if count["n"] > n:
            raise KeyboardInterrupt
        return TrialOutcome(value=0.1, steps=job.hpo.steps)

    return run_one


def test_a_new_study_is_warm_started_from_earlier_studies_of_the_same_model(cfg):
    first = cfg("hpo.study_name=day-1", "hpo.trials=2")
    run_search(first, "m", {}, first.data_dir, rewards=first.train.reward_set(), run_one=_quick([0.3, 0.8]))
    best = optuna.load_study(study_name="day-1", storage=storage_of(first)).best_params

    other_model = cfg("hpo.study_name=other", "model.base=org/other-model")
    assert not warm_started(study_of(other_model))
    narrower = cfg("hpo.study_name=narrow", "hpo.space.learning_rate={low: 2.0e-3, high: 3.0e-3, log: true}")
    assert not warm_started(study_of(narrower))  # best lies outside

    with pytest.raises(ConfigError, match="searched for base model 'smollm2-135m-instruct'"):
        study_of(cfg("hpo.study_name=day-1", "model.base=org/other-model"))  # a study is one model's

    second = study_of(cfg("hpo.study_name=day-2"))
    assert len(warm_started(second)) == 1
    trial = second.ask()  # the warm start runs first, before the space-filling start
    assert suggest(trial, first.hpo.space) == best


def warm_started(study):
    return [t for t in study.trials if t.state.name == "WAITING" and not t.user_attrs.get("space_filling")]


def test_a_new_study_starts_spread_over_the_space_after_its_control(cfg):
    """After the control, a new study's first trials are a space-filling design (scrambled Sobol), not TPE's
    random start: its first four learning rates lie one in each quarter of the (log) range; a study reopened
    queues nothing more."""
    import math

    c = cfg("hpo.study_name=spread", "hpo.trials=8", "hpo.keep_configured=true")
    study = study_of(c)
    queued = [t for t in study.trials if t.state.name == "WAITING"]
    assert queued[0].user_attrs.get("configured") and not queued[0].params  # the control first
    spread = [t for t in queued if t.user_attrs.get("space_filling")]
    assert len(spread) == 7 == len(queued) - 1
    low, high = (math.log(c.hpo.space.learning_rate.low), math.log(c.hpo.space.learning_rate.high))
    quarters = sorted(
        int(4 * (math.log(t.system_attrs["fixed_params"]["learning_rate"]) - low) / (high - low)) for t in spread[:4]
    )
    assert quarters == [0, 1, 2, 3]
    assert len(study_of(c).trials) == 8  # reopened: nothing queued twice


def test_when_no_trial_completes_the_stage_fails_with_each_reason(cfg, tmp_path):
    with pytest.raises(HPOFailed) as err:
        run_search(cfg("hpo.trials=2"), "m", {}, tmp_path, rewards=REWARDS, run_one=_quick(["crash", "prune"]))
    message = str(err.value)
    assert "trial 0: FAIL: trainer exited with code 1 ... ValueError: boom" in message
    assert "trial 1: PRUNED: pruned at step 1" in message
    assert "not used silently" in message


class _TrainerExited2:
    """A launcher whose trainer exits 2 on every job, as LocalLauncher reports it (that LocalLauncher does:
    tests/integration/test_reward_failure.py)."""

    def __init__(self, launched: list):
        self.launched = launched

    def launch(self, spec):
        self.launched.append(spec)
        return spec

    def wait(self, handle):
        raise BadTrainingInput(
            "reward 'x:nan' returned nan for row 1 (key k1), completion '7'\n"
            "trainer exited with code 2 (bad input: not relaunched) after 0 restart(s)"
        )

    def cancel(self, handle):
        pass


def test_bad_input_in_a_trial_stops_the_study_and_reaches_the_caller_as_a_config_error(cfg, tmp_path):
    """A broken reward fails every trial the same way: the first one ends the search (exit 2 from the CLI),
    instead of Optuna catching it and launching the rest."""
    import functools

    launched: list = []
    run_one = functools.partial(run_trial, launcher_for=lambda train, on_line: _TrainerExited2(launched))
    c = cfg("hpo.trials=4")
    with pytest.raises(BadTrainingInput, match=r"^reward 'x:nan' returned nan for row 1") as failed:
        run_search(c, "m", {"train": tmp_path / "train.jsonl"}, tmp_path, rewards=c.train.reward_set(), run_one=run_one)
    assert isinstance(failed.value, ConfigError)  # the CLI's exit-2 path
    assert len(launched) == 1  # not hpo.trials launches into the same reward
    stored = optuna.load_study(study_name=study_of(c).study_name, storage=storage_of(c))
    (trial,) = [t for t in stored.trials if t.state.name != "WAITING"]  # the rest of the queue never ran
    assert trial.state.name == "FAIL"
    assert trial.user_attrs["reason"].startswith("reward 'x:nan' returned nan for row 1")


def test_a_trial_left_running_by_a_dead_search_process_fails_and_is_queued_again(cfg):
    import subprocess
    import sys

    c = cfg("hpo.trials=2")
    study = study_of(c)
    orphan = study.ask({"learning_rate": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan.set_user_attr("worker", f"{__import__('socket').gethostname()}:{int(dead.stdout)}")
    alive = study.ask()
    alive.set_user_attr("worker", f"{__import__('socket').gethostname()}:{__import__('os').getppid()}")

    reopened = study_of(c)  # what a relaunched search does first
    states = {t.number: t.state.name for t in reopened.trials}
    assert states == {0: "FAIL", 1: "RUNNING", 2: "WAITING"}  # the live process's trial is left alone
    assert "died while this trial ran" in reopened.trials[0].user_attrs["reason"]
    assert reopened.trials[2].system_attrs["fixed_params"] == reopened.trials[0].params
    assert requeue_orphans(reopened) == []  # once only


def test_sqlite_is_refused_for_parallel_trials():
    with pytest.raises(ConfigError, match="SQLite cannot lock the queued trial"):
        load_config(None, ["hpo.storage=sqlite:////tmp/x.db", "hpo.concurrency=2"])


# ------------------------------------------------------------------ greedy scores, re-scoring, the configured control


@pytest.fixture
def val8(tmp_path):
    """A val split of 8 prompts: 4 to select on and 4 fresh ones to re-score on at a standard error of 0.5."""
    from grpo_pipeline.tasks.data.demo_task import make_row

    path = tmp_path / "val.jsonl"
    path.write_text("".join(__import__("json").dumps(make_row(a, 1)) + "\n" for a in range(8)))
    return {"val": path}


def _scored(tmp_path, plan):
    """`run_one` and `score` for the greedy path: trial number -> (per-prompt scores on the selection prompts,
    on the fresh ones). Trial 0 is the configured values' control."""

    def run_one(trial, job):
        if not trial.user_attrs.get("configured"):
            suggest(trial, job.hpo.space)
        adapter = tmp_path / f"adapter-{trial.number}"
        adapter.mkdir(exist_ok=True)
        return TrialOutcome(value=0.0, steps=job.hpo.steps, adapter_dir=str(adapter))

    def score(adapter_dir, prompts, whole=False):
        select, rescore = plan[int(adapter_dir.rsplit("-", 1)[1])]
        if "select" in prompts.name:
            return select
        assert whole  # a re-scoring that stopped inside a look would leave the contenders' prompts unaligned
        start = int(prompts.stem.rsplit("-", 1)[1])  # a re-scoring look: val-rescore-from-<first prompt>
        scored.append((int(adapter_dir.rsplit("-", 1)[1]), start))
        return rescore[start : start + len(prompts.read_text().splitlines())]

    scored: list[tuple[int, int]] = []  # (trial, first prompt) of each re-scoring call
    score.calls = scored
    return run_one, score


GREEDY = [
    "hpo.trial_score=greedy",
    "hpo.keep_configured=true",
    "hpo.target_standard_error=0.5",
    "hpo.reward_sd=1.0",  # the fake per-prompt scores span 0..2 (two rewards): sized as they were written
    "hpo.rescore_top_k=2",
]


def test_the_best_is_not_applied_when_it_does_not_beat_the_configured_values_beyond_the_noise(cfg, tmp_path, val8):
    run_one, score = _scored(
        tmp_path,
        {
            0: ([1, 0, 1, 0], [1, 0, 1, 0]),
            1: ([1, 1, 1, 0], [1, 1, 0, 0]),  # the best on the selection prompts; a wash on fresh ones
        },
    )
    result = run_search(
        cfg(*GREEDY, "hpo.trials=2"), "m", val8, tmp_path, rewards=REWARDS, run_one=run_one, score=score
    )
    assert result.configured_trial == 0 and result.best_trial == 1 and result.best_value == 0.75
    assert not result.applied and result.overrides == {}  # training keeps what was configured ...
    assert "train.grpo.learning_rate" in result.best_overrides  # ... and the run still says what was found
    assert "not better beyond the noise, the configured values are kept" in result.decision
    assert result.difference == 0.0 and result.difference_ci[0] < 0 < result.difference_ci[1]
    assert result.rescored == {0: 0.5, 1: 0.5} and result.prompts["needed"] == 4


def _rescored_two_at_a_time(cfg, tmp_path, val8, plan):
    """A search of the control and one trial whose four fresh prompts are re-scored two at a time (two looks)."""
    run_one, score = _scored(tmp_path, plan)
    result = run_search(
        cfg(*GREEDY, "hpo.trials=2", "hpo.min_prompts=2"),
        "m",
        val8,
        tmp_path,
        rewards=REWARDS,
        run_one=run_one,
        score=score,
    )
    return result, sorted(score.calls)


def test_the_rescoring_stops_at_the_first_chunk_whose_decision_is_clear(cfg, tmp_path, val8):
    result, calls = _rescored_two_at_a_time(
        cfg,
        tmp_path,
        val8,
        {
            0: ([0, 0, 0, 0], [0, 0, 2, 2]),
            1: ([1, 1, 1, 1], [2, 2, 0, 0]),  # ahead by 2 on both prompts of the first chunk: decided there
        },
    )
    assert calls == [(0, 0), (1, 0)]  # the second chunk, which would undo the lead, never scored
    assert result.applied and result.difference == 2.0 and result.prompts["rescored"] == {0: 2, 1: 2}
    assert "97.5 % CI" in result.decision  # two looks at the decision: each at half the 5 %


def test_an_undecided_rescoring_goes_on_to_every_fresh_prompt_in_lockstep(cfg, tmp_path, val8):
    result, calls = _rescored_two_at_a_time(
        cfg,
        tmp_path,
        val8,
        {
            0: ([0, 0, 0, 0], [0, 1, 0, 0]),
            1: ([1, 1, 1, 1], [1, 0, 1, 1]),  # +1 then -1 on the first chunk: open, then ahead on average
        },
    )
    assert calls == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert result.prompts["rescored"] == {0: 4, 1: 4} and result.difference == 0.5
    assert not result.applied  # +0.5 over four prompts, one of them against: within the noise


def test_a_rescoring_killed_between_looks_resumes_at_the_look_it_lost(cfg, tmp_path, val8):
    """The re-scores are kept on the study look by look: the rerun scores only what the kill lost."""
    plan = {0: ([0, 0, 0, 0], [0, 1, 0, 0]), 1: ([1, 1, 1, 1], [1, 0, 1, 1])}  # undecided after the first look
    run_one, score = _scored(tmp_path, plan)

    def killed_at_the_controls_second_look(adapter_dir, prompts, whole=False):
        if adapter_dir.endswith("-0") and prompts.name.endswith("-from-2.jsonl"):
            raise KeyboardInterrupt
        return score(adapter_dir, prompts, whole)

    c = cfg(*GREEDY, "hpo.trials=2", "hpo.min_prompts=2")
    with pytest.raises(KeyboardInterrupt):
        run_search(c, "m", val8, tmp_path, rewards=REWARDS, run_one=run_one, score=killed_at_the_controls_second_look)
    score.calls.clear()
    result = run_search(c, "m", val8, tmp_path, rewards=REWARDS, run_one=run_one, score=score)
    assert score.calls == [(0, 2)]  # trial 1's second look and both first looks were kept
    assert result.prompts["rescored"] == {0: 4, 1: 4} and result.difference == 0.5


def test_the_top_trials_are_rescored_on_fresh_prompts_and_the_best_there_is_applied(cfg, tmp_path, val8):
    run_one, score = _scored(
        tmp_path,
        {
            0: ([0, 0, 1, 0], [0, 1, 0, 0]),
            1: ([2, 2, 2, 2], [0, 1, 1, 0]),  # lucky on the selection prompts: the winner's curse
            2: ([2, 2, 2, 1], [2, 2, 1, 2]),
            3: ([0, 0, 0, 0], [2, 2, 2, 2]),  # not in the top 2: never re-scored
        },
    )
    result = run_search(
        cfg(*GREEDY, "hpo.trials=4"), "m", val8, tmp_path, rewards=REWARDS, run_one=run_one, score=score
    )
    assert set(result.rescored) == {0, 1, 2}
    assert result.best_trial == 2 and result.applied and result.overrides == result.best_overrides
    assert "better beyond the noise, applied" in result.decision and result.difference_ci[0] > 0


def test_a_target_standard_error_the_data_cannot_meet_fails_before_any_trial_naming_the_prompts_needed(
    cfg, tmp_path, val8
):
    from grpo_pipeline.configs.schema import ConfigError
    from grpo_pipeline.tasks.hpo import NotEnoughPrompts

    def never(*_, **__):
        raise AssertionError("no trial may run")

    with pytest.raises(NotEnoughPrompts) as err:
        run_search(cfg(*GREEDY, "hpo.target_standard_error=0.05"), "m", val8, tmp_path, rewards=REWARDS, run_one=never)
    assert isinstance(err.value, ConfigError)  # the CLI's exit 2
    assert "needs 400 validation prompts per scoring" in str(err.value) and "800 in all" in str(err.value)
    assert "the val split has 8" in str(err.value)


def test_a_search_budget_of_one_training_run_explores_at_least_eight_configurations_on_rungs(cfg, tmp_path):
    """Successive halving with rungs in GRPO steps (2, 6, ...): most trials stop at the first rung; the search
    stops launching trials once the training run's 40 steps are spent."""
    import math

    def run_one(trial, job):
        lr = suggest(trial, job.hpo.space)["learning_rate"] if not trial.user_attrs.get("configured") else 1e-4
        for step in range(job.hpo.eval_every, job.hpo.steps + 1, job.hpo.eval_every):
            trial.report(-abs(math.log10(lr) + 3.5) + step / 100, step)
            if not trial.user_attrs.get("configured") and step < job.hpo.steps and trial.should_prune():
                return TrialOutcome(value=None, pruned_at=step, steps=step)
        return TrialOutcome(value=-abs(math.log10(lr) + 3.5), steps=job.hpo.steps)

    c = cfg(
        "hpo.pruner=successive_halving",
        "hpo.keep_configured=true",
        "hpo.steps=12",
        "hpo.eval_every=2",
        "train.grpo.max_steps=40",
        "hpo.trials=50",
        "hpo.budget_fraction=1.0",
    )
    result = run_search(c, "m", {}, tmp_path, rewards=c.train.reward_set(), run_one=run_one)
    searched = [t.state for t in result.trials[1:]]
    assert len(searched) >= 8 and searched.count("PRUNED") >= 7  # the first 7 stop at the first rung
    assert result.budget_steps == 40 and 40 <= result.steps_spent <= 40 + c.hpo.steps
    assert result.trials[0].state == "COMPLETE"  # the configured control is never stopped on a rung


def test_a_running_trial_counts_against_the_budget_at_its_top_rung(cfg):
    """What stops a parallel search from starting a trial the budget cannot pay for: when one trial finishes,
    the one beside it will still spend its steps."""
    hpo = cfg("hpo.steps=4", "hpo.eval_every=2").hpo
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(value=0.1, user_attrs={"steps": 4}))
    study.add_trial(
        optuna.trial.create_trial(value=None, user_attrs={"steps": 2}, state=optuna.trial.TrialState.PRUNED)
    )
    assert steps_committed(study, hpo) == steps_spent(study) == 6
    study.ask()  # a trial in flight
    assert steps_committed(study, hpo) == 6 + 4 and steps_spent(study) == 6


def test_parallel_local_trials_share_the_cores_and_trials_elsewhere_keep_theirs(cfg):
    import os

    cores = len(os.sched_getaffinity(0))
    parallel = cfg("hpo.concurrency=2")
    assert trial_train(parallel.train, parallel.hpo, {}).cpu_threads == threads_per_trial(parallel.hpo, parallel.train)
    assert threads_per_trial(parallel.hpo, parallel.train) == max(1, cores // 2)
    assert trial_train(cfg("hpo.concurrency=2", "train.cpu_threads=3").train, parallel.hpo, {}).cpu_threads == 3
    assert trial_train(cfg().train, cfg().hpo, {}).cpu_threads is None  # one at a time: torch's own choice
    sky = cfg("hpo.concurrency=2", "train.launcher=sky")
    assert threads_per_trial(sky.hpo, sky.train) is None  # each trial has a node of its own


def test_a_searchs_seconds_are_summed_from_its_studies_trials_and_rescorings():
    study = optuna.create_study()
    for attrs in ({"train_s": 10.0, "score_s": 2.0}, {"train_s": 5.0}, {}):
        study.add_trial(optuna.trial.create_trial(value=0.0, user_attrs=attrs))
    study.set_user_attr("rescore_s-0", 1.5)
    study.set_user_attr("rescore_s-1", 0.5)
    study.set_user_attr("rescores-0", [1.0, 2.0])  # the re-scores themselves: not seconds
    study.set_user_attr("study_s-0", 9.0)  # two optimize calls: a search resumed once
    study.set_user_attr("study_s-1", 3.0)
    assert seconds_spent(study) == {"study": 12.0, "rescoring": 2.0, "trial_runs_summed": 15.0, "scoring_summed": 2.0}


def test_rungs_and_budget_follow_the_config():
    from grpo_pipeline.configs.schema import HPOConfig
    from grpo_pipeline.tasks.hpo import budget, make_pruner, prompts_needed

    assert prompts_needed(HPOConfig(target_standard_error=0.1), REWARDS) == (25, 0.5)
    pruner = make_pruner(HPOConfig(pruner="hyperband", steps=18, eval_every=2, reduction_factor=3)).inner
    assert (pruner._min_resource, pruner._max_resource, pruner._reduction_factor) == (2, 18, 3)
    c = load_config(None, ["train.grpo.max_steps=100", "hpo.budget_fraction=0.25"])
    assert budget(c.hpo, c.train, train_usd=8.0) == (25, 2.0)


def test_every_trial_continues_the_warm_start_and_a_study_keeps_one_start(cfg, tmp_path):
    from grpo_pipeline.tasks.job import WarmStart

    warm = WarmStart(requested="champion", uri="models:/grpo-adapter/3", adapter_dir=str(tmp_path / "v3"))
    started = []

    def run_one(trial, job):
        suggest(trial, job.hpo.space)
        started.append(job.init_adapter)
        return TrialOutcome(value=0.5, steps=job.hpo.steps)

    c = cfg("hpo.trials=2", "hpo.space.lora_r=null", "hpo.space.lora_alpha_ratio=null")
    run_search(c, "m", {}, tmp_path, rewards=REWARDS, run_one=run_one, warm_start=warm)
    assert started == [warm.adapter_dir] * 2

    # the same study (same name, same day) asked for by a search from the base, or from another version
    with pytest.raises(
        ConfigError, match="trials started from models:/grpo-adapter/3, this search's start from the base"
    ):
        study_of(c)
    with pytest.raises(ConfigError, match="set hpo.study_name to a new name"):
        open_study(c.hpo, c.model.base, c.data_dir, start="models:/grpo-adapter/4")
    assert len(open_study(c.hpo, c.model.base, c.data_dir, start=warm.uri).trials) == 2  # its own start: resumed


# Bad input through the CLI: exit 2 before any trial (no flow run, nothing written), the message naming the field.
BAD_SEARCH = {
    "low >= high": ("hpo.space.learning_rate={low: 1.0e-3, high: 1.0e-4, log: true}", "hpo.space.learning_rate"),
    "a log range at zero": ("hpo.space.beta={low: 0.0, high: 0.1, log: true}", "hpo.space.beta"),
    "a log range through zero": ("hpo.space.beta={low: -0.1, high: 0.1, log: true}", "hpo.space.beta"),
    "an empty choice list": ("hpo.space.lora_r={choices: []}", "hpo.space.lora_r: choices must not be empty"),
    "repeated choices": ("hpo.space.lora_r={choices: [8, 8]}", "hpo.space.lora_r: choices repeat [8]"),
    # a multiple of the demo's eval_every (16), so that the length is what is refused
    "a trial longer than the training": ("hpo.steps=64", "hpo.steps (64) is longer than the training it tunes"),
}


@pytest.mark.parametrize("command", ["hpo", "run"])
@pytest.mark.parametrize("case", list(BAD_SEARCH))
def test_a_search_that_cannot_run_exits_2_before_any_trial_naming_the_field(command, case, tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    import grpo_pipeline.flows.hpo
    import grpo_pipeline.flows.pipeline
    from grpo_pipeline.cli import EXIT_CONFIG, app

    def refuse(*args, **kwargs):
        raise AssertionError("a flow run was started")

    monkeypatch.setattr(grpo_pipeline.flows.pipeline, "checked_pipeline", refuse)
    monkeypatch.setattr(grpo_pipeline.flows.hpo, "checked_hpo", refuse)
    assignment, says = BAD_SEARCH[case]
    # the demo config: 40 training steps, trials of 6 steps with a rung every 3
    args = [command, "--json", "--set", f"data_dir={tmp_path}", "--set", "hpo.enabled=true", "--set", assignment]
    if assignment == "hpo.steps=60":
        args += ["--set", "hpo.eval_every=6"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_CONFIG, result.output
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert says in failure["error"] and failure["exit_code"] == EXIT_CONFIG
    assert list(tmp_path.iterdir()) == []  # no study, no dataset, no MLflow database


def test_a_trial_as_long_as_the_training_is_allowed_and_a_longer_one_only_when_the_search_is_off():
    assert load_config(None, ["hpo.enabled=true", "train.grpo.max_steps=20", "hpo.steps=20"]).hpo.steps == 20
    assert load_config(None, ["train.grpo.max_steps=10", "hpo.steps=20"]).hpo.steps == 20  # not searched: not judged
