"""Health rules for an unattended GRPO run: read from the metrics TRL already logs each step (no second
forward pass), each rule a window, a threshold and an action (warn, stop, rollback).

Each rule is one entry of `grpo_pipeline.configs.health.RULES` (its metric, comparison, defaults and bounds), from
which the config's section is derived too. The rule engine (`Monitor`) is pure: it takes one HF log dict at a time
and returns the events that fired; its state (each rule's window, baseline and whether it is armed) is a JSON-able
dict, saved beside every checkpoint (`health.json`) and restored on resume, so a resumed run keeps its windows. `HealthCallback` is
the thin part that reads TRL's logs, makes every rank act on rank 0's decision, records each event (log
line, MLflow tag and metric) and ends or rolls back the training. The defaults and where they come from:
docs/training.md#health-rules.

Keys read (TRL 1.16 GRPOTrainer, `_metrics` averaged per log; HF adds loss and grad_norm):
`frac_reward_zero_std`, `entropy`, `completions/mean_length`, `completions/clipped_ratio`, `kl` (only when
beta > 0), `reward`, `reward_std`, `rewards/<name>/std`, `loss`, `grad_norm`.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from grpo_pipeline.configs.health import FORMAT_HACKING, NON_FINITE, RULES, SHORT_TOKENS, SKILL_FLAT, HealthConfig
from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.trainer.spec import HealthEvent

log = logging.getLogger(__name__)
STATE_FILE = "health.json"  # in each checkpoint: the monitor's windows, the events so far, the lr scale baked in
LEDGER = "health"  # a store entry: the rollbacks so far and the lr scale they set, kept across relaunches
SEVERITY = {"off": 0, "warn": 1, "stop": 2, "rollback": 3}
WINDOWED = [name for name, rule in RULES.items() if rule.fires not in ("non-finite", "format hacking")]
LENGTH = "completions/mean_length"


def _finite_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_step_log(logs: dict) -> bool:
    """A training step's log: TRL's per-step metrics are in it (not an evaluation's, nor the final summary).

    >>> is_step_log({"loss": 0.1, "reward": 0.5}), is_step_log({"eval_reward": 0.5}), is_step_log({"train_runtime": 3})
    (True, False, False)
    """
    return (
        ("loss" in logs or "reward" in logs)
        and "train_runtime" not in logs
        and not any(k.startswith("eval_") for k in logs)
    )


@dataclass
class _Track:
    values: deque
    baseline: float | None = None
    armed: bool = True  # a rule fires once, then again only after its condition has cleared


@dataclass
class Monitor:
    """Every enabled rule's window over the logged steps. `observe` takes one step's log and returns the
    events that fired; `state`/`load` carry the windows through a checkpoint.

    >>> s = HealthConfig(zero_variance={"action": "stop", "window": 2, "threshold": 0.9})
    >>> m = Monitor(s)
    >>> m.observe(1, {"frac_reward_zero_std": 1.0}), [e.rule for e in m.observe(2, {"frac_reward_zero_std": 1.0})]
    ([], ['zero_variance'])
    """

    settings: HealthConfig
    check_grad_norm: bool = True  # False under fp16: the GradScaler skips inf steps itself, and logs them
    tracks: dict[str, _Track] = field(default_factory=dict)
    armed_non_finite: bool = True
    rewards: RewardSet | None = None  # the skill and shaping rewards format_hacking reads; None: that rule is off
    formats: dict[str, _Track] = field(default_factory=dict)  # format_hacking: TRL's log key -> its window

    def __post_init__(self):
        for name in WINDOWED:
            rule = self.settings.rule(name)
            if rule.action != "off" and name not in self.tracks:
                self.tracks[name] = _Track(deque(maxlen=rule.window))
        fh = self.settings.rule(FORMAT_HACKING)
        if self.rewards is not None and fh.action != "off":
            # the skill's track keeps its first window as the baseline; its `armed` is the rule's
            keys = [_mean_key(self.rewards.skill), *(_mean_key(n) for n in self._saturating()), LENGTH]
            for key in keys:
                self.formats.setdefault(key, _Track(deque(maxlen=fh.window)))

    def _saturating(self) -> list[str]:
        """The shaping rewards whose top is a saturation: those the total counts for (a positive weight)."""
        assert self.rewards is not None
        return [n for n in self.rewards.shaping if self.rewards.weight(n) > 0]

    def observe(self, step: int, logs: dict) -> list[HealthEvent]:
        events = []
        for name, track in self.tracks.items():
            rule, cfg = RULES[name], self.settings.rule(name)
            (metric,) = rule.metrics  # a windowed rule averages one key
            value = logs.get(metric)
            if not _finite_number(value):  # absent (kl with beta 0), None (TRL: all NaN) or non-finite
                continue
            track.values.append(float(value))
            if len(track.values) < cfg.window:
                continue
            mean = sum(track.values) / len(track.values)
            if rule.relative:
                if track.baseline is None:
                    track.baseline = mean  # the run's first full window: where it started
                    continue
                if track.baseline <= 0:
                    continue  # nothing to be a fraction of
                mean = mean / track.baseline
            fired = rule.fired(mean, cfg.threshold)
            if fired and track.armed:
                events.append(
                    HealthEvent(
                        rule=name,
                        step=step,
                        metric=metric,
                        value=mean,
                        threshold=cfg.threshold,
                        action=cfg.action,
                        message=f"{rule.says}: {mean:.4g} over the last {cfg.window} logged step(s), threshold "
                        f"{cfg.threshold:g}" + (_rewards_detail(logs) if rule.names_rewards else ""),
                    )
                )
            track.armed = not fired
        events += self._format_hacking(step, logs)
        nf, rule = self.settings.rule(NON_FINITE), RULES[NON_FINITE]
        if nf.action != "off":
            bad = {
                k: logs[k]
                for k in rule.metrics
                if k in logs
                and (k != "grad_norm" or self.check_grad_norm)
                and isinstance(logs[k], int | float)
                and rule.fired(logs[k], nf.threshold)
            }
            if bad and self.armed_non_finite:
                key, value = next(iter(bad.items()))
                events.append(
                    HealthEvent(
                        rule=NON_FINITE,
                        step=step,
                        metric=key,
                        value=float(value),
                        threshold=0.0,
                        action=nf.action,
                        message=f"{rule.says} {', '.join(f'{k}={v}' for k, v in bad.items())}",
                    )
                )
            self.armed_non_finite = not bad
        return events

    def _format_hacking(self, step: int, logs: dict) -> list[HealthEvent]:
        """A shaping reward saturated (or completions shrank to SHORT_TOKENS) over the window while the skill rose
        less than SKILL_FLAT from the run's first window and is not saturated itself: the format was learned,
        the task was not. Fires once, then again only after it has cleared."""
        if not self.formats:
            return []
        assert self.rewards is not None
        cfg, skill_key = self.settings.rule(FORMAT_HACKING), _mean_key(self.rewards.skill)
        for key, track in self.formats.items():
            if _finite_number(value := logs.get(key)):
                track.values.append(float(value))
        skill = self.formats[skill_key]
        if len(skill.values) < cfg.window:
            return []
        skill_mean = sum(skill.values) / len(skill.values)
        if skill.baseline is None:
            skill.baseline = skill_mean  # the run's first full window: where the skill started
            return []
        full = {k: sum(t.values) / len(t.values) for k, t in self.formats.items() if len(t.values) == cfg.window}
        signs = [(k, full[k]) for k in map(_mean_key, self._saturating()) if k in full and full[k] >= cfg.threshold]
        if LENGTH in full and full[LENGTH] <= SHORT_TOKENS:
            signs.append((LENGTH, full[LENGTH]))
        flat = skill_mean - skill.baseline < SKILL_FLAT and skill_mean < cfg.threshold
        fired, events = bool(signs) and flat, []
        if fired and skill.armed:
            key, value = signs[0]
            shown = ", ".join(
                f"completions {v:.3g} tokens long" if k == LENGTH else f"{_reward_of(k)} at {v:.3g}" for k, v in signs
            )
            events.append(
                HealthEvent(
                    rule=FORMAT_HACKING,
                    step=step,
                    metric=key,
                    value=value,
                    threshold=SHORT_TOKENS if key == LENGTH else cfg.threshold,
                    action=cfg.action,
                    message=f"format hacking: {shown} over the last {cfg.window} logged steps, while the skill "
                    f"{self.rewards.skill} stayed at {skill_mean:.3g} ({skill.baseline:.3g} in the run's first window)",
                )
            )
        skill.armed = not fired
        return events

    def state(self) -> dict:
        return {
            "tracks": {
                n: {"values": list(t.values), "baseline": t.baseline, "armed": t.armed} for n, t in self.tracks.items()
            },
            "formats": {
                n: {"values": list(t.values), "baseline": t.baseline, "armed": t.armed} for n, t in self.formats.items()
            },
            "armed_non_finite": self.armed_non_finite,
        }

    def load(self, state: dict) -> None:
        """Windows from a checkpoint; a rule whose window size changed keeps the newest values that fit."""
        for kept, tracks in ((state.get("tracks"), self.tracks), (state.get("formats"), self.formats)):
            for name, saved in (kept or {}).items():
                if name in tracks:
                    track = tracks[name]
                    track.values.extend(saved.get("values", []))
                    track.baseline, track.armed = saved.get("baseline"), saved.get("armed", True)
        self.armed_non_finite = state.get("armed_non_finite", True)


def _mean_key(reward: str) -> str:
    """TRL's log key of a reward's batch mean."""
    return f"rewards/{reward}/mean"


def _reward_of(key: str) -> str:
    return key.removeprefix("rewards/").removesuffix("/mean")


def _rewards_detail(logs: dict) -> str:
    """What the team needs beside the number of a rule about the rewards (`Rule.names_rewards`): whether all
    right or all wrong, and which reward stopped differing."""
    spreads = {
        k.removeprefix("rewards/").removesuffix("/std"): v
        for k, v in logs.items()
        if k.startswith("rewards/") and k.endswith("/std") and _finite_number(v)
    }
    parts = [f"reward mean {logs['reward']:.4g}"] if _finite_number(logs.get("reward")) else []
    parts += [f"{name} std {v:.3g}" for name, v in spreads.items()]
    return f" ({', '.join(parts)})" if parts else ""


def decide(events: list[HealthEvent]) -> HealthEvent | None:
    """The event whose action is the strongest (rollback > stop > warn), or None when only warnings fired.

    >>> e = lambda a: HealthEvent(rule="r", step=1, metric="m", value=1.0, threshold=1.0, action=a, message="")
    >>> decide([e("warn"), e("rollback"), e("stop")]).action, decide([e("warn")])
    ('rollback', None)
    """
    acting = [e for e in events if e.action in ("stop", "rollback")]
    return max(acting, key=lambda e: SEVERITY[e.action]) if acting else None


def healthy_checkpoint(steps: list[int], event: HealthEvent, window: int) -> int | None:
    """The newest checkpoint written before any step the firing window looked at, or None (start again).

    >>> healthy_checkpoint([2, 4, 6], HealthEvent(rule="non_finite", step=5, metric="loss", value=float("nan"),
    ...                    threshold=0.0, action="rollback", message=""), 1)
    4
    >>> healthy_checkpoint([2, 4], HealthEvent(rule="kl_blowup", step=5, metric="kl", value=9.0, threshold=1.0,
    ...                    action="rollback", message=""), 3)
    2
    """
    first_bad = event.step - window + 1
    good = [s for s in steps if s < first_bad]
    return good[-1] if good else None


@dataclass
class Ledger:
    """What outlives one attempt: the events so far, the rollbacks done and the learning-rate scale they set.
    Written to the store at each rollback, so a relaunch after a preemption keeps the halved rate."""

    events: list[HealthEvent] = field(default_factory=list)
    rollbacks: int = 0
    lr_scale: float = 1.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "events": [e.model_dump(mode="json") for e in self.events],
                "rollbacks": self.rollbacks,
                "lr_scale": self.lr_scale,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        raw = json.loads(text)
        return cls(
            [HealthEvent.model_validate(e) for e in raw.get("events", [])],
            int(raw.get("rollbacks", 0)),
            float(raw.get("lr_scale", 1.0)),
        )

    def merge(self, events: list[HealthEvent]) -> None:
        """Add events not yet recorded (a resumed run refires nothing it saved, but a ledger and a checkpoint
        can both hold an event)."""
        seen = {(e.rule, e.step, e.action) for e in self.events}
        self.events += [e for e in events if (e.rule, e.step, e.action) not in seen]
        self.events.sort(key=lambda e: e.step)


def scale_learning_rate(optimizer: Any, scheduler: Any, factor: float) -> None:  # torch's
    """Multiply the optimizer's and the scheduler's learning rates by `factor`, in place.

    A resumed optimizer and scheduler carry the rates they were saved with (HF loads both after building
    them from the arguments), so the change goes into their state, not into `args.learning_rate`."""
    if factor == 1.0:
        return
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper, when there is one
    if inner is not None and hasattr(inner, "base_lrs"):
        inner.base_lrs = [lr * factor for lr in inner.base_lrs]
        inner._last_lr = [group["lr"] for group in optimizer.param_groups]
