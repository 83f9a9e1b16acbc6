"""How today's new rows differ from the rows the champion was trained on (daily retraining, docs/operations.md).

What is compared, exactly:

- **the champion's rows**: the rows of today's train split whose key is in the champion version's `seen_keys`
  (the train keys of its lineage: its parent's and its own train split, recorded when it was registered). A key
  is `data.key_column`'s value or a hash of the normalized prompt, so a key present today names a row the
  champion was trained on (with a content hash, that very row); rows it trained on that left the source are
  counted (`seen_missing`), not compared.
- **today's new rows**: the rows of today's train split whose key is not in `seen_keys`.
- **prompt length**: characters of every message's content (system and user: what the model reads), compared
  by their means and a two-sample Kolmogorov-Smirnov test (`scipy.stats.ks_2samp`).
- **answer type**: each reference answer as integer, decimal, fraction or text (`answer_type`), compared by their
  shares and a chi-square test of homogeneity (`scipy.stats.chi2_contingency`).
- **the champion's skill**: its mean skill reward (`RewardSet.skill`, the answer checker: a format holds on
  any row, so a total would hide a task the champion no longer does) on a bounded,
  reproducible sample of the new rows (`sample_rank`) against its mean on the holdout rows it was judged on
  (`judged_scores`: today's holdout less the new rows that landed in it), the same evaluation code and settings
  for both; with the 95 % interval of the difference (Welch's t, `scipy.stats.ttest_ind`).

Pure functions on rows and scores; `grpo_pipeline.flows.stages.daily.drift_stage` reads the files, evaluates the
champion and logs what these return.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from grpo_pipeline.tasks.data.splits import replay_rank

ANSWER_TYPES = ("integer", "decimal", "fraction", "text")
NUMERIC = ("integer", "decimal", "fraction")
# A difference counts as a shift when it is both beyond sampling noise (p below SHIFT_P) and large enough to matter
# (distance at least SHIFT_DISTANCE: the KS statistic, or the answer types' total variation distance, both 0..1).
# The p-value alone flags trivial differences on large sets: at 10^5 rows a 1 % change is "significant".
SHIFT_P = 0.01
SHIFT_DISTANCE = 0.1
# New rows the champion is scored on: a 0..1 reward's mean over 256 rows has a standard error of at most 0.031,
# so a drop of 0.1 stands out, for the price of 256 greedy generations a day whatever the day brought.
MAX_SCORED_ROWS = 256

_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)"  # 42, 1,234,567
_INTEGER_RE = re.compile(rf"[-+]?{_DIGITS}")
_DECIMAL_RE = re.compile(rf"[-+]?(?:{_DIGITS}?\.\d+|{_DIGITS}\.)(?:[eE][-+]?\d+)?|[-+]?{_DIGITS}[eE][-+]?\d+")
_FRACTION_RE = re.compile(r"[-+]?\d+\s*/\s*\d+")


def answer_type(answer: object) -> str:
    """A reference answer's type, as written (whitespace stripped): integer, decimal, fraction or text.

    >>> [answer_type(a) for a in ("42", " -1,234 ", 18, "3.5", "-.25", "1e-3", "2.5E6", "3/4", "x = 2", "$5", "")]
    ['integer', 'integer', 'integer', 'decimal', 'decimal', 'decimal', 'decimal', 'fraction', 'text', 'text', 'text']
    """
    text = str(answer).strip()
    if _INTEGER_RE.fullmatch(text):
        return "integer"
    if _DECIMAL_RE.fullmatch(text):
        return "decimal"
    if _FRACTION_RE.fullmatch(text):
        return "fraction"
    return "text"


def prompt_chars(prompt: str | list[dict]) -> int:
    """A prompt's length in characters: a plain prompt's, or every message's content together.

    >>> prompt_chars([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}])
    23
    """
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(str(m.get("content") or "")) for m in prompt)


@dataclass
class Profile:
    """What is compared of a set of rows: each prompt's length and how many answers of each type."""

    lengths: list[int] = field(default_factory=list)
    types: Counter = field(default_factory=Counter)

    def add(self, row: dict) -> None:
        self.lengths.append(prompt_chars(row.get("prompt", "")))
        self.types[answer_type(row.get("answer", ""))] += 1

    def __len__(self) -> int:
        return len(self.lengths)

    def shares(self) -> dict[str, float]:
        n = len(self)
        return {t: self.types[t] / n if n else 0.0 for t in ANSWER_TYPES}


@dataclass
class NewAndSeen:
    """Today's train split against the champion's `seen_keys`: the new rows' and the seen rows' profiles, and a
    bounded sample of the new rows to score the champion on."""

    new: Profile
    seen: Profile
    sample: list[dict]
    seen_missing: int  # keys the champion trained on that today's train split no longer holds


def sample_rank(key: str, salt: str) -> int:
    """A row's place in the scored sample: `grpo_pipeline.tasks.data.splits.replay_rank` (a hash of its key and `salt`,
    the dataset's fingerprint), so the sample is the same on a rerun and does not depend on the rows' order."""
    return replay_rank(key, salt)


def split_rows(rows: Iterable[dict], seen: set[str], salt: str, limit: int = MAX_SCORED_ROWS) -> NewAndSeen:
    """One pass over today's train rows: profiles of the new ones (key not in `seen`) and the seen ones, and the
    `limit` new rows of lowest `sample_rank` (in memory: the profiles' integers and `limit` rows).

    >>> rows = [{"key": f"k{i}", "prompt": "q" * i, "answer": str(i)} for i in range(6)]
    >>> out = split_rows(rows, {"k0", "k1", "k9"}, salt="f", limit=2)
    >>> len(out.new), len(out.seen), len(out.sample), out.seen_missing
    (4, 2, 2, 1)
    >>> split_rows(reversed(rows), {"k0", "k1"}, salt="f", limit=2).sample == out.sample[::-1]  # order-free
    True
    """
    new, old, present = Profile(), Profile(), set()
    ranked: list[tuple[int, int, dict]] = []  # a max-heap by rank (negated) of at most `limit` rows
    for i, row in enumerate(rows):
        key = str(row["key"])
        if key in seen:
            old.add(row)
            present.add(key)
            continue
        new.add(row)
        item = (-sample_rank(key, salt), i, row)
        if len(ranked) < limit:
            heapq.heappush(ranked, item)
        elif limit and item > ranked[0]:
            heapq.heapreplace(ranked, item)
    sample = [row for _, _, row in sorted(ranked, key=lambda item: item[1])]  # in the rows' own order
    return NewAndSeen(new=new, seen=old, sample=sample, seen_missing=len(seen) - len(present))


class LengthShift(BaseModel):
    """Prompt length (characters) of the new rows against the champion's rows."""

    new_mean: float
    seen_mean: float
    new_median: float
    seen_median: float
    ks_statistic: float  # the largest gap between the two lengths' cumulative distributions, 0..1
    p_value: float
    shifted: bool  # ks_statistic >= SHIFT_DISTANCE and p_value < SHIFT_P


def length_shift(new: Sequence[int], seen: Sequence[int]) -> LengthShift:
    """Means, medians and a two-sample KS test of two non-empty sets of prompt lengths.

    >>> length_shift([10, 11, 12] * 50, [10, 11, 12] * 50).shifted
    False
    >>> s = length_shift([30, 31, 32] * 50, [10, 11, 12] * 50)
    >>> s.shifted, s.ks_statistic, s.new_mean - s.seen_mean
    (True, 1.0, 20.0)
    """
    import numpy as np
    from scipy import stats

    test = stats.ks_2samp(new, seen)
    statistic, p = float(test.statistic), float(test.pvalue)
    return LengthShift(
        new_mean=float(np.mean(new)),
        seen_mean=float(np.mean(seen)),
        new_median=float(np.median(new)),
        seen_median=float(np.median(seen)),
        ks_statistic=statistic,
        p_value=p,
        shifted=statistic >= SHIFT_DISTANCE and p < SHIFT_P,
    )


class AnswerTypes(BaseModel):
    """Shares of each answer type (`ANSWER_TYPES`) in the new rows and in the champion's rows."""

    new: dict[str, float]
    seen: dict[str, float]
    numeric_new: float  # integer + decimal + fraction
    numeric_seen: float
    distance: float  # total variation distance between the two shares, 0 (alike) .. 1 (no type in common)
    p_value: float  # chi-square test of homogeneity; 1.0 when every answer of both is of one type
    shifted: bool  # distance >= SHIFT_DISTANCE and p_value < SHIFT_P


def answer_type_shift(new: Profile, seen: Profile) -> AnswerTypes:
    """The answer types' shares of two non-empty profiles, their distance and whether they differ.

    >>> ints = Profile(types=Counter(integer=90, decimal=10), lengths=[1] * 100)
    >>> answer_type_shift(ints, ints).shifted
    False
    >>> texts = Profile(types=Counter(integer=40, text=60), lengths=[1] * 100)
    >>> a = answer_type_shift(texts, ints)
    >>> a.shifted, round(a.distance, 2), a.numeric_new, a.numeric_seen
    (True, 0.6, 0.4, 1.0)
    """
    from scipy import stats

    p_new, p_seen = new.shares(), seen.shares()
    present = [t for t in ANSWER_TYPES if new.types[t] or seen.types[t]]
    if len(present) > 1:
        p = float(stats.chi2_contingency([[new.types[t] for t in present], [seen.types[t] for t in present]]).pvalue)
    else:
        p = 1.0  # one type on both sides: nothing differs
    distance = 0.5 * sum(abs(p_new[t] - p_seen[t]) for t in ANSWER_TYPES)
    return AnswerTypes(
        new=p_new,
        seen=p_seen,
        numeric_new=sum(p_new[t] for t in NUMERIC),
        numeric_seen=sum(p_seen[t] for t in NUMERIC),
        distance=distance,
        p_value=p,
        shifted=distance >= SHIFT_DISTANCE and p < SHIFT_P,
    )


class RewardDrop(BaseModel):
    """The champion's mean skill reward on today's holdout and on a sample of the new rows."""

    reward: str | None = None  # the reward compared: the skill's name (None in drift records written before it)
    holdout_reward: float
    new_reward: float
    drop: float  # holdout_reward - new_reward: above 0, the champion does worse on what is new
    ci_low: float | None = None  # 95 % interval of the drop (Welch's t); None when a side has one row or no spread
    ci_high: float | None = None
    holdout_rows: int
    new_rows_scored: int


def judged_scores(rows: Sequence[dict], judged: set[str] | None, column: str) -> list[float]:
    """The per-row `column` (the skill reward) of the champion's holdout evaluation on the rows it was judged on
    when it was promoted
    (`judged`: its version's holdout keys): new rows whose key lands them in today's holdout are new to it too, and
    would blur the comparison. All rows when it recorded none, or none of them is left.

    >>> rows = [{"key": "h1", "ok": 1.0}, {"key": "h2", "ok": 1.0}, {"key": "new", "ok": 0.0}]
    >>> judged_scores(rows, {"h1", "h2"}, "ok"), judged_scores(rows, None, "ok"), judged_scores(rows, {"gone"}, "ok")
    ([1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0])
    """
    kept = [r[column] for r in rows if judged is not None and str(r["key"]) in judged]
    return kept or [r[column] for r in rows]


def reward_drop(holdout: Sequence[float], new: Sequence[float], reward: str | None = None) -> RewardDrop:
    """The drop from the holdout's per-row scores of `reward` to the new rows', with its 95 % interval.

    >>> d = reward_drop([1.0, 1.0, 0.0, 1.0] * 10, [0.0, 1.0, 0.0, 0.0] * 10)
    >>> d.drop, d.ci_low > 0, (d.holdout_rows, d.new_rows_scored)
    (0.5, True, (40, 40))
    >>> reward_drop([1.0], [1.0]).ci_low is None
    True
    """
    import numpy as np
    from scipy import stats

    low = high = None
    if len(holdout) > 1 and len(new) > 1 and (np.std(holdout) > 0 or np.std(new) > 0):
        interval = stats.ttest_ind(holdout, new, equal_var=False).confidence_interval(0.95)
        if math.isfinite(interval.low) and math.isfinite(interval.high):
            low, high = float(interval.low), float(interval.high)
    h, n = float(np.mean(holdout)), float(np.mean(new))
    return RewardDrop(
        reward=reward,
        holdout_reward=h,
        new_reward=n,
        drop=h - n,
        ci_low=low,
        ci_high=high,
        holdout_rows=len(holdout),
        new_rows_scored=len(new),
    )


class Drift(BaseModel):
    """How today's new train rows differ from the champion's (module docstring), and whether the champion's reward
    on them dropped past `data.drift_alert`. `skipped_reason` set: nothing was measured (no champion, no recorded
    lineage, no new rows); a part that could not be measured is None with the reason in `notes`."""

    champion: str | None = None  # the version compared with
    skipped_reason: str | None = None
    new_rows: int = 0  # today's train rows the champion's lineage did not train on
    seen_rows: int = 0  # today's train rows it did
    seen_missing: int = 0  # rows it trained on that today's train split no longer holds
    lengths: LengthShift | None = None
    answer_types: AnswerTypes | None = None
    reward: RewardDrop | None = None
    alert_threshold: float | None = None  # data.drift_alert
    alert: bool = False
    alert_reason: str | None = None
    notes: list[str] = []

    @property
    def shifted(self) -> list[str]:
        """What moved beyond noise: 'prompt length', 'answer type'."""
        return [
            name
            for name, part in (("prompt length", self.lengths), ("answer type", self.answer_types))
            if part is not None and part.shifted
        ]


def not_measured(reason: str, champion: str | None = None) -> Drift:
    """A drift with nothing measured, and why (no champion, no recorded lineage, no new rows)."""
    return Drift(champion=champion, skipped_reason=reason)


def assess(champion: str, rows: NewAndSeen, reward: RewardDrop | None, threshold: float | None) -> Drift:
    """The drift of today's new rows from champion `champion`'s, from `split_rows`' result and the champion's
    reward on both sides (None when it was not scored); alerted when its drop exceeds `threshold` beyond noise
    (`alert_reason`).

    >>> same = Profile(lengths=[5] * 20, types=Counter(integer=20))
    >>> rows = NewAndSeen(new=same, seen=same, sample=[], seen_missing=0)
    >>> d = assess("3", rows, reward_drop([1.0, 0.0] * 20, [0.0, 0.0, 0.0, 1.0] * 10), threshold=0.2)
    >>> d.alert, d.alert_reason
    (True, 'champion v3 scores 0.250 on 40 new rows against 0.500 on its 40-row holdout: a drop of 0.250 (95% CI 0.039 to 0.461), beyond data.drift_alert=0.2')
    >>> assess("3", rows, reward_drop([1.0, 0.0] * 20, [0.0, 0.0, 0.0, 1.0] * 10), threshold=None).alert
    False
    """
    notes = []
    lengths = types = None
    if len(rows.seen):
        lengths = length_shift(rows.new.lengths, rows.seen.lengths)
        types = answer_type_shift(rows.new, rows.seen)
    else:
        notes.append(
            f"none of the {rows.seen_missing} rows champion v{champion} trained on is in today's train split: "
            "prompt length and answer type have nothing to be compared with"
        )
    if reward is None:
        notes.append("the champion's reward was not measured")
    reason = alert_reason(champion, reward, threshold) if reward is not None else None
    if reward is not None and threshold is not None and reward.drop > threshold and reason is None:
        interval = (
            f"its 95% CI {reward.ci_low:.3f} to {reward.ci_high:.3f}" if reward.ci_low is not None else "no interval"
        )
        notes.append(
            f"no alert: the drop of {reward.drop:.3f} is past data.drift_alert={threshold:g} but within sampling "
            f"noise ({interval}, from {reward.new_rows_scored} new rows and a {reward.holdout_rows}-row holdout)"
        )
    return Drift(
        champion=champion,
        new_rows=len(rows.new),
        seen_rows=len(rows.seen),
        seen_missing=rows.seen_missing,
        lengths=lengths,
        answer_types=types,
        reward=reward,
        alert_threshold=threshold,
        alert=reason is not None,
        alert_reason=reason,
        notes=notes,
    )


def beyond_noise(reward: RewardDrop) -> bool:
    """Whether the drop is more than sampling noise: its 95 % interval lies above 0, or, with no spread on either
    side (every row the same total), the difference is exact. One row on a side tells nothing.

    >>> beyond_noise(reward_drop([1.0, 1.0, 0.0, 1.0] * 10, [0.0, 1.0, 0.0, 0.0] * 10))
    True
    >>> beyond_noise(reward_drop([1.0, 0.0, 1.0], [0.0, 1.0, 0.0])), beyond_noise(reward_drop([1.0] * 5, [0.0] * 5))
    (False, True)
    >>> beyond_noise(reward_drop([1.0], [0.0]))
    False
    """
    if reward.ci_low is not None:
        return reward.ci_low > 0
    return reward.holdout_rows > 1 and reward.new_rows_scored > 1 and reward.drop > 0


def alert_reason(champion: str, reward: RewardDrop, threshold: float | None) -> str | None:
    """Why the run is marked, or None: no threshold (alerts off), a drop not past it, or one within noise.

    The mark needs both, as a shifted part does (`SHIFT_P`, `SHIFT_DISTANCE`): the point estimate of the drop
    past `threshold` (large enough to matter) and its 95 % interval above 0 (`beyond_noise`). The point estimate
    alone alerts on noise when few new rows were scored (20 rows of a 0/1 reward: a 0.1 drop by chance about one day
    in five); the interval's lower bound past the threshold would miss half the real drops of twice the threshold at
    the usual sample (256 new rows against a ~120-row holdout), for a mark meant to make a person look."""
    if threshold is None or not reward.drop > threshold or not beyond_noise(reward):
        return None
    interval = f" (95% CI {reward.ci_low:.3f} to {reward.ci_high:.3f})" if reward.ci_low is not None else ""
    return (
        f"champion v{champion} scores {reward.new_reward:.3f} on {reward.new_rows_scored} new rows against "
        f"{reward.holdout_reward:.3f} on its {reward.holdout_rows}-row holdout: a drop of {reward.drop:.3f}"
        f"{interval}, beyond data.drift_alert={threshold:g}"
    )


def drift_metrics(drift: Drift) -> dict[str, float]:
    """MLflow metrics of a measured drift (none for a skipped one), under `drift/`.

    >>> same = Profile(lengths=[5] * 20, types=Counter(integer=20))
    >>> m = drift_metrics(assess("3", NewAndSeen(new=same, seen=same, sample=[], seen_missing=0), None, None))
    >>> m["drift/new_rows"], m["drift/prompt_chars_ks"], m["drift/answer_share_new/integer"], "drift/alert" in m
    (20.0, 0.0, 1.0, True)
    """
    if drift.skipped_reason:
        return {}
    out = {
        "drift/new_rows": float(drift.new_rows),
        "drift/seen_rows": float(drift.seen_rows),
        "drift/seen_missing": float(drift.seen_missing),
        "drift/alert": float(drift.alert),
    }
    if (s := drift.lengths) is not None:
        out |= {
            "drift/prompt_chars_mean_new": s.new_mean,
            "drift/prompt_chars_mean_seen": s.seen_mean,
            "drift/prompt_chars_ks": s.ks_statistic,
            "drift/prompt_chars_ks_p": s.p_value,
            "drift/prompt_chars_shifted": float(s.shifted),
        }
    if (a := drift.answer_types) is not None:
        out |= {
            f"drift/answer_share_{side}/{t}": shares[t]
            for side, shares in (("new", a.new), ("seen", a.seen))
            for t in ANSWER_TYPES
        }
        out |= {
            "drift/answer_numeric_new": a.numeric_new,
            "drift/answer_numeric_seen": a.numeric_seen,
            "drift/answer_types_distance": a.distance,
            "drift/answer_types_p": a.p_value,
            "drift/answer_types_shifted": float(a.shifted),
        }
    if (r := drift.reward) is not None:
        out |= {
            "drift/champion_reward_holdout": r.holdout_reward,
            "drift/champion_reward_new": r.new_reward,
            "drift/champion_reward_drop": r.drop,
            "drift/new_rows_scored": float(r.new_rows_scored),
        }
    return out


def plot_drift(drift: Drift, rows: NewAndSeen, path: Path) -> Path:
    """Three panels: the prompt-length histograms of the new and the champion's rows, the answer types' shares,
    and the champion's reward on its holdout and on the new rows (with the drop's interval)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, (hist, types, reward) = plt.subplots(1, 3, figsize=(12, 3.5))
    sides = [(f"champion's rows ({len(rows.seen)})", rows.seen), (f"new rows ({len(rows.new)})", rows.new)]
    lengths = [profile.lengths for _, profile in sides if len(profile)]
    if lengths:
        top = max(max(x) for x in lengths)
        bins = list(range(0, top + max(1, top // 30) + 1, max(1, top // 30)))
        for label, profile in sides:
            if len(profile):
                hist.hist(profile.lengths, bins=bins, density=True, alpha=0.5, label=label)
        hist.legend(fontsize=8)
    title = "prompt length (characters)"
    if drift.lengths is not None:
        title += f"\nKS {drift.lengths.ks_statistic:.2f}, p {drift.lengths.p_value:.2g}"
    hist.set_title(title, fontsize=9)
    xs = range(len(ANSWER_TYPES))
    for offset, (label, profile) in zip((-0.2, 0.2), sides, strict=True):
        types.bar([x + offset for x in xs], [profile.shares()[t] for t in ANSWER_TYPES], width=0.4, label=label)
    types.set_xticks(list(xs), ANSWER_TYPES)
    types.set_ylim(0, 1)
    types.set_title("answer type (share)", fontsize=9)
    if drift.reward is not None:
        r = drift.reward
        reward.bar([0, 1], [r.holdout_reward, r.new_reward], color=["tab:blue", "tab:orange"])
        reward.set_xticks([0, 1], [f"holdout\n({r.holdout_rows})", f"new rows\n({r.new_rows_scored})"])
        if r.ci_low is not None and r.ci_high is not None:  # the drop's interval, as where the new rows' mean lies
            reward.errorbar(
                [1],
                [r.new_reward],
                yerr=[[r.ci_high - r.drop], [r.drop - r.ci_low]],
                fmt="none",
                capsize=8,
                color="black",
            )
        if drift.alert_threshold is not None:
            reward.axhline(
                r.holdout_reward - drift.alert_threshold,
                color="red",
                linestyle="--",
                linewidth=0.8,
                label="alert below",
            )
            reward.legend(fontsize=8)
    reward.set_title(f"champion v{drift.champion} reward" + (": ALERT" if drift.alert else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
