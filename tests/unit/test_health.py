"""The health rules as pure functions fed with metric sequences (`grpo_pipeline.trainer.health`), their state through a
checkpoint, the rollback's choice of checkpoint and learning-rate change, and their configuration: a bad type,
an out-of-range threshold, an unknown rule or a rollback with nothing to return to exits 2 naming the field.
Every entry of the rules' one table (`grpo_pipeline.configs.health.RULES`) is run through the config, its
validation, the trainer's check and the docs' table: adding a rule is one entry, and this test covers it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpo_pipeline.configs.health import RULES, SHORT_TOKENS, Bounds, HealthConfig
from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.trainer.health import Ledger, Monitor, decide, healthy_checkpoint

ROOT = Path(__file__).resolve().parents[2]


DEMO = RewardSet(names=("correct_answer", "number_only"))  # the demo's skill and format


def _monitor(rewards: RewardSet | None = DEMO, **rules) -> Monitor:
    """A monitor with only `rules` (name -> settings, each key defaulting to its entry's) on."""
    return Monitor(HealthConfig(**{name: {"action": "off"} for name in RULES} | rules), rewards=rewards)


def _steps(skill: list[float], fmt: list[float], length: list[float]) -> list[dict]:
    return [
        {"rewards/correct_answer/mean": s, "rewards/number_only/mean": f, "completions/mean_length": n}
        for s, f, n in zip(skill, fmt, length, strict=True)
    ]


def _format_events(monitor: Monitor, logs: list[dict]) -> list[tuple[int, str, str]]:
    return [(e.step, e.rule, e.metric) for step, x in enumerate(logs, 1) for e in monitor.observe(step, x)]


def test_format_hacking_fires_when_the_format_saturates_and_the_skill_stays_flat():
    """The subtraction run's shape: number_only 0.01 -> 1.0 in a few steps, correct_answer 0.04 throughout."""
    logs = _steps([0.04] * 15, [0.01] * 5 + [0.6] * 3 + [1.0] * 7, [9.0] * 15)
    fired = _format_events(_monitor(format_hacking={"action": "warn"}), logs)
    assert fired == [(13, "format_hacking", "rewards/number_only/mean")]  # once: its window is all 1.0 at 13
    monitor = _monitor(format_hacking={})
    (event,) = [e for step, x in enumerate(logs, 1) for e in monitor.observe(step, x)]
    assert event.action == "warn"  # the default
    assert "format hacking: number_only at 1 over the last 5 logged steps" in event.message
    assert "the skill correct_answer stayed at 0.04 (0.04 in the run's first window)" in event.message


def test_format_hacking_fires_when_completions_shrink_to_a_token_or_two_without_a_shaping_reward():
    only_skill = RewardSet(names=("math_answer",))
    logs = [
        {"rewards/math_answer/mean": 0.1, "completions/mean_length": n} for n in [40.0] * 5 + [20.0] * 3 + [1.2] * 5
    ]
    fired = _format_events(_monitor(only_skill, format_hacking={}), logs)
    assert fired == [(13, "format_hacking", "completions/mean_length")]


def test_format_hacking_stays_quiet_when_the_skill_rises_with_the_format_or_is_off():
    rising = _steps([0.05] * 5 + [0.3] * 3 + [0.7] * 7, [0.01] * 5 + [1.0] * 10, [1.0] * 15)  # the demo: short is right
    assert _format_events(_monitor(format_hacking={}), rising) == []
    flat_no_format = _steps([0.04] * 15, [0.3] * 15, [9.0] * 15)  # nothing learned, nothing hacked either
    assert _format_events(_monitor(format_hacking={}), flat_no_format) == []
    hacked = _steps([0.04] * 15, [0.01] * 5 + [1.0] * 10, [9.0] * 15)
    assert _format_events(_monitor(format_hacking={"action": "off"}), hacked) == []
    assert _format_events(_monitor(None, format_hacking={}), hacked) == []  # no rewards' roles: nothing to read


def test_format_hackings_windows_survive_a_checkpoint():
    logs = _steps([0.04] * 15, [0.01] * 5 + [1.0] * 10, [9.0] * 15)
    whole = _format_events(_monitor(format_hacking={}), logs)
    first = _monitor(format_hacking={})
    _format_events(first, logs[:7])
    resumed = _monitor(format_hacking={})
    resumed.load(json.loads(json.dumps(first.state())))
    again = [(e.step, e.rule, e.metric) for step, x in enumerate(logs[7:], 8) for e in resumed.observe(step, x)]
    assert again == whole == [(10, "format_hacking", "rewards/number_only/mean")]


def _fired(monitor: Monitor, key: str, values, **extra) -> list[tuple[int, str]]:
    fired = []
    for step, value in enumerate(values, start=1):
        fired += [(e.step, e.rule) for e in monitor.observe(step, {key: value, **extra})]
    return fired


def test_zero_variance_fires_on_the_window_mean_once_until_it_clears():
    m = _monitor(zero_variance={"action": "stop", "window": 3, "threshold": 0.9})
    # the window of steps 3-5 is the first whose mean reaches 0.9; it stays there at no step after 5 until 9
    values = [1.0, 0.5, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert _fired(m, "frac_reward_zero_std", values) == [(5, "zero_variance"), (9, "zero_variance")]


def test_relative_rules_compare_with_the_runs_first_window():
    m = _monitor(entropy_collapse={"action": "warn", "window": 2, "threshold": 0.1})
    assert _fired(m, "entropy", [2.0, 2.0, 1.0, 0.5, 0.2, 0.1, 0.1]) == [(6, "entropy_collapse")]  # 0.15 / 2.0
    m = _monitor(length_drift={"action": "warn", "window": 2, "threshold": 3.0})
    assert _fired(m, "completions/mean_length", [10, 10, 20, 30, 40]) == [(5, "length_drift")]  # 35 / 10
    m = _monitor(length_drift={"action": "warn", "window": 1, "threshold": 3.0})
    assert _fired(m, "completions/mean_length", [30, 20, 9]) == [(3, "length_drift")]  # shrinking counts too


def test_clipped_kl_and_reward_collapse():
    m = _monitor(clipped_completions={"action": "warn", "window": 2, "threshold": 0.5})
    assert _fired(m, "completions/clipped_ratio", [0.2, 0.6, 0.6]) == [(3, "clipped_completions")]
    m = _monitor(kl_blowup={"action": "stop", "window": 2, "threshold": 1.0})
    assert _fired(m, "kl", [0.01, 0.5, 2.0]) == [(3, "kl_blowup")]
    assert _fired(_monitor(kl_blowup={"action": "stop", "window": 1, "threshold": 1.0}), "loss", [1, 2]) == []  # beta 0
    m = _monitor(reward_collapse={"action": "warn", "window": 2, "threshold": 0.01})
    events = m.observe(1, {"reward_std": 0.0, "reward": 1.0}) + m.observe(
        2, {"reward_std": 0.0, "reward": 1.0, "rewards/correct/std": 0.0}
    )
    assert [e.rule for e in events] == ["reward_collapse"] and "(reward mean 1, correct std 0)" in events[0].message


def test_non_finite_loss_or_grad_norm_fires_at_once_and_fp16_grad_norms_are_left_to_the_scaler():
    m = _monitor(non_finite={"action": "rollback", "window": 1, "threshold": 0.0})
    events = m.observe(3, {"loss": float("nan"), "grad_norm": 0.5})
    assert [(e.rule, e.step, e.metric, e.action) for e in events] == [("non_finite", 3, "loss", "rollback")]
    assert math.isnan(events[0].value)
    m.check_grad_norm = False
    assert m.observe(4, {"loss": 0.1, "grad_norm": float("inf")}) == []


def test_a_nan_at_a_known_step_decides_a_rollback_to_the_checkpoint_before_it():
    m = _monitor(
        non_finite={"action": "rollback", "window": 1, "threshold": 0.0},
        zero_variance={"action": "warn", "window": 1, "threshold": 0.9},
    )
    logs = [{"loss": 0.1, "grad_norm": 1.0, "frac_reward_zero_std": 0.0}] * 4
    logs.append({"loss": float("nan"), "grad_norm": float("nan"), "frac_reward_zero_std": 1.0})
    events = [e for step, entry in enumerate(logs, start=1) for e in m.observe(step, entry)]
    chosen = decide(events)
    assert (chosen.rule, chosen.step, chosen.action) == ("non_finite", 5, "rollback")
    assert healthy_checkpoint([2, 4], chosen, window=1) == 4
    assert healthy_checkpoint([2, 4], chosen.model_copy(update={"step": 2}), window=1) is None  # start again


def test_windows_restored_from_a_checkpoint_fire_where_the_uninterrupted_run_fires():
    rule = {"action": "stop", "window": 4, "threshold": 0.9}
    values = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    whole = _fired(_monitor(zero_variance=rule), "frac_reward_zero_std", values)
    first = _monitor(zero_variance=rule)
    _fired(first, "frac_reward_zero_std", values[:3])
    saved = json.loads(json.dumps(first.state()))  # through health.json
    resumed = _monitor(zero_variance=rule)
    resumed.load(saved)
    later = [(s + 3, r) for s, r in _fired(resumed, "frac_reward_zero_std", values[3:])]
    assert later == whole == [(5, "zero_variance")]
    assert _fired(_monitor(zero_variance=rule), "frac_reward_zero_std", values[3:]) == []  # a fresh window would not


def test_the_ledger_keeps_events_and_the_learning_rate_scale_through_json():
    m = _monitor(non_finite={"action": "rollback", "window": 1, "threshold": 0.0})
    ledger = Ledger(events=m.observe(3, {"loss": float("inf")}), rollbacks=1, lr_scale=0.5)
    again = Ledger.from_json(ledger.to_json())
    assert (again.rollbacks, again.lr_scale, again.events[0].value) == (1, 0.5, math.inf)
    again.merge(ledger.events)
    assert len(again.events) == 1


def test_scaling_the_learning_rate_holds_for_a_resumed_scheduler():
    import torch

    from grpo_pipeline.trainer.health import scale_learning_rate

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / 10)
    for _ in range(2):
        opt.step()
        sched.step()
    scale_learning_rate(opt, sched, 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-3 * 0.8)
    opt.step()
    sched.step()  # the schedule goes on from the halved base
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-3 * 0.7)


def _past(bounds: Bounds) -> list[tuple[float, str]]:
    """A threshold past each of the bounds, with the words pydantic refuses it with."""
    return [
        (value, f"Input should be {words} {bound:g}")
        for bound, value, words in [
            (bounds.ge, (bounds.ge or 0) - 1, "greater than or equal to"),
            (bounds.gt, bounds.gt, "greater than"),
            (bounds.le, (bounds.le or 0) + 1, "less than or equal to"),
            (bounds.lt, bounds.lt, "less than"),
        ]
        if bound is not None
    ]


@pytest.mark.parametrize("name", list(RULES))
def test_each_rule_of_the_table_reaches_the_config_its_validation_the_trainers_check_and_the_docs(name):
    rule = RULES[name]
    settings = load_config(None).train.health.rule(name)  # train.health.<name>, with the entry's defaults
    assert (settings.action, settings.window, settings.threshold) == (rule.action, rule.window, rule.threshold)
    assert _past(rule.bounds), "every threshold has a bound"
    for value, refused in _past(rule.bounds):
        with pytest.raises(ConfigError, match=f"train.health.{name}.threshold: {refused}"):
            load_config(None, [f"train.health.{name}.threshold={value}"])
    with pytest.raises(ConfigError, match=f"train.health.{name}.threshold: Input should be a finite number"):
        load_config(None, [f"train.health.{name}.threshold=.inf"])

    # the trainer's check, at the defaults: it fires on the entry's metric once its window is past the threshold
    monitor, t = _monitor(**{name: {"action": "stop"}}), rule.threshold
    if rule.fires == "non-finite":
        logs = [{key: 0.5 for key in rule.metrics}, {key: float("nan") for key in rule.metrics}]
        fired = [(e.step, e.rule, e.metric) for step, x in enumerate(logs, 1) for e in monitor.observe(step, x)]
        assert fired == [(2, name, rule.metrics[0])]
        return
    if rule.fires == "format hacking":  # the demo's rewards: number_only at the threshold, the skill flat
        assert SHORT_TOKENS < 3
        logs = _steps([0.0] * 3 * rule.window, [t / 2] * 2 * rule.window + [t] * rule.window, [9.0] * 3 * rule.window)
        assert _format_events(monitor, logs) == [(3 * rule.window, name, "rewards/number_only/mean")]
        return
    (metric,) = rule.metrics
    quiet = {"reaches": t / 2, "falls to": 2 * t + 1, "either way": 1.0}[rule.fires]  # bounds keep 1.0 inside
    start = [1.0] * rule.window if rule.relative else []  # a relative rule's baseline: the first window, at 1
    values = start + [quiet] * rule.window + [t] * rule.window
    fired = [(step, e.rule, e.metric) for step, v in enumerate(values, 1) for e in monitor.observe(step, {metric: v})]
    assert fired == [(len(values), name, metric)]

    row = f"| `{name}` | `{rule.metrics[0]}`"  # docs/training.md#health-rules: each rule's row, and why its values
    assert row in (ROOT / "docs" / "training.md").read_text()


@pytest.mark.parametrize(
    "assignment, names",
    [
        (
            "train.health.zero_variance.threshold=lots",
            "train.health.zero_variance.threshold: Input should be a valid number",
        ),
        (
            "train.health.zero_variance.threshold=1.5",
            "train.health.zero_variance.threshold: Input should be less than or equal to 1",
        ),
        (
            "train.health.length_drift.threshold=0.5",
            "train.health.length_drift.threshold: Input should be greater than 1",
        ),
        (
            "train.health.kl_blowup.window=0",
            "train.health.kl_blowup.window: Input should be greater than or equal to 1",
        ),
        ("train.health.entropy.action=stop", "train.health.entropy: unknown key; did you mean 'entropy_collapse'?"),
        (
            "train.health.kl_blowup.action=halt",
            "train.health.kl_blowup.action: Input should be 'off', 'warn', 'stop' or 'rollback'",
        ),
        ("train.health.zero_variance.action=rollback", "train.health.zero_variance.action=rollback needs checkpoints"),
    ],
)
def test_a_bad_health_setting_names_the_field(assignment, names):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [assignment, "train.grpo.max_steps=10", "train.checkpoint_every=10"])
    assert names in str(caught.value)


@pytest.mark.parametrize(
    "assignment",
    [
        "train.health.zero_variance.threshold=lots",
        "train.health.clipped_completions.threshold=2",
        "train.health.nope.action=stop",
        "train.health.non_finite.action=rollback",
    ],
)
def test_a_bad_health_setting_exits_2_before_training(assignment, monkeypatch):
    import grpo_pipeline.flows.pipeline
    from grpo_pipeline.cli import EXIT_CONFIG, app

    monkeypatch.setattr(
        grpo_pipeline.flows.pipeline, "checked_pipeline", lambda *a, **k: pytest.fail("training started")
    )
    sets = ["--set", assignment, "--set", "train.grpo.max_steps=10", "--set", "train.checkpoint_every=10"]
    result = CliRunner().invoke(app, ["run", "--json", *sets])
    assert result.exit_code == EXIT_CONFIG == 2, result.output
    assert assignment.rpartition(".")[0] in json.loads(result.stdout.strip().splitlines()[-1])["error"]


def test_the_default_non_finite_rollback_becomes_a_stop_where_no_checkpoint_comes_before_the_end():
    cfg = load_config(None, ["train.grpo.max_steps=10", "train.checkpoint_every=10"])
    assert cfg.train.health.non_finite.action == "stop"
    assert load_config(None, ["train.grpo.max_steps=20"]).train.health.non_finite.action == "rollback"


def test_every_rank_acts_on_rank_0s_decision():
    """A rank other than 0 does not run the rules: it takes rank 0's events from the broadcast and stops too."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from grpo_pipeline.trainer.callbacks import HealthCallback
    from grpo_pipeline.trainer.distributed import Ranks

    class Rank1(Ranks):
        def broadcast(self, value):
            assert value is None  # this rank decided nothing itself
            return _monitor(zero_variance={"action": "stop", "window": 1, "threshold": 0.9}).observe(
                2, {"frac_reward_zero_std": 1.0}
            )

    settings = HealthConfig(zero_variance={"action": "stop", "window": 1, "threshold": 0.9})
    callback = HealthCallback(settings, Ledger(), Rank1(rank=1, world=2))
    state, control = TrainerState(global_step=2), TrainerControl()
    # rank 1's own metrics would not fire: the decision is rank 0's
    callback.on_log(
        TrainingArguments("unused", report_to=[]), state, control, logs={"loss": 0.1, "frac_reward_zero_std": 0.0}
    )
    assert control.should_training_stop and callback.stopped.rule == "zero_variance"
    assert [e.taken for e in callback.ledger.events] == ["stopped"]


def test_the_report_says_the_candidate_came_from_a_rolled_back_run():
    from grpo_pipeline.tasks.promote.decide import PromotionDecision
    from grpo_pipeline.tasks.promote.serving import ServingCheck
    from grpo_pipeline.tasks.report import render_markdown
    from grpo_pipeline.tasks.summary import Holdout, RegistryOutcome, RunSummary
    from grpo_pipeline.trainer.spec import HealthEvent, TrainResult

    assert "health" in RunSummary.model_json_schema()["$defs"]["TrainResult"]["properties"]
    event = HealthEvent(
        rule="non_finite",
        step=3,
        metric="loss",
        value=float("nan"),
        threshold=0.0,
        action="rollback",
        message="non-finite loss=nan",
        taken="rolled back to step 2 (learning rate x0.5 of the configured)",
    )
    train = TrainResult(
        adapter_dir="a",
        global_step=5,
        max_steps=5,
        resumed_from_step=None,
        interrupted=False,
        stopped_early=False,
        mlflow_run_id=None,
        train_runtime_s=1.0,
        metrics={},
        health=[event],
        rollbacks=1,
    )
    assert TrainResult.model_validate_json(train.model_dump_json()).health[0].taken == event.taken  # NaN survives
    holdout = Holdout(n=2, base_reward=0.0, trained_reward=1.0, gain=1.0, base={"r": 0.0}, trained={"r": 1.0})
    check = ServingCheck(model_uri="models:/m/2", prompts=2, matched=2, passed=True, seconds=1.0)
    registry = RegistryOutcome(
        model="m",
        candidate_version="2",
        decided_against=None,
        moves=[],
        aliases={},
        base_model="org/base",
        serving_check=check,
    )
    markdown = render_markdown(
        holdout, PromotionDecision(promote=True, reasons=["gain"], stats={}), registry, train=train
    )
    assert (
        "rolled back 1 time(s)" in markdown
        and "| 3 | non\\_finite | nan | 0 | rollback | rolled back to step 2" in markdown
    )
    assert markdown.index("## Training health") < markdown.index("## Reasons")
    best = train.model_copy(update={"best_step": 4, "best_val_reward": 0.5, "global_step": 8})
    assert "adapter of step 4, the best validation skill reward (0.5), not of the last step (8)" in render_markdown(
        holdout, PromotionDecision(promote=True, reasons=[], stats={}), registry, train=best
    )
    assert "## Training health" not in render_markdown(
        holdout,
        PromotionDecision(promote=True, reasons=[], stats={}),
        registry,
        train=train.model_copy(update={"health": [], "rollbacks": 0}),
    )


def test_off_turns_a_rule_off_from_yaml_and_set(tmp_path):
    """YAML 1.1 reads a bare `off` as false (PyYAML, and `--set` with it): for an action it means off."""
    (tmp_path / "c.yaml").write_text("train:\n  health:\n    kl_blowup:\n      action: off\n")
    cfg = load_config(tmp_path / "c.yaml", ["train.health.zero_variance.action=off"])
    assert (cfg.train.health.kl_blowup.action, cfg.train.health.zero_variance.action) == ("off", "off")
    with pytest.raises(ConfigError, match="train.health.zero_variance.action: Input should be 'off'"):
        load_config(None, ["train.health.zero_variance.action=on"])  # true is no action
