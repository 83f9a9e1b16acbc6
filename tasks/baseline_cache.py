"""The baseline's holdout scores, computed once: every run scores its baseline (the base model, or the current
champion) on the holdout again, on the same prompts with the same settings; a kept copy of those per-prompt scores
answers the next run that compares against the same baseline.

An entry is keyed by everything that changes the scores (`baseline_parts`): the model (its path and files' sizes
and times; an adapter by its content), how it is loaded (quantization, dtype), the holdout's rows, the generation
settings (engine, max_new_tokens, batch size, and the sampling settings when pass@k samples), the reward set (names,
weights, arguments, roles), the evaluation's accuracy and format rewards, the source of the code that generates and
scores (and of a custom reward's module), and the libraries' versions. Any change gives another key: the run
computes the scores afresh and says which part changed in its log.

An entry is data, never trusted: one that does not parse, names another key inside, or holds other rows than the
holdout's (count, keys, a score column missing or not a number) is ignored with a warning and the scores are
computed afresh; nothing read from it is executed or used as a path. A store that cannot be read or written costs
the cache, not the run (a warning). Entries are written aside and renamed into place.

Pure functions first (`baseline_parts`, `cache_key`, `check_entry`, `nearest`), the store's I/O (`lookup`,
`store`), and `baseline_scores`, which the flow's evaluate stages call with the evaluation to run on a miss.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import EvalConfig, ModelConfig
from grpo_pipeline.tasks.check import model_identity
from grpo_pipeline.tasks.evaluate import EvalResult, pick_examples, read_jsonl, score_columns
from grpo_pipeline.tasks.job import model_load

log = logging.getLogger(__name__)

FORMAT = 1  # the entry's layout; a change to it is a change to this module's source, so to the key
KEEP = 64  # entries kept in a store, newest first: a daily schedule's champions and a benchmark's seeds
NEAREST_SCAN = 16  # entries read to say what changed on a miss (each holds a holdout's completions)
# The source that turns a model and a holdout into scores: generation, loading, the prompt renderer, the rewards
# and the weighted total (a package: every module in it). A change to any of them recomputes.
SCORING_CODE = (
    "grpo_pipeline.tasks.evaluate",
    "grpo_pipeline.tasks.chat_prompts",
    "grpo_pipeline.tasks.baseline_cache",
    "grpo_pipeline.trainer.loading",
    "grpo_pipeline.trainer.generation",
    "grpo_pipeline.trainer.cuts",
    "grpo_pipeline.trainer.rewards",
    "grpo_pipeline.configs.rewards",
)
LIBRARIES = ("torch", "transformers", "peft", "vllm")
PARTS = ("model", "load", "holdout", "generation", "rewards", "evaluation", "code", "libraries")
# what each part is called in the run's log when it changed
PART_NAMES = {
    "model": "model",
    "load": "quantization/dtype",
    "holdout": "holdout",
    "generation": "generation settings",
    "rewards": "reward set",
    "evaluation": "accuracy/format rewards",
    "code": "code version",
    "libraries": "library versions",
}


class Entry(BaseModel):
    """One kept evaluation: the key it answers, each part's digest (to say what changed on a miss), the baseline's
    label ("base", "champion v3") and its result."""

    format: Literal[1]
    key: str
    parts: dict[str, str]
    label: str
    result: EvalResult


class BaselineResult(EvalResult):
    """An evaluation of a baseline, with where it came from: `cached` (read from the store) and the entry's key
    (None when the cache is off)."""

    cached: bool = False
    cache_key: str | None = None


@dataclass(frozen=True)
class Lookup:
    """What the store answered: the result (None: compute it) and why, for the run's log."""

    result: EvalResult | None
    note: str


# ------------------------------------------------------------------------------------------------ the key


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def content_digest(path: Path) -> str:
    """sha256 of a file's or a directory's files' contents (with their relative names): an adapter, downloaded
    afresh each run, is the same adapter when its bytes are."""
    path = Path(path)
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as stream:
            h.update(hashlib.file_digest(stream, "sha256").digest())
    return h.hexdigest()


def holdout_fingerprint(rows: list[dict]) -> str:
    """sha256 of the rows' content, each as canonical JSON: the same rows in the same order, whatever the file's
    formatting.

    >>> holdout_fingerprint([{"a": 1, "b": 2}]) == holdout_fingerprint([{"b": 2, "a": 1}])
    True
    >>> holdout_fingerprint([{"a": 1}, {"a": 2}]) == holdout_fingerprint([{"a": 2}, {"a": 1}])
    False
    """
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def _module_files(name: str) -> list[Path]:
    """A module's source file, or every module of a package; [] when it cannot be found."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return sorted(f for d in spec.submodule_search_locations for f in Path(d).rglob("*.py"))
    return [Path(spec.origin)] if spec.origin and Path(spec.origin).is_file() else []


def code_version(rewards: RewardSet) -> str:
    """sha256 of the scoring code's source (`SCORING_CODE`) and of each custom reward's module ('pkg.mod:fn')."""
    modules = [*SCORING_CODE, *sorted({n.partition(":")[0] for n in rewards.names if ":" in n})]
    h = hashlib.sha256()
    for name in modules:
        h.update(name.encode() + b"\0")
        for f in _module_files(name):
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def library_versions(engine: str) -> dict[str, str | None]:
    """The installed versions of what generates (torch, transformers, peft; vLLM when it is the engine)."""

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in LIBRARIES if name != "vllm" or engine == "vllm"}


def resolved_engine(cfg: EvalConfig) -> str:
    """The engine `evaluate_model` will generate with: `auto` is vLLM only on a CUDA machine that has it."""
    if cfg.engine != "auto":
        return cfg.engine
    from grpo_pipeline.tasks.evaluate import vllm_usable

    return "vllm" if vllm_usable() else "transformers"


def generation_settings(cfg: EvalConfig, engine: str) -> dict[str, Any]:
    """What of `evaluate.*` changes the completions: the engine, the length and the batch (padding changes a
    batch's numerics), and the sampling settings only when pass@k samples (`samples_k` with an accuracy reward).
    `examples` is not in it: the examples are picked again from the kept rows.

    >>> generation_settings(EvalConfig(), "transformers")
    {'engine': 'transformers', 'max_new_tokens': 16, 'batch_size': 32}
    >>> sorted(generation_settings(EvalConfig(samples_k=4), "transformers"))
    ['batch_size', 'engine', 'max_new_tokens', 'samples_k', 'seed', 'temperature']
    """
    out: dict[str, Any] = {"engine": engine, "max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size}
    if cfg.samples_k and cfg.accuracy_reward:
        out |= {"samples_k": cfg.samples_k, "temperature": cfg.temperature, "seed": cfg.seed}
    return out


def baseline_parts(
    model_path: str,
    model_cfg: ModelConfig,
    rows: list[dict],
    rewards: RewardSet,
    cfg: EvalConfig,
    adapter: str | None = None,
) -> dict[str, str]:
    """Each part of the key (`PARTS`) as a short digest. The base is named by its path and its files' names, sizes
    and modification times (a rewritten weight file changes it without hashing gigabytes); an adapter, small and
    downloaded afresh each run, by its content."""
    engine = resolved_engine(cfg)
    values = {
        "model": {
            "path": model_path,
            "files": model_identity(model_path),
            "adapter": content_digest(Path(adapter)) if adapter else None,
        },
        "load": model_load(model_cfg).model_dump(mode="json"),
        "holdout": holdout_fingerprint(rows),
        "generation": generation_settings(cfg, engine),
        "rewards": rewards.model_dump(mode="json"),
        "evaluation": {"accuracy_reward": cfg.accuracy_reward, "format_reward": cfg.format_reward},
        "code": code_version(rewards),
        "libraries": library_versions(engine),
    }
    return {name: _digest(values[name]) for name in PARTS}


def cache_key(parts: dict[str, str]) -> str:
    """sha256 of every part's digest: any part changed, another key.

    >>> parts = {name: "0" for name in PARTS}
    >>> cache_key(parts) == cache_key(dict(parts)), cache_key(parts) == cache_key(parts | {"holdout": "1"})
    (True, False)
    """
    return hashlib.sha256(json.dumps([parts[name] for name in PARTS]).encode()).hexdigest()


def store_dir(data_dir: Path) -> Path:
    """Where baselines' scores are kept: under the run's data_dir, beside the task checks (`tasks/check.py`)."""
    return Path(data_dir) / "baseline-scores"


def entry_path(store: Path, key: str) -> Path:
    return Path(store) / f"{key[:32]}.json"


# ------------------------------------------------------------------------------------------------ an entry checked


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_entry(entry: Entry, key: str, rows: list[dict], columns: list[str]) -> str | None:
    """What is wrong with a parsed entry for this key and holdout, or None when it is this key's and holds one
    scored row per holdout row, in the holdout's order and keys, each score column a number.

    >>> rows = [{"key": "a"}, {"key": "b"}]
    >>> scored = [{"key": k, "completion": "4", "total": t} for k, t in (("a", 1.0), ("b", 0.0))]
    >>> result = EvalResult(reward=0.5, per_reward={}, n=2, rows=scored)
    >>> entry = Entry(format=1, key="k", parts={}, label="base", result=result)
    >>> check_entry(entry, "k", rows, ["total"]) is None
    True
    >>> check_entry(entry, "other", rows, ["total"])
    'it holds the scores of another key'
    >>> check_entry(entry, "k", rows[::-1], ["total"])
    "its rows' keys are not the holdout's"
    >>> check_entry(entry, "k", rows, ["total", "correct_answer"])
    "row 'a' has no number for correct_answer"
    """
    result = entry.result
    if entry.key != key:
        return "it holds the scores of another key"
    if result.n != len(rows) or len(result.rows) != len(rows):
        return f"it holds {len(result.rows)} rows (n={result.n}), the holdout {len(rows)}"
    if [r.get("key") for r in result.rows] != [row.get("key", i) for i, row in enumerate(rows)]:
        return "its rows' keys are not the holdout's"
    for row in result.rows:
        if bad := [c for c in columns if not _number(row.get(c))]:
            return f"row {row.get('key')!r} has no number for {', '.join(bad)}"
        if not isinstance(row.get("completion"), str):
            return f"row {row.get('key')!r} has no completion"
    if not math.isclose(result.reward, sum(r["total"] for r in result.rows) / max(len(rows), 1), abs_tol=1e-9):
        return "its mean reward is not its rows' mean total"
    return None


def nearest(current: dict[str, str], others: list[dict[str, str]]) -> list[str] | None:
    """The parts in which the closest of `others` differs from `current` (None when there is none to compare).

    >>> nearest({"model": "a", "holdout": "b"}, [{"model": "x", "holdout": "y"}, {"model": "a", "holdout": "z"}])
    ['holdout']
    >>> nearest({"model": "a"}, []) is None
    True
    """
    diffs = [[p for p in current if other.get(p) != current[p]] for other in others]
    return min(diffs, key=len) if diffs else None


# ------------------------------------------------------------------------------------------------ the store


def _entries_newest_first(store: Path) -> list[Path]:
    """The store's entry files (only names this module writes), newest first."""
    found = [p for p in store.glob("*.json") if len(p.stem) == 32 and all(c in "0123456789abcdef" for c in p.stem)]
    return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def _why_missed(store: Path, parts: dict[str, str], label: str) -> str:
    """A miss explained: which parts the closest kept entry differs in (the same model's, when there is one)."""
    others: list[tuple[str, dict[str, str]]] = []
    try:
        for path in _entries_newest_first(store)[:NEAREST_SCAN]:
            try:
                entry = json.loads(path.read_bytes())
                if isinstance(entry, dict) and isinstance(entry.get("parts"), dict):
                    others.append((str(entry.get("label", "?")), entry["parts"]))
            except (OSError, ValueError):
                continue  # a corrupt neighbour explains nothing
    except OSError:
        pass  # no store yet, or one that cannot be listed
    diff = nearest(parts, [p for _, p in others])
    if diff is None:
        return f"{label}'s holdout scores are not in the cache yet: computing them"
    changed = ", ".join(PART_NAMES.get(p, p) for p in diff)
    return f"{label}'s holdout scores are not in the cache: the closest kept entry differs in {changed}; recomputing"


def lookup(where: Path, key: str, parts: dict[str, str], rows: list[dict], columns: list[str], label: str) -> Lookup:
    """The entry for `key`, checked against the holdout's rows (`check_entry`); a missing, corrupt, foreign or
    unreadable entry is a miss, said in the note (and, when something is wrong, a warning)."""
    path = entry_path(where, key)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Lookup(None, _why_missed(where, parts, label))
    except OSError as exc:
        note = f"the baseline cache {where} cannot be read ({exc}); computing {label}'s holdout scores without it"
        log.warning(note)
        return Lookup(None, note)
    try:
        entry = Entry.model_validate_json(raw)
        problem = check_entry(entry, key, rows, columns)
    except (ValidationError, ValueError) as exc:
        problem = f"it is not a baseline entry ({str(exc).splitlines()[0]})"
    if problem:
        note = f"ignoring the baseline cache entry {path}: {problem}; recomputing {label}'s holdout scores"
        log.warning(note)
        return Lookup(None, note)
    return Lookup(entry.result, f"{label}'s holdout scores come from the cache ({key[:12]}, kept as {entry.label!r})")


def _touch(path: Path) -> None:
    """Mark an entry used, so the store keeps the entries runs still read (`KEEP` drops the oldest)."""
    try:
        path.touch()
    except OSError:
        pass  # a read-only store still answers


def store(where: Path, key: str, parts: dict[str, str], label: str, result: EvalResult) -> str | None:
    """Keep `result` under `key`: written aside in the store and renamed into place, so a reader never sees half
    an entry; the oldest entries beyond `KEEP` go. A store that cannot be written returns the warning (the run
    goes on without the cache)."""
    entry = Entry(format=FORMAT, key=key, parts=parts, label=label, result=result.model_copy(update={"examples": []}))
    tmp: Path | None = None
    try:
        Path(where).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=where, suffix=".tmp", delete=False, encoding="utf-8") as f:
            tmp = Path(f.name)
            f.write(entry.model_dump_json())
        tmp.replace(entry_path(where, key))
        tmp = None
        for old in _entries_newest_first(Path(where))[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        note = f"the baseline cache {where} cannot be written ({exc}); the run goes on without keeping {label}'s scores"
        log.warning(note)
        return note
    return None


# ------------------------------------------------------------------------------------------------ the flow's call


def baseline_scores(
    evaluate: Callable[[], EvalResult],
    *,
    data_dir: Path | None,
    model_path: str,
    model_cfg: ModelConfig,
    holdout: Path,
    rewards: RewardSet,
    cfg: EvalConfig,
    adapter: str | None = None,
    label: str = "base",
    say: Callable[[str], None] = log.info,
) -> BaselineResult:
    """The baseline's evaluation from the store under `data_dir` when it holds this key's, else `evaluate()`'s,
    then kept. `data_dir` None: the cache is off (`evaluate.cache_baseline: false`). `say` tells the run's log
    where the scores came from, or why they were computed."""
    if data_dir is None:
        return BaselineResult(**evaluate().model_dump())
    rows = read_jsonl(holdout)
    parts = baseline_parts(model_path, model_cfg, rows, rewards, cfg, adapter)
    key = cache_key(parts)
    where = store_dir(data_dir)
    found = lookup(where, key, parts, rows, score_columns(rewards, cfg), label)
    say(found.note)
    if found.result is not None:
        _touch(entry_path(where, key))
        # the examples are picked again from the kept rows, as the evaluation picks them: `evaluate.examples` is
        # not in the key
        examples = pick_examples(found.result, cfg.accuracy_reward, cfg.examples)
        return BaselineResult(**(found.result.model_dump() | {"examples": examples}), cached=True, cache_key=key)
    result = evaluate()
    if problem := store(where, key, parts, label, result):
        say(problem)
    return BaselineResult(**result.model_dump(), cached=False, cache_key=key)
