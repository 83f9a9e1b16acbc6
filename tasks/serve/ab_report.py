"""How an online decision is recorded: its statistics as MLflow metrics and params, a Markdown report (the
Prefect artifact), and the two arms' mean score over time with its interval (a table, and a PNG).

`read_outcomes` is the only I/O (the request log); the rest are pure functions of what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from pydantic import BaseModel
from scipy import stats
from sqlalchemy import Row, select

from grpo_pipeline.configs.ab import ABConfig
from grpo_pipeline.tasks.serve.ab import ARMS, msprt
from grpo_pipeline.tasks.serve.ab_apply import REPLACEMENT_RULE, Round
from grpo_pipeline.tasks.serve.ab_log import RequestLog, feedback_table, requests_table


class Outcomes(BaseModel):
    """Each arm's scores with the time of the request they score (a label that arrives days later still
    belongs to its request's hour), in hours since the challenger's first request."""

    start: datetime | None  # the challenger version's first request; None before it answered any
    hours: dict[str, list[float]]
    scores: dict[str, list[float]]


def read_outcomes(log: RequestLog, champion: str | None, challenger: str) -> Outcomes:
    """The scored requests of the current versions (as `RequestLog.samples` counts them), with their times."""
    rows: dict[str, Sequence[Row[datetime, float]]] = {}  # (request time, score)
    with log.engine.connect() as connection:
        first = connection.execute(
            select(requests_table.c.created_at)
            .where((requests_table.c.arm == "challenger") & (requests_table.c.version == challenger))
            .order_by(requests_table.c.created_at)
            .limit(1)
        ).scalar()
        for arm, version in zip(ARMS, (champion, challenger), strict=True):
            rows[arm] = connection.execute(
                select(requests_table.c.created_at, feedback_table.c.score)
                .select_from(feedback_table.join(requests_table))
                .where((requests_table.c.arm == arm) & (requests_table.c.version == version))
                .order_by(requests_table.c.created_at)
            ).all()
    start = _naive(first) if first is not None else None
    origin = start or min((_naive(r[0]) for arm_rows in rows.values() for r in arm_rows), default=None)
    if origin is None:  # no challenger request and no scored one: nothing to place in time
        return Outcomes(start=None, hours={arm: [] for arm in rows}, scores={arm: [] for arm in rows})
    hours = {arm: [(_naive(t) - origin).total_seconds() / 3600 for t, _ in arm_rows] for arm, arm_rows in rows.items()}
    return Outcomes(start=start, hours=hours, scores={arm: [float(s) for _, s in r] for arm, r in rows.items()})


def _naive(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes (written in UTC), PostgreSQL aware ones: compare them as naive UTC
    return moment if moment.tzinfo is None else moment.astimezone(UTC).replace(tzinfo=None)


class SeriesPoint(BaseModel):
    hours: float
    n: dict[str, int]
    mean: dict[str, float | None]
    interval: dict[str, tuple[float, float] | None]  # per arm, pointwise (1 - alpha) normal interval of the mean
    difference: float | None  # challenger minus champion
    difference_interval: tuple[float, float] | None  # the always-valid (1 - alpha) confidence sequence


def series(outcomes: Outcomes, ab: ABConfig, points: int = 12) -> list[SeriesPoint]:
    """The arms' mean score and the difference's confidence sequence over the requests up to each of `points`
    evenly spaced moments (to the last scored request).

    >>> o = Outcomes(start=None, hours={"champion": [0.5, 1.0, 1.5, 2.0], "challenger": [0.5, 1.0, 1.5, 2.0]},
    ...              scores={"champion": [0, 1, 0, 1], "challenger": [1, 1, 1, 0]})
    >>> [(p.hours, p.n["challenger"], p.mean["challenger"]) for p in series(o, ABConfig(), points=2)]
    [(1.0, 2, 1.0), (2.0, 4, 0.75)]
    """
    times = [t for arm in ARMS for t in outcomes.hours[arm]]
    if not times:
        return []
    z = float(stats.norm.ppf(1 - ab.alpha / 2))
    out = []
    for cut in np.linspace(max(times) / points, max(times), points):
        seen = {arm: np.asarray(outcomes.scores[arm])[np.asarray(outcomes.hours[arm]) <= cut + 1e-12] for arm in ARMS}
        mean, interval = {}, {}
        for arm, x in seen.items():
            mean[arm] = float(x.mean()) if len(x) else None
            half = z * float(x.std(ddof=1)) / np.sqrt(len(x)) if len(x) > 1 else None
            interval[arm] = (mean[arm] - half, mean[arm] + half) if half is not None else None
        test = msprt(seen["champion"], seen["challenger"], ab.alpha, ab.mixture_effect)
        out.append(
            SeriesPoint(
                hours=round(float(cut), 4),
                n={arm: len(x) for arm, x in seen.items()},
                mean=mean,
                interval=interval,
                difference=test.difference,
                difference_interval=test.interval,
            )
        )
    return out


def decision_metrics(found: Round) -> dict[str, float]:
    """The decision's numbers as MLflow metrics (`<arm>/<statistic>`, `test/<statistic>`), absent ones left out."""
    decision, _ = found.decided()
    out: dict[str, float] = {"elapsed_h": decision.elapsed_h}
    for arm, summary in decision.arms.items():
        out |= {f"{arm}/{k}": float(v) for k, v in summary.model_dump().items() if v is not None}
    test = decision.test
    out |= {
        f"test/{k}": float(v)
        for k, v in (
            ("difference", test.difference),
            ("likelihood_ratio", test.likelihood_ratio),
            ("p_value", test.p_value),
            ("threshold", test.threshold),
        )
        if v is not None
    }
    if test.interval is not None:
        out |= {"test/interval_low": test.interval[0], "test/interval_high": test.interval[1]}
    return out


def decision_params(found: Round, ab: ABConfig) -> dict[str, str]:
    """What the decision was about and under which settings (`ab.*`), as MLflow params."""
    flat = {f"ab.{k}": v for k, v in ab.model_dump().items() if k != "guardrails"}
    flat |= {f"ab.guardrails.{k}": v for k, v in ab.guardrails.model_dump().items()}
    return {
        "champion_version": str(found.champion),
        "challenger_version": str(found.challenger),
        **{k: str(v) for k, v in flat.items()},
    }


def _num(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def render_decision(found: Round, points: list[SeriesPoint], start: datetime | None) -> str:
    """The decision as Markdown: the action and why, each arm, the test, the moves, the score over time."""
    decision, _ = found.decided()
    test = decision.test
    lines = [
        f"# A/B decision: **{decision.action}**",
        "",
        f"Challenger version {found.challenger} against champion version {found.champion or '(none)'}, "
        f"{decision.elapsed_h:.1f} h since the challenger's first request"
        + (f" ({start:%Y-%m-%d %H:%M} UTC)" if start else "")
        + ".",
        f"Rule: {REPLACEMENT_RULE}.",
        "",
        "## Reasons",
        *[f"- {r}" for r in decision.reasons],
        "",
        "## Arms",
        "",
        "| | requests | scored | mean score | error rate | p95 latency (s) | mean completion tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, s in decision.arms.items():
        lines.append(
            f"| {arm} | {s.requests} | {s.scored} | {_num(s.mean_score)} | {_num(s.error_rate)} | "
            f"{_num(s.latency_p95_s)} | {_num(s.mean_completion_tokens)} |"
        )
    interval = f"{test.interval[0]:+.4f} .. {test.interval[1]:+.4f}" if test.interval else "–"
    lines += [
        "",
        "## Sequential test (always valid: holds at every look)",
        "",
        "| difference (challenger − champion) | interval | likelihood ratio | p-value | threshold (1/alpha) |",
        "|---|---|---|---|---|",
        f"| {_num(test.difference)} | {interval} | {_num(test.likelihood_ratio)} | {_num(test.p_value)} | "
        f"{_num(test.threshold)} |",
        "",
    ]
    if decision.breaches:
        lines += [f"Guardrails breached: {', '.join(decision.breaches)}.", ""]
    lines += ["## Aliases", "", *([f"- {m}" for m in found.moves] or ["- nothing moved"]), ""]
    if points:
        lines += [
            "## Mean score over time",
            "",
            "| hours | champion n | champion mean (interval) | challenger n | challenger mean (interval) | "
            "difference (always-valid interval) |",
            "|---|---|---|---|---|---|",
        ]
        for p in points:
            cells = [f"{p.hours:.2f}"]
            for arm in ARMS:
                ci = p.interval[arm]
                cells += [str(p.n[arm]), _num(p.mean[arm], 3) + (f" ({ci[0]:.3f}..{ci[1]:.3f})" if ci else "")]
            d = p.difference_interval
            cells.append(_num(p.difference, 3) + (f" ({d[0]:+.3f}..{d[1]:+.3f})" if d else ""))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_series(points: list[SeriesPoint], path: Path) -> Path:
    """Each arm's mean score with its pointwise interval (top) and the difference with its always-valid
    confidence sequence (bottom), against hours since the challenger's first request."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, (arms, delta) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    hours = [p.hours for p in points]
    for arm in ARMS:
        mean = [np.nan if p.mean[arm] is None else p.mean[arm] for p in points]
        low = [np.nan if (ci := p.interval[arm]) is None else ci[0] for p in points]
        high = [np.nan if (ci := p.interval[arm]) is None else ci[1] for p in points]
        arms.plot(hours, mean, marker="o", label=arm)
        arms.fill_between(hours, low, high, alpha=0.2)
    arms.set_ylabel("mean score")
    arms.legend()
    diff = [np.nan if p.difference is None else p.difference for p in points]
    delta.plot(hours, diff, marker="o", color="black", label="challenger − champion")
    delta.fill_between(
        hours,
        [np.nan if p.difference_interval is None else p.difference_interval[0] for p in points],
        [np.nan if p.difference_interval is None else p.difference_interval[1] for p in points],
        alpha=0.2,
        color="gray",
        label="always-valid interval",
    )
    delta.axhline(0, color="red", linewidth=0.8)
    delta.set_xlabel("hours since the challenger's first request")
    delta.set_ylabel("difference")
    delta.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
