"""The run's report: a Markdown summary of the A/B decision and a PNG of per-metric means with the interval."""

from __future__ import annotations

import html
import re
from pathlib import Path
from urllib.parse import urlencode

from grpo_pipeline.tasks.data.drift import ANSWER_TYPES, Drift
from grpo_pipeline.tasks.job import WarmStart
from grpo_pipeline.tasks.promote.decide import PromotionDecision
from grpo_pipeline.tasks.summary import AliasChange, Example, Holdout, RegistryOutcome, TrainRows  # noqa: F401 - AliasChange: the doctests use it
from grpo_pipeline.trainer.spec import TrainResult

PROMPT_CHARS = 400  # of a prompt shown with an example: the question, not a whole few-shot context
CELL_CHARS = 80  # of a reference in a table cell


def lineage_line(warm_start: WarmStart | None, rows: TrainRows | None, cold_start: str | None = None) -> str:
    """Where the candidate started and what it trained on, in one sentence; `cold_start`: why it started from the base
    though the champion was asked for (`RunSummary.cold_start`).

    >>> ws = WarmStart(requested="champion", uri="models:/m/3", model="m", version="3", adapter_dir="/a")
    >>> lineage_line(ws, TrainRows(incremental=True, new=40, replayed=10, seen_before=200))
    'Continued from v3 (models:/m/3) on 40 new rows and 10 replayed ones (of 200 seen before).'
    >>> lineage_line(None, None)
    'Trained from the base model.'
    >>> lineage_line(None, TrainRows(incremental=True, new=70, replayed=0, seen_before=0), "no champion yet")
    'Trained from the base model (no champion yet) on 70 new rows and 0 replayed ones (of 0 seen before).'
    """
    start = f"Continued from {warm_start.parent} ({warm_start.uri})" if warm_start else "Trained from the base model"
    start += f" ({cold_start})" if cold_start and not warm_start else ""
    if rows is None or not rows.incremental:
        return f"{start}."
    held = f"; {rows.new_holdout} new rows went to the holdout" if rows.new_holdout else ""
    return (
        f"{start} on {rows.new} new rows and {rows.replayed} replayed ones (of {rows.seen_before} seen before){held}."
    )


def render_skipped(reason: str) -> str:
    """The report of a run that ended after the data stage (`data.skip_unchanged`)."""
    return "\n".join(["# GRPO run: skipped", "", f"Nothing trained: {reason}", ""])


def verdict(decision: PromotionDecision, registry: RegistryOutcome) -> str:
    """What the run did with its candidate, in words: under `promote.mode=canary` a candidate that passed the
    offline gate is the live test's challenger, not yet the champion.

    >>> from types import SimpleNamespace as Fake
    >>> verdict(Fake(promote=True), Fake(aliases={"champion": "3", "challenger": "4"}, candidate_version="4"))
    'challenger (passed the offline gate; the live A/B decides)'
    >>> verdict(Fake(promote=True), Fake(aliases={"champion": "4", "challenger": None}, candidate_version="4"))
    'promoted'
    """
    if not decision.promote:
        return "not promoted"
    canary = registry.aliases.get("challenger") == registry.candidate_version != registry.aliases.get("champion")
    return "challenger (passed the offline gate; the live A/B decides)" if canary else "promoted"


def skill_lines(holdout: Holdout) -> list[str]:
    """The task's skill against the base, apart from the total (a format alone can carry the total).

    >>> from types import SimpleNamespace as Fake
    >>> skill_lines(Fake(skill="correct_answer", skill_base=0.039, skill_trained=0.044, skill_gain=0.005,
    ...                  skill_ci=(-0.022, 0.031), base_reward=0.05, trained_reward=1.044))
    ['Skill (correct_answer): 0.039 -> 0.044 (+0.005, 95% CI -0.022 to +0.031); total 0.050 -> 1.044.', '']
    """
    if holdout.skill is None:
        return []
    interval = f", 95% CI {holdout.skill_ci[0]:+.3f} to {holdout.skill_ci[1]:+.3f}" if holdout.skill_ci else ""
    return [
        f"Skill ({holdout.skill}): {holdout.skill_base:.3f} -> {holdout.skill_trained:.3f} ({holdout.skill_gain:+.3f}"
        f"{interval}); total {holdout.base_reward:.3f} -> {holdout.trained_reward:.3f}.",
        "",
    ]


def render_markdown(
    holdout: Holdout,
    decision: PromotionDecision,
    registry: RegistryOutcome,
    warm_start: WarmStart | None = None,
    rows: TrainRows | None = None,
    train: TrainResult | None = None,
    drift: Drift | None = None,
    cold_start: str | None = None,
) -> str:
    """The decision, its reasons and the holdout numbers, as Markdown (MLflow artifact, Prefect artifact); with
    the training's result, whether the candidate came from a run that a health rule stopped or rolled back; with
    `drift`, a drift alert under the title and the drift section (`drift_lines`)."""
    baseline = f"champion version {registry.decided_against}" if registry.decided_against else "the base model"
    columns = ["base", *(["champion"] if holdout.champion else []), "candidate"]
    lines = [
        f"# GRPO run: candidate **{verdict(decision, registry)}**",
        "",
        f"Candidate version {registry.candidate_version} against {baseline} on {holdout.n} holdout prompts (greedy).",
        lineage_line(warm_start, rows, cold_start),
        "",
        *([f"**Drift alert**: {drift.alert_reason}", ""] if drift is not None and drift.alert else []),
        *([f"**{decision.stats['shaping_only'].capitalize()}.**", ""] if decision.stats.get("shaping_only") else []),
        *skill_lines(holdout),
        *(best_step_lines(train) + health_lines(train) if train is not None else []),
        "## Reasons",
        *[f"- {reason}" for reason in decision.reasons],
        "",
        "## Holdout",
        "",
        "| metric | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name in holdout.trained:
        values = [holdout.base, *([holdout.champion] if holdout.champion else []), holdout.trained]
        lines.append(f"| {name} | " + " | ".join(f"{v[name]:.3f}" for v in values) + " |")
    lines += [
        "",
        *(drift_lines(drift) if drift is not None else []),
        *example_lines(holdout.examples),
        *serving_lines(registry),
        "",
        *alias_table(registry),
        "",
    ]
    return "\n".join(lines)


def drift_lines(drift: Drift) -> list[str]:
    """How today's new rows differ from the champion's (`grpo_pipeline.tasks.data.drift`), as a Markdown section: the
    two sides side by side, then a verdict per part; or why it was not measured.

    >>> from grpo_pipeline.tasks.data.drift import not_measured
    >>> drift_lines(not_measured("no champion yet: nothing to compare today's rows with"))
    ['## Drift', '', "Not measured: no champion yet: nothing to compare today's rows with.", '']
    """
    if drift.skipped_reason:
        return ["## Drift", "", f"Not measured: {drift.skipped_reason}.", ""]
    lines = [
        f"## Drift since champion v{drift.champion}",
        "",
        f"Today's {drift.new_rows} new train rows against the {drift.seen_rows} the champion's lineage trained on"
        + (f" ({drift.seen_missing} more it trained on are no longer in the train split)" if drift.seen_missing else "")
        + ".",
        "",
    ]
    if drift.alert:
        lines += [f"**Alert**: {drift.alert_reason}.", ""]
    lines += ["| | champion's rows | new rows |", "|---|---|---|"]
    if (s := drift.lengths) is not None:
        lines.append(
            f"| prompt characters, mean (median) | {s.seen_mean:.1f} ({s.seen_median:g}) | "
            f"{s.new_mean:.1f} ({s.new_median:g}) |"
        )
    if (a := drift.answer_types) is not None:
        lines += [f"| answers: {t} | {a.seen[t]:.1%} | {a.new[t]:.1%} |" for t in ANSWER_TYPES]
    if (r := drift.reward) is not None:
        lines.append(
            f"| champion's {r.reward or 'reward'} | {r.holdout_reward:.3f} (holdout, {r.holdout_rows} rows) | "
            f"{r.new_reward:.3f} ({r.new_rows_scored} of the new rows) |"
        )
    lines.append("")
    if s is not None:
        lines.append(
            f"- prompt length: KS statistic {s.ks_statistic:.3f}, p {s.p_value:.3g}: "
            + ("**shifted**" if s.shifted else "no shift")
        )
    if a is not None:
        lines.append(
            f"- answer type: distance {a.distance:.3f}, p {a.p_value:.3g}: "
            + ("**shifted**" if a.shifted else "no shift")
        )
    if r is not None:
        interval = f" (95% CI {r.ci_low:.3f} to {r.ci_high:.3f})" if r.ci_low is not None else ""
        against = (
            "alerts off (data.drift_alert unset)"
            if drift.alert_threshold is None
            else f"**beyond** data.drift_alert={drift.alert_threshold:g}"
            if drift.alert
            else f"within data.drift_alert={drift.alert_threshold:g}"
        )
        lines.append(f"- champion's {r.reward or 'reward'}: drop {r.drop:.3f}{interval}, {against}")
    lines += [f"- {note}" for note in drift.notes]
    return lines + [""]


def best_step_lines(train: TrainResult) -> list[str]:
    """Which step's adapter is the candidate, when a validation split chose an earlier one than the last."""
    if train.best_step is None or train.best_step == train.global_step:
        return []
    return [
        f"The candidate is the adapter of step {train.best_step}, the best validation skill reward "
        f"({train.best_val_reward:.4g}), not of the last step ({train.global_step}).",
        "",
    ]


def health_lines(train: TrainResult) -> list[str]:
    """What the health rules did to the training the candidate came from (`grpo_pipeline.trainer.health`): first a line that
    says it was stopped or rolled back, then a table of every event; nothing when no rule fired.

    >>> from grpo_pipeline.trainer.spec import HealthEvent
    >>> e = HealthEvent(rule="zero_variance", step=17, metric="frac_reward_zero_std", value=1.0, threshold=0.9,
    ...                 action="stop", message="no signal", taken="stopped")
    >>> r = TrainResult(adapter_dir="a", global_step=17, max_steps=40, resumed_from_step=None, interrupted=False,
    ...                 stopped_early=True, mlflow_run_id=None, train_runtime_s=1.0, metrics={}, health=[e],
    ...                 stopped_by="health rule zero_variance at step 17: no signal")
    >>> print("\\n".join(health_lines(r)))
    ## Training health
    <BLANKLINE>
    **The candidate comes from a training run that a health rule stopped** at step 17 of 40: health rule zero\\_variance at step 17: no signal
    <BLANKLINE>
    | step | rule | value | threshold | action | taken |
    |---|---|---|---|---|---|
    | 17 | zero\\_variance | 1 | 0.9 | stop | stopped |
    <BLANKLINE>
    """
    if not train.health:
        return []
    said = []
    if train.stopped_by:
        said.append(
            f"**The candidate comes from a training run that a health rule stopped** at step "
            f"{train.global_step} of {train.max_steps}: {inline(train.stopped_by, 300)}"
        )
    if train.rollbacks:
        said.append(
            f"**The candidate comes from a training run rolled back {train.rollbacks} time(s)** to an earlier "
            "checkpoint at a lower learning rate (table below)."
        )
    lines = [
        "## Training health",
        "",
        *[line for s in said for line in (s, "")],
        "| step | rule | value | threshold | action | taken |",
        "|---|---|---|---|---|---|",
    ]
    for e in train.health:
        lines.append(
            f"| {e.step} | {inline(e.rule)} | {e.value:.4g} | {e.threshold:g} | {e.action} | "
            f"{inline(e.taken or '-', 120)} |"
        )
    return lines + [""]


_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_\[\]|~])")  # what could start emphasis, code, a link or a cell


def inline(text: object, limit: int = CELL_CHARS) -> str:
    r"""Model or user text as one line of inline Markdown that renders as the text itself: whitespace folded,
    cut at `limit` characters, Markdown punctuation backslash-escaped (so a `|` cannot split a table cell) and
    HTML escaped (so a tag is shown, not rendered).

    >>> inline("a | b\n`x` <b>y</b>")
    'a \\| b \\`x\\` &lt;b&gt;y&lt;/b&gt;'
    >>> inline("0123456789", limit=4)
    '0123…'
    """
    flat = " ".join(str(text).split())
    flat = flat if len(flat) <= limit else flat[:limit] + "…"
    return html.escape(_MARKDOWN_PUNCTUATION.sub(r"\\\1", flat), quote=False)


def fenced(text: str) -> list[str]:
    """Text in a code block whose fence is longer than any run of backticks inside it, so the text cannot
    close it; inside a code block Markdown and HTML are shown as written.

    >>> fenced("a ``` b")
    ['````text', 'a ``` b', '````']
    """
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + "text", *(text.replace("\r\n", "\n").replace("\r", "\n").split("\n")), fence]


def example_lines(examples: list[Example]) -> list[str]:
    """A few of the candidate's holdout samples, right and wrong: the prompt, the reference, each score and
    the completion's ending; nothing when the evaluation kept none (`evaluate.examples: 0`)."""
    if not examples:
        return []
    right = sum(e.verdict == "right" for e in examples)
    lines = [
        "## Examples",
        "",
        f"The candidate's first {right} right and {len(examples) - right} wrong holdout samples by the accuracy "
        "reward (`evaluate.accuracy_reward`); a completion's ending, a prompt's beginning.",
        "",
    ]
    for i, e in enumerate(examples, 1):
        prompt = e.prompt if len(e.prompt) <= PROMPT_CHARS else e.prompt[:PROMPT_CHARS] + "..."
        lines += [
            f"### {i}. {e.verdict}: key {inline(e.key)}",
            "",
            "| reference | " + " | ".join(inline(n) for n in e.scores) + " |",
            "|---|" + "---|" * len(e.scores),
            f"| {inline(e.answer) if e.answer is not None else '-'} | "
            + " | ".join(f"{v:.3f}" for v in e.scores.values())
            + " |",
            "",
            "Prompt:",
            "",
            *fenced(prompt),
            "",
            "Completion:",
            "",
            *fenced(e.completion),
            "",
        ]
    return lines


def serving_lines(registry: RegistryOutcome) -> list[str]:
    """How to load the candidate, and whether it served as it was evaluated."""
    check = registry.serving_check
    lines = [
        "## Serving",
        "",
        f'`mlflow.pyfunc.load_model("models:/{registry.model}/{registry.candidate_version}")` '
        f"on base `{registry.base_model}`"
        + (f"; merged: `models:/{registry.merged_model}/{registry.merged_version}`" if registry.merged_model else "")
        + ".",
        "",
        f"- {'passed' if check.passed else '**failed**'}: {check.reason()} ({check.seconds:.0f} s)",
    ]
    return lines + [
        f"  - prompt {m['key']}: evaluated {m['expected']!r}, served {m['served']!r}" for m in check.mismatches
    ]


def alias_table(registry: RegistryOutcome) -> list[str]:
    """The aliases after this run, and what this run moved, as a Markdown table.

    >>> from grpo_pipeline.tasks.promote.serving import ServingCheck
    >>> check = ServingCheck(model_uri="models:/m/4", prompts=2, matched=2, passed=True, seconds=1.0)
    >>> out = RegistryOutcome(model="m", candidate_version="4", decided_against="3", base_model="org/base",
    ...     moves=[AliasChange(model="m", alias="champion", version="4", before="3")], serving_check=check,
    ...     aliases={"champion": "4", "challenger": None, "previous-champion": "3"})
    >>> print("\\n".join(alias_table(out)))
    ## Aliases
    <BLANKLINE>
    | model | alias | version | before this run |
    |---|---|---|---|
    | m | champion | 4 | 3 |
    | m | challenger | - | - |
    | m | previous-champion | 3 | 3 |
    """
    moved = {(m.model, m.alias): m.before for m in registry.moves}
    models = [(registry.model, registry.aliases)]
    if registry.merged_model and registry.merged_aliases is not None:
        models.append((registry.merged_model, registry.merged_aliases))
    lines = ["## Aliases", "", "| model | alias | version | before this run |", "|---|---|---|---|"]
    for model, aliases in models:
        for alias, version in aliases.items():
            before = moved[(model, alias)] if (model, alias) in moved else version
            lines.append(f"| {model} | {alias} | {version or '-'} | {before or '-'} |")
    return lines


def plot_comparison(baseline: dict[str, float], candidate: dict[str, float], stats: dict, path: Path) -> Path:
    """Bars of baseline vs candidate per reward, and the primary difference with its interval."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    names = [n for n in candidate if n != "mean_length"]  # rates and rewards share a 0..1 scale
    fig, (bars, delta) = plt.subplots(1, 2, figsize=(9, 3.5), gridspec_kw={"width_ratios": [2, 1]})
    xs = range(len(names))
    bars.bar([x - 0.2 for x in xs], [baseline[n] for n in names], width=0.4, label="baseline")
    bars.bar([x + 0.2 for x in xs], [candidate[n] for n in names], width=0.4, label="candidate")
    bars.set_xticks(list(xs), names)
    bars.set_ylabel("holdout mean")
    bars.legend()
    metric = stats.get("metric")  # the compared column (`decide_promotion`)
    if metric:
        s = stats[metric]
        delta.errorbar(
            [0],
            [s["mean_diff"]],
            yerr=[[s["mean_diff"] - s["ci_low"]], [s["ci_high"] - s["mean_diff"]]],
            fmt="o",
            capsize=8,
        )
        delta.axhline(0, color="grey", linewidth=0.8)
        delta.set_xticks([0], [f"{metric}\ncandidate - baseline"])
        delta.set_title("paired difference, 95% CI")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def artifact_url(tracking_uri: str, run_id: str, path: str) -> str | None:
    """Where a browser (the Prefect UI) can load a run's artifact: the MLflow server's artifact route.

    A local SQLite store has no server to ask, so there is no such URL.

    >>> artifact_url("http://mlflow:5000/", "abc", "comparison.png")
    'http://mlflow:5000/get-artifact?path=comparison.png&run_uuid=abc'
    >>> artifact_url("sqlite:///x.db", "abc", "comparison.png") is None
    True
    """
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/get-artifact?{urlencode({'path': path, 'run_uuid': run_id})}"
