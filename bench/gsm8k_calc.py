"""The real-data CPU run: GRPO on the calculator annotations inside GSM8K's answers, through the whole pipeline.

GSM8K's reference solutions mark each computation as `<<48/2=24>>`: thousands of real arithmetic
questions that people wrote down while solving grade-school problems, each with its verified result. This
module takes the two-operand ones with integer operands up to `--max-operand` and a whole, non-negative
result, one row per occurrence (GSM8K reuses the same small computations, so most occurrences are exact
duplicates: the data stage's dedup drops them and says so), from the train split for training and from the
test split for decontamination; then runs `grpo-pipeline run --config configs/gsm8k-calc-cpu.yaml` on
SmolLM2-135M and records the holdout gain of `math_answer` with its paired 95 % interval.

    python -m bench.gsm8k_calc prepare               # writes .grpo/gsm8k-calc/{train,test}.jsonl
    python -m bench.gsm8k_calc                       # prepare, run the pipeline (~10 min on 2 cores), save
    python -m bench.gsm8k_calc --tiny                # 2 steps on 16 holdout prompts: does the chain run?

The data is read from ../shared/data/gsm8k (or --gsm8k DIR); it is GSM8K (MIT licence), never copied into
the project: the derived rows live under the ignored .grpo/ folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

from bench.harness import ROOT, add_threads_option, pipeline_run, save, torch_threads
from bench.table import Row

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
OUT = ROOT / ".grpo" / "gsm8k-calc"
CONFIG = ROOT / "configs" / "gsm8k-calc-cpu.yaml"
NAME = "gsm8k_calc"
ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
TWO_OPERANDS = re.compile(r"\s*(\d+)\s*([-+*/])\s*(\d+)\s*")


def calculations(answer: str, max_operand: int) -> list[dict]:
    """The calculator annotations of one GSM8K solution that fit the slice, each verified by computing it.

    >>> calculations("Natalia sold 48/2 = <<48/2=24>>24 clips.\\nShe sold 48+24 = <<48+24=72>>72.\\n#### 72", 50)
    [{'question': '48 / 2', 'answer': '24'}, {'question': '48 + 24', 'answer': '72'}]
    >>> calculations("<<5*0.25=1.25>> <<120/7=17.14>> <<3-9=-6>>", 50)
    []
    """
    out = []
    for expression, stated in ANNOTATION.findall(answer):
        match = TWO_OPERANDS.fullmatch(expression)
        if not match:
            continue
        a, op, b = int(match[1]), match[2], int(match[3])
        if a > max_operand or b > max_operand or (op == "/" and b == 0):
            continue
        value = (
            Fraction(a + b)
            if op == "+"
            else Fraction(a - b)
            if op == "-"
            else Fraction(a * b)
            if op == "*"
            else Fraction(a, b)
        )
        if value.denominator != 1 or value < 0:
            continue
        try:
            if Fraction(stated.strip()) != value:  # the annotation's own result disagrees: not used
                continue
        except (ValueError, ZeroDivisionError):
            continue
        out.append({"question": f"{a} {op} {b}", "answer": str(value.numerator)})
    return out


def prepare(gsm8k: Path = GSM8K, out: Path = OUT, max_operand: int = 20) -> dict[str, Path]:
    """{train, test}.jsonl of calculator questions from GSM8K's two splits; their counts in out/prepared.json."""
    out.mkdir(parents=True, exist_ok=True)
    paths, counts = {}, {}
    for split in ("train", "test"):
        source = gsm8k / f"{split}.jsonl"
        if not source.is_file():
            raise FileNotFoundError(
                f"{source} not found: point --gsm8k at a folder with GSM8K's train.jsonl and test.jsonl"
            )
        rows, problems = [], 0
        with open(source, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    problems += 1
                    rows += calculations(json.loads(line)["answer"], max_operand)
        target = out / f"{split}.jsonl"
        tmp = target.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(target)
        paths[split] = target
        counts[split] = {"problems": problems, "rows": len(rows), "distinct": len({r["question"] for r in rows})}
    (out / "prepared.json").write_text(json.dumps({"max_operand": max_operand, "counts": counts}, indent=1))
    return paths


def run_pipeline(paths: dict[str, Path], work: Path, overrides: list[str], threads: int | None) -> tuple[dict, float]:
    """`grpo-pipeline run --json` on the prepared slice in a fresh data_dir (so the base is the baseline)."""
    sets = [f"data.source={paths['train']}", f"data.eval_sources=[{paths['test']}]", *overrides]
    return pipeline_run(work, sets, threads, config=CONFIG)


def result(summary: dict, seconds: float, prepared: dict, tiny: bool) -> dict:
    decision = summary["decision"]
    metric = next(k for k in decision["stats"] if k != "guardrails")
    data = summary["data"]
    return {
        "name": NAME,
        "tiny": tiny,
        "wall_s": round(seconds, 1),
        "prepared": prepared,
        "data_report": data.get("report", data),
        "holdout": summary["holdout"],
        "metric": metric,
        "stats": decision["stats"][metric],
        "promote": decision["promote"],
        "reasons": decision["reasons"],
        "steps": summary["train"]["global_step"],
        "train_runtime_s": summary["train"]["train_runtime_s"],
        "machine": {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def table_rows(load) -> list[Row]:
    r = load(NAME)
    bench = "real data: GSM8K calculator annotations, SmolLM2-135M, holdout math_answer (`bench.gsm8k_calc`)"
    if r is None:
        return [Row(bench, "base", "trained", None, "", note="not run yet")]
    s = r["stats"]
    verdict = "significant (promoted)" if r["promote"] else "not significant / not promoted"
    return [
        Row(
            bench + f", {r['steps']} steps, {r['wall_s'] / 60:.1f} min",
            f"base: {s['mean_baseline']:.3f}",
            f"trained: {s['mean_candidate']:.3f}",
            s["mean_diff"],
            "> 0",
            note=f"gain {s['mean_diff']:+.3f}, 95% CI {s['ci_low']:+.3f} to {s['ci_high']:+.3f} on {s['n']} prompts: {verdict}",
            unit="",
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="run", choices=["run", "prepare"])
    parser.add_argument("--gsm8k", type=Path, default=GSM8K)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="2 steps, 16 holdout prompts: the chain, not the gain")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="more pipeline overrides")
    add_threads_option(parser)
    opts = parser.parse_args(argv)
    paths = prepare(opts.gsm8k, opts.out, opts.max_operand)
    prepared = json.loads((opts.out / "prepared.json").read_text())
    print(f"[{NAME}] prepared {prepared['counts']} in {opts.out}", flush=True)
    if opts.what == "prepare":
        return 0
    overrides = list(opts.overrides)
    if opts.tiny:
        overrides += ["train.grpo.max_steps=2", "data.holdout_share=0.01", "promote.min_samples=1"]
    busy = os.getloadavg()[0]
    threads = torch_threads(opts.threads, busy)
    print(f"[{NAME}] load {busy:.1f} before the run: torch threads {threads or 'default'}", flush=True)
    summary, seconds = run_pipeline(
        paths, ROOT / ".grpo" / f"bench-{NAME}{'-tiny' if opts.tiny else ''}", overrides, threads
    )
    report = result(summary, seconds, prepared, opts.tiny) | {"threads": threads, "load_before": busy}
    s = report["stats"]
    print(
        f"[{NAME}] {report['metric']}: base {s['mean_baseline']:.3f} -> trained {s['mean_candidate']:.3f}, gain "
        f"{s['mean_diff']:+.3f} (95% CI {s['ci_low']:+.3f} to {s['ci_high']:+.3f}, n={s['n']}); "
        f"{'promoted' if report['promote'] else 'not promoted'}; {seconds / 60:.1f} min",
        flush=True,
    )
    save(f"{NAME}_tiny" if opts.tiny else NAME, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
