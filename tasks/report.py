"""The run's report: a Markdown summary of the A/B decision and a PNG of per-metric means with the interval."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlencode

from tasks.decide import Decision
from tasks.summary import AliasChange, Holdout, RegistryOutcome


def render_markdown(holdout: Holdout, decision: Decision, registry: RegistryOutcome) -> str:
    """The decision, its reasons and the holdout numbers, as Markdown (MLflow artifact, Prefect artifact)."""
    verdict = "**promoted**" if decision.promote else "**not promoted**"
    baseline = f"champion version {registry.decided_against}" if registry.decided_against else "the base model"
    columns = ["base", *(["champion"] if holdout.champion else []), "candidate"]
    lines = [
        f"# GRPO run: candidate {verdict}",
        "",
        f"Candidate version {registry.candidate_version} against {baseline} on {holdout.n} holdout prompts (greedy).",
        "",
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
    lines += ["", *serving_lines(registry), "", *alias_table(registry), ""]
    return "\n".join(lines)


def serving_lines(registry: RegistryOutcome) -> list[str]:
    """How to load the candidate, and whether it served as it was evaluated."""
    check = registry.serving_check
    lines = ["## Serving", "",
             f"`mlflow.pyfunc.load_model(\"models:/{registry.model}/{registry.candidate_version}\")` "
             f"on base `{registry.base_model}`"
             + (f"; merged: `models:/{registry.merged_model}/{registry.merged_version}`" if registry.merged_model else "")
             + ".", "", f"- {'passed' if check.passed else '**failed**'}: {check.reason()} ({check.seconds:.0f} s)"]
    return lines + [f"  - prompt {m['key']}: evaluated {m['expected']!r}, served {m['served']!r}" for m in check.mismatches]


def alias_table(registry: RegistryOutcome) -> list[str]:
    """The aliases after this run, and what this run moved, as a Markdown table.

    >>> from tasks.serving import ServingCheck
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
    metric = next((k for k in stats if k != "guardrails"), None)
    if metric:
        s = stats[metric]
        delta.errorbar([0], [s["mean_diff"]], yerr=[[s["mean_diff"] - s["ci_low"]], [s["ci_high"] - s["mean_diff"]]],
                       fmt="o", capsize=8)
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
