"""Benchmark: the data stage's whole chain (load, validate, extract, dedup, tokens, split, decontaminate,
write) on a GSM8K-built corpus, against a straightforward per-row Python implementation of the same chain.

Goals on 2 CPU cores: >= 20k rows/s without near-dedup, >= 3k rows/s with it, and peak memory that stays
flat as the corpus grows. Each side runs in its own process (so each peak memory is its own), the two
sides alternate, and the no-near-dedup runs must keep exactly the same rows on both sides.

    python -m bench.data_throughput [--rows 100000] [--repeats 2] [--scales 25000,50000,100000,200000]

The corpus: every GSM8K question (train + test) rewritten into variants (every sixth word replaced by a
random GSM8K word, so variants share no 13-gram and few 5-grams), with 10% exact duplicates (case and
spacing changed), 5% near duplicates (one word dropped or added), 0.5% verbatim GSM8K test questions
(contamination, GSM8K test is the eval set) and 0.1% broken lines. Needs ../shared/data/gsm8k.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import ROOT, save, stamp

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
NAME = "data_throughput"


def build_corpus(path: Path, rows: int, seed: int = 0) -> None:
    """Write the benchmark corpus (JSONL, GSM8K's columns: question, answer)."""
    base = [json.loads(line) for f in ("train.jsonl", "test.jsonl") for line in (GSM8K / f).open()]
    test = [json.loads(line) for line in (GSM8K / "test.jsonl").open()]
    vocab = sorted({w for r in base for w in r["question"].split()})
    rng = random.Random(seed)
    n_dup, n_near, n_leak, n_bad = int(rows * 0.10), int(rows * 0.05), int(rows * 0.005), int(rows * 0.001)
    distinct = []
    for i in range(rows - n_dup - n_near - n_leak - n_bad):
        r = base[i % len(base)]
        phase = 1 + (i // len(base)) % 5  # which sixth of the words is replaced
        words = [rng.choice(vocab) if k % 6 == phase else w for k, w in enumerate(r["question"].split(" "))]
        words[0] = f"{words[0]}{i}"  # variants of one question beyond the first five stay distinct
        distinct.append({"question": " ".join(words), "answer": r["answer"]})
    lines = [json.dumps(r) for r in distinct]
    for _ in range(n_dup):
        r = rng.choice(distinct)
        lines.append(json.dumps({"question": "  " + r["question"].upper().replace(" ", "  "), "answer": r["answer"]}))
    for _ in range(n_near):
        r = rng.choice(distinct)
        words = r["question"].split(" ")
        if rng.random() < 0.5 and len(words) > 8:
            del words[rng.randrange(1, len(words))]
        else:
            words.insert(rng.randrange(1, len(words)), rng.choice(vocab))
        lines.append(json.dumps({"question": " ".join(words), "answer": r["answer"]}))
    lines += [json.dumps(rng.choice(test)) for _ in range(n_leak)]
    lines += ['{"question": "broken line' for _ in range(n_bad)]
    rng.shuffle(lines)
    path.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------- the straightforward per-row baseline

_WORD = re.compile(r"[^\W_]+|[^\w\s]|_")


def _grams(text: str, n: int) -> list[tuple[str, ...]]:
    w = _WORD.findall(text.lower())
    return [tuple(w[i : i + n]) for i in range(len(w) - n + 1)] if len(w) >= n else ([tuple(w)] if w else [])


def baseline_chain(source: Path, eval_source: Path, out: Path, cfg, tokenizer_path: str) -> dict:
    """The same chain, one row at a time, everything in Python lists and sets."""
    from datasketch import MinHash, MinHashLSH
    from transformers import AutoTokenizer

    from grpo_pipeline.tasks.data.splits import split_of
    from grpo_pipeline.tasks.data.text import LSH_WEIGHTS
    from grpo_pipeline.trainer.rewards import correct_answer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    overhead = len(
        tok(
            tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )
    near = (
        MinHashLSH(threshold=cfg.near_dup_threshold, num_perm=cfg.near_dup_num_perm, weights=LSH_WEIGHTS)
        if cfg.near_dup_threshold
        else None
    )
    signatures: dict[str, MinHash] = {}
    seen: set[bytes] = set()
    kept: dict[str, list[dict]] = {"train": [], "val": [], "holdout": []}
    dropped: dict[str, int] = {}
    quarantine = []

    def drop(reason: str, row) -> None:
        dropped[reason] = dropped.get(reason, 0) + 1
        quarantine.append({"reason": reason, "row": row})

    rows_read = 0
    for line in source.open("rb"):
        if not line.strip():
            continue
        rows_read += 1
        try:
            rec = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            drop("bad_json", line.decode("utf-8", "replace"))
            continue
        prompt, answer = rec.get("question"), rec.get("answer")
        if not isinstance(prompt, str) or not isinstance(answer, str):
            drop("wrong_type", rec)
            continue
        if not prompt.strip():
            drop("empty_prompt", rec)
            continue
        if "####" not in answer:
            drop("answer_extraction_failed", rec)
            continue
        answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
        if correct_answer([[{"role": "assistant", "content": answer}]], answer=[answer])[0] <= 0:
            drop("answer_unverifiable", rec)
            continue
        digest = hashlib.sha256(" ".join(prompt.lower().split()).encode()).digest()
        if digest[:12] in seen:
            drop("exact_duplicate", rec)
            continue
        seen.add(digest[:12])
        key = digest[:8].hex()
        tokens = overhead + len(tok.encode(prompt, add_special_tokens=False))
        if tokens > cfg.max_prompt_tokens or tokens < cfg.min_prompt_tokens:
            drop("too_many_tokens" if tokens > cfg.max_prompt_tokens else "too_few_tokens", rec)
            continue
        if near is not None:
            m = MinHash(num_perm=cfg.near_dup_num_perm)
            for gram in _grams(prompt, cfg.near_dup_ngram):
                m.update(" ".join(gram).encode())
            if any(m.jaccard(signatures[c]) >= cfg.near_dup_threshold for c in near.query(m)):
                drop("near_duplicate", rec)
                continue
            near.insert(key, m)
            signatures[key] = m
        kept[split_of(key, cfg.holdout_share, cfg.val_share)].append(
            {"prompt": [{"role": "user", "content": prompt}], "answer": answer, "key": key, "text": prompt}
        )
    reference = set()
    for row in kept["holdout"] + kept["val"]:
        reference.update(_grams(row["text"], cfg.contamination_ngram))
    for line in eval_source.open():
        reference.update(_grams(json.loads(line)["question"], cfg.contamination_ngram))
    train = []
    for row in kept["train"]:
        grams = _grams(row["text"], cfg.contamination_ngram)
        if grams and sum(g in reference for g in grams) / len(grams) >= cfg.contamination_threshold:
            drop("contaminated", row)
        else:
            train.append(row)
    kept["train"] = train
    for split, rows in kept.items():
        with (out / f"{split}.jsonl").open("w") as fh:
            for row in rows:
                fh.write(json.dumps({"prompt": row["prompt"], "answer": row["answer"], "key": row["key"]}) + "\n")
    with (out / "quarantine.jsonl").open("w") as fh:
        for q in quarantine:
            fh.write(json.dumps(q) + "\n")
    return {"rows_read": rows_read, "splits": {s: len(r) for s, r in kept.items()}, "dropped": dropped}


# ---------------------------------------------------------------- one measured run, in its own process


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(side: str, source: Path, eval_source: Path, near: bool, tokenizer_path: str) -> dict:
    from transformers import AutoTokenizer  # imported on both sides before the memory baseline

    from grpo_pipeline.configs.schema import DataConfig
    from grpo_pipeline.tasks.data.stage import CORRECT_ANSWER, run_chain

    AutoTokenizer.from_pretrained(tokenizer_path)
    cfg = DataConfig(
        source=str(source),
        prompt_column="question",
        answer_extraction="gsm8k",
        eval_sources=[str(eval_source)],
        near_dup_threshold=0.8 if near else None,
        max_dropped_fraction=1.0,
    )
    start_rss = _rss_mb("VmRSS")
    with tempfile.TemporaryDirectory() as out:
        started, cpu = time.perf_counter(), time.process_time()
        if side == "arrow":
            report = run_chain(cfg, Path(out), tokenizer_path, CORRECT_ANSWER).model_dump()
        else:
            report = baseline_chain(source, eval_source, Path(out), cfg, tokenizer_path)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
        keys = {
            s: sorted(json.loads(line)["key"] for line in open(Path(out) / f"{s}.jsonl"))
            for s in ("train", "val", "holdout")
        }
    digest = hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16]
    return {
        "side": side,
        "near_dedup": near,
        "rows": report["rows_read"],
        "seconds": seconds,
        "rows_per_s": report["rows_read"] / seconds,
        "cpu_seconds": cpu_seconds,
        "rows_per_cpu_s": report["rows_read"] / cpu_seconds,
        "load_average": os.getloadavg()[0],
        "peak_rss_mb": _rss_mb("VmHWM"),
        "working_mb": _rss_mb("VmHWM") - start_rss,
        "splits": report["splits"],
        "dropped": report["dropped"],
        "kept_keys_digest": digest,
        "kept_keys": {s: len(k) for s, k in keys.items()},
    }


def run_side(side: str, source: Path, near: bool, tokenizer_path: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.data_throughput",
        "--worker",
        side,
        "--source",
        str(source),
        "--tokenizer",
        tokenizer_path,
    ] + (["--near"] if near else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tokenizer_dir(work: Path) -> str:
    """SmolLM2-135M's tokenizer when the demo model is cached here, else the tiny test model's."""
    demo = ROOT / ".grpo" / "models" / "smollm2-135m-instruct"
    if (demo / "tokenizer.json").is_file():
        return str(demo)
    from tests.tiny_model import create_random_model

    return str(create_random_model(work / "tiny"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scales", default="25000,50000,100000,200000", help="corpus sizes for the memory curve")
    parser.add_argument("--worker", choices=["arrow", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--source", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--near", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.source, GSM8K / "test.jsonl", args.near, args.tokenizer)))
        return
    if not (GSM8K / "train.jsonl").is_file():
        sys.exit(f"GSM8K is not at {GSM8K}; this benchmark needs it")
    work = Path(tempfile.mkdtemp(prefix="data-bench-"))
    tok = tokenizer_dir(work)
    corpus = work / f"corpus-{args.rows}.jsonl"
    build_corpus(corpus, args.rows)
    runs: list[dict] = []
    for i in range(args.repeats):
        for near in (False, True):
            for side in ("baseline", "arrow"):
                r = run_side(side, corpus, near, tok)
                runs.append(r)
                print(
                    f"[{NAME}] round {i + 1}/{args.repeats} {side:8s} near_dedup={near!s:5s}: "
                    f"{r['rows_per_s']:,.0f} rows/s ({r['rows_per_cpu_s']:,.0f} per CPU-second, load {r['load_average']:.1f}), "
                    f"peak {r['peak_rss_mb']:.0f} MiB (+{r['working_mb']:.0f})",
                    flush=True,
                )

    def median(side: str, near: bool, key: str = "rows_per_s") -> float:
        return statistics.median(r[key] for r in runs if r["side"] == side and r["near_dedup"] == near)

    same_rows = {
        near: len({r["kept_keys_digest"] for r in runs if r["near_dedup"] == near}) == 1 for near in (False, True)
    }
    memory = []
    for rows in sorted(int(s) for s in args.scales.split(",") if s):
        path = work / f"corpus-{rows}.jsonl"
        if not path.exists():
            build_corpus(path, rows)
        for side in ("baseline", "arrow"):
            r = run_side(side, path, False, tok)
            memory.append(
                {k: r[k] for k in ("side", "rows", "peak_rss_mb", "working_mb", "rows_per_s", "rows_per_cpu_s")}
            )
            print(
                f"[{NAME}] memory {side:8s} {rows:>7,} rows: peak {r['peak_rss_mb']:.0f} MiB "
                f"(+{r['working_mb']:.0f} over start), {r['rows_per_s']:,.0f} rows/s",
                flush=True,
            )
    report = {
        "name": NAME,
        "metric": "rows per second through the whole chain (rows read / wall seconds)",
        "rows": args.rows,
        "tokenizer": tok,
        "corpus": "GSM8K train+test rewritten into variants; 10% exact dups, 5% near dups, 0.5% GSM8K test leaks, 0.1% broken lines",
        "median": {
            f"{side}{'_near' if near else ''}": median(side, near)
            for side in ("baseline", "arrow")
            for near in (False, True)
        },
        # Wall-clock rows/s depends on what else runs on the machine; rows per CPU-second much less so.
        "median_per_cpu_s": {
            f"{side}{'_near' if near else ''}": median(side, near, "rows_per_cpu_s")
            for side in ("baseline", "arrow")
            for near in (False, True)
        },
        "ratio": median("arrow", False) / median("baseline", False),
        "ratio_near_dedup": median("arrow", True) / median("baseline", True),
        "goals": {"rows_per_s": 20_000, "rows_per_s_near_dedup": 3_000},
        "same_rows_kept_without_near_dedup": same_rows[False],
        "same_rows_kept_with_near_dedup": same_rows[True],
        "peak_rss_mb": {
            f"{side}{'_near' if near else ''}": median(side, near, "peak_rss_mb")
            for side in ("baseline", "arrow")
            for near in (False, True)
        },
        "memory_by_rows": memory,
        "runs": runs,
        **stamp(),
    }
    save(NAME, report)
    m = report["median"]
    print(
        f"[{NAME}] without near-dedup: arrow {m['arrow']:,.0f} rows/s vs per-row {m['baseline']:,.0f} "
        f"(x{report['ratio']:.1f}); with: {m['arrow_near']:,.0f} vs {m['baseline_near']:,.0f} "
        f"(x{report['ratio_near_dedup']:.1f}); same rows kept: {same_rows}"
    )


if __name__ == "__main__":
    main()
