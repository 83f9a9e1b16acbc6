"""Daily retraining that builds on yesterday: day 2 warm-started from day 1's adapter on the new rows plus a replay
share (`model.init_adapter`, `data.incremental`) against day 2 trained from the base on every row, on the demo
task split into two "days".

The demo's arithmetic pairs (the CLI's default recipe, configs/demo-cpu.yaml) are written as a JSONL source keyed
by the pair (`data.key_column=key`, so the data stage splits them as the demo does); day 1's source holds a
seeded 60 % of them, day 2's source is day 1's with the rest appended (a source that grows). Four pipeline runs:

    day1          from the base, day 1's rows, S steps (S = the recipe's max_steps, 40), registered as version 1
    scratch       day 2 from the base on all of day 2's rows, S steps, in a registry of its own
    warm          day 2 from version 1 on the rows it has not seen plus data.replay_fraction of those it has, S steps
    warm_half     the same as warm with S/2 steps

Every day-2 run uses the same source, so its dataset fingerprint and its holdout rows are the same (the summary's
fingerprint and holdout size are recorded to show it), and each candidate is scored greedily on them by the
pipeline's own evaluation. Reported side by side: holdout reward (the weighted total GRPO optimises) of each arm,
the paired difference to scratch on the same rows with its 95 % interval (per-row totals from each run's
`candidate_samples.json`), train time and wall time, the rows each trained on (new, replayed).

What "half the time" means here: at equal steps a GRPO step costs the same whichever adapter it starts from, so
`warm` and `scratch` take the same time by construction (that pair shows what the warm start buys in quality at
equal cost). The saving comes from needing fewer steps: the goal is met when `warm_half` (half the steps, so about
half the train time) is not worse than `scratch` on the same holdout rows (the interval of the difference reaches
0 or lies above it) and its train time is at most half of scratch's. With ~130 holdout rows the interval is a few
points wide: a small loss cannot be excluded, and the note says so.

    python -m bench.warm_start             # 4 runs, ~40 min on a quiet 2-core machine
    python -m bench.warm_start --tiny      # 2 (and 1) steps per run, a small holdout: does the chain run?

Resumable: each finished run is kept in .grpo/bench-warm_start/runs.json with its data folder (day 1's registry
is the one the warm arms continue from) and skipped when the script runs again (--fresh measures all again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import ROOT, add_threads_option, keep_runs, load_runs, save, torch_threads
from bench.table import Row

NAME = "warm_start"
WORK = ROOT / ".grpo" / f"bench-{NAME}"
DAY1_SHARE = 0.6  # of the demo's pairs on day 1; the rest arrive on day 2
STEPS = 40  # configs/demo-cpu.yaml's max_steps
ARMS = ("day1", "scratch", "warm", "warm_half")


def day_sources(max_operand: int, out: Path, seed: int = 0) -> dict[str, Path]:
    """Every demo pair as a JSONL row; day 1 a seeded `DAY1_SHARE` of them, day 2 the same rows with the rest
    appended (day 1's file is a prefix of day 2's).

    >>> import tempfile
    >>> d = day_sources(4, Path(tempfile.mkdtemp()))
    >>> one, two = (d[k].read_text().splitlines() for k in ("day1", "day2"))
    >>> len(one), len(two), two[: len(one)] == one
    (15, 25, True)
    """
    from grpo_pipeline.tasks.data.demo_task import make_row

    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    cut = round(len(pairs) * DAY1_SHARE)
    lines = [json.dumps(make_row(a, b)) + "\n" for a, b in pairs]
    out.mkdir(parents=True, exist_ok=True)
    (out / "day1.jsonl").write_text("".join(lines[:cut]))
    (out / "day2.jsonl").write_text("".join(lines))
    return {"day1": out / "day1.jsonl", "day2": out / "day2.jsonl"}


def overrides(arm: str, source: Path, parent: str | None, tiny: bool) -> list[str]:
    """The `--set` overrides of one arm (`parent`: day 1's registered version, models:/...).

    >>> overrides("warm_half", Path("/d/day2.jsonl"), "models:/grpo-adapter/1", False)[-4:]
    ['train.grpo.max_steps=20', 'train.checkpoint_every=10', 'model.init_adapter=models:/grpo-adapter/1', 'data.incremental=true']
    """
    steps = 2 if tiny else STEPS
    steps = steps // 2 if arm == "warm_half" else steps
    sets = [
        f"data.source={source}",
        "data.key_column=key",
        f"train.grpo.max_steps={steps}",
        f"train.checkpoint_every={min(10, steps)}",
    ]
    if tiny:
        sets = ["promote.min_samples=1", *sets]
    if arm in ("warm", "warm_half"):
        sets += [f"model.init_adapter={parent}", "data.incremental=true"]
    return sets


def paired_difference(candidate: dict[str, float], baseline: dict[str, float]) -> dict:
    """Mean of candidate - baseline over the keys both scored, with a 95 % interval (t, normal approximation).

    >>> paired_difference({"a": 1.0, "b": 1.0, "c": 0.0}, {"a": 0.0, "b": 1.0, "c": 0.0})["mean"]
    0.3333333333333333
    """
    keys = sorted(set(candidate) & set(baseline))
    diffs = [candidate[k] - baseline[k] for k in keys]
    if len(diffs) < 2:
        return {"n": len(diffs), "mean": statistics.fmean(diffs) if diffs else None, "low": None, "high": None}
    mean, half = statistics.fmean(diffs), 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"n": len(diffs), "mean": mean, "low": mean - half, "high": mean + half}


def candidate_totals(data_dir: Path, parent_run_id: str) -> dict[str, float]:
    """Per holdout row (by key), the candidate's weighted total, from the run's `evaluate-candidate` stage."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{(data_dir / 'mlflow.db').resolve()}")
    parent = client.get_run(parent_run_id)
    (stage,) = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.mlflow.runName = 'evaluate-candidate'",
    )
    path = Path(client.download_artifacts(stage.info.run_id, "candidate_samples.json", str(data_dir / "fetched")))
    table = json.loads(path.read_text())
    key, total = table["columns"].index("key"), table["columns"].index("total")
    return {str(row[key]): float(row[total]) for row in table["data"]}


def measure(summary: dict, seconds: float, data_dir: Path) -> dict:
    """One arm's figures from the pipeline's `--json` summary."""
    holdout, rows, registry = summary["holdout"], summary.get("rows") or {}, summary["registry"]
    return {
        "holdout_reward": holdout["trained_reward"],
        "base_reward": holdout["base_reward"],
        "parent_reward": holdout.get("champion_reward"),  # the day-1 adapter on today's holdout, where it is champion
        "holdout_n": holdout["n"],
        "fingerprint": summary["data"]["fingerprint"],
        "new_rows": rows.get("new"),
        "replayed_rows": rows.get("replayed"),
        "new_holdout_rows": rows.get("new_holdout"),
        "steps": summary["train"]["global_step"],
        "train_runtime_s": round(summary["train"]["train_runtime_s"], 1),
        "wall_s": round(seconds, 1),
        "version": f"models:/{registry['model']}/{registry['candidate_version']}",
        "totals": candidate_totals(data_dir, summary["mlflow"]["run_id"]),
        "load_1min": os.getloadavg()[0],
    }


def run_pipeline(data_dir: Path, sets: list[str], threads: int | None) -> tuple[dict, float]:
    """`grpo-pipeline run --json` on the default recipe with `data_dir` (kept: day 1's registry lives there)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    models = ROOT / ".grpo" / "models"
    if models.is_dir() and not (data_dir / "models").exists():
        (data_dir / "models").symlink_to(models.resolve())
    cmd = [sys.executable, "-m", "grpo_pipeline.cli", "run", "--json", "--set", f"data_dir={data_dir}"]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {
        "PREFECT_HOME": str(data_dir / "prefect")
    }
    if threads:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    seconds = time.monotonic() - started
    if proc.returncode not in (0, 3):  # 3: completed, not promoted
        raise SystemExit(f"grpo-pipeline run exited {proc.returncode}: {proc.stdout[-2000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{") :]), seconds


def compare(runs: dict) -> dict:
    """Each day-2 warm arm against scratch on the same holdout rows."""
    scratch = runs["scratch"]
    out = {}
    for arm in ("warm", "warm_half"):
        r = runs[arm]
        out[arm] = {
            "difference": paired_difference(r["totals"], scratch["totals"]),
            "time_ratio": r["train_runtime_s"] / scratch["train_runtime_s"] if scratch["train_runtime_s"] else None,
            "wall_ratio": r["wall_s"] / scratch["wall_s"] if scratch["wall_s"] else None,
            "same_holdout": (r["fingerprint"], r["holdout_n"]) == (scratch["fingerprint"], scratch["holdout_n"]),
        }
    return out


def _side(arm: str, r: dict) -> str:
    rows = f", {r['new_rows']} new + {r['replayed_rows']} replayed rows" if r.get("new_rows") is not None else ""
    return f"{arm}, {r['steps']} steps{rows}: reward {r['holdout_reward']:.3f}, train {r['train_runtime_s']:.0f} s"


def table_rows(load) -> list[Row]:
    r = load(NAME)
    bench = "daily retraining, day 2: warm start on new rows + replay vs from the base on all rows (`bench.warm_start`)"
    if r is None:
        return [Row(bench, "scratch", "warm", None, "<= 0.5", note="not run yet")]
    runs, cmp = r["runs"], r["compare"]
    rows = []
    for arm, goal in (("warm", ""), ("warm_half", "<= 0.5")):
        d = cmp[arm]["difference"]
        quality = (
            f"reward {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] vs scratch on the same {d['n']} rows"
            if d["low"] is not None
            else "no paired rows"
        )
        held = d["low"] is not None and d["high"] >= 0  # not shown worse than scratch
        if not cmp[arm]["same_holdout"]:
            note = "holdouts differ: not comparable"
        elif not held:
            note = f"quality not held: {quality}"
        else:  # the verdict is the time ratio's against its goal; the interval says how small a loss is excluded
            note = f"{quality}: not shown worse, a loss up to {-d['low']:.3f} not excluded"
        rows.append(
            Row(
                f"{bench}: train time, {'same steps' if arm == 'warm' else 'half the steps'}",
                _side("scratch", runs["scratch"]),
                _side(arm, runs[arm]),
                cmp[arm]["time_ratio"],
                goal,
                note=note,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="2 steps per run (1 for warm_half): the chain, not figures")
    parser.add_argument("--fresh", action="store_true", help="forget finished runs and measure all again")
    add_threads_option(parser)
    opts = parser.parse_args(argv)
    work = WORK / ("tiny" if opts.tiny else "full")
    if opts.fresh:
        shutil.rmtree(work, ignore_errors=True)
    sources = day_sources(9 if opts.tiny else 20, work / "sources")
    threads = torch_threads(opts.threads)
    runs = load_runs(work / "runs.json")
    for arm in ARMS:  # day1 first: the warm arms continue from its version, in its registry
        if arm in runs:
            print(f"[{NAME}] {arm}: kept from an earlier run", flush=True)
            continue
        parent = runs["day1"]["version"] if arm != "day1" else None
        sets = overrides(arm, sources["day1" if arm == "day1" else "day2"], parent, opts.tiny)
        data_dir = work / ("scratch" if arm == "scratch" else "lineage")  # scratch: a registry of its own
        summary, seconds = run_pipeline(data_dir, sets, threads)
        runs[arm] = measure(summary, seconds, data_dir) | {"overrides": sets, "threads": threads}
        keep_runs(work / "runs.json", runs)
        shown = {k: v for k, v in runs[arm].items() if k != "totals"}
        print(f"[{NAME}] {arm}: {json.dumps(shown)} ({seconds / 60:.1f} min)", flush=True)
    report = {
        "name": NAME,
        "tiny": opts.tiny,
        "runs": runs,
        "compare": compare(runs),
        "machine": {"cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    save(f"{NAME}_tiny" if opts.tiny else NAME, report)
    for row in table_rows(lambda _name: report):
        print(f"[{NAME}] {row.benchmark}: {row.baseline} | {row.candidate} | {row.ratio} {row.note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
