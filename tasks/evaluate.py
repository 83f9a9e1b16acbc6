"""Evaluation: greedy, batched generation on a holdout, scored by every reward, per sample; plus pass@k
from k sampled completions when `evaluate.samples_k` is set.

The base model, the champion and the candidate see the same prompts with the same decoding and seed, so
their per-sample scores can be compared pairwise. The rewards are the training's own (`grpo_pipeline.trainer.rewards`,
with the same checks: a reward that fails names itself and the row); accuracy and format rate are the means
of `evaluate.accuracy_reward` and `evaluate.format_reward`, scored even when training does not use them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task
from pydantic import BaseModel

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import EvalConfig, ModelConfig
from grpo_pipeline.tasks.chat_prompts import render
from grpo_pipeline.tasks.job import format_duration, model_load
from grpo_pipeline.trainer.loading import load_model
from grpo_pipeline.trainer.rewards import completion_text, resolve_reward, resolve_rewards

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)
EXAMPLE_CHARS = 600  # of a completion kept in an example: enough for a reasoning answer's ending


class EvalResult(BaseModel):
    reward: float  # mean over samples of the weighted total (`RewardSet.total`), as GRPO sees it
    per_reward: dict[str, float]
    metrics: dict[str, float] = {}  # accuracy, format_rate, mean_length, pass@k, remote_verifier/fallbacks
    n: int
    rows: list[dict]  # per sample: key, prompt, answer, completion, each reward, total, length
    examples: list[dict] = []  # a few right and wrong samples for the report (`pick_examples`)


def read_jsonl(path: Path) -> list[dict]:
    """One dict per line. Only a newline ends a line (`splitlines` would also split at U+2028, which
    GSM8K has inside questions)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """One dict per line, as `read_jsonl` reads them back (JSON's ASCII escapes: no line ends inside a row)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def last_user_message(prompt: str | list[dict]) -> str:
    """The last user message of a chat prompt (what the row asks, as the report shows it), or the prompt itself.
    Not what a model is given: `render` writes that (`grpo_pipeline.tasks.chat_prompts`, the served model's renderer too).

    >>> last_user_message([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}])
    'What is 2 + 3?'
    """
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def score(
    rows: list[dict],
    completions: list[str],
    rewards: RewardSet,
    lengths: list[int],
    *,
    extra: Sequence[str] = (),
    max_completion_length: int | None = None,
) -> EvalResult:
    """Score completions with each reward (bound with its arguments, as the trainer binds them) and keep
    their token lengths; pure, so it is tested without a model.

    Each row's `total` is the weighted total (`RewardSet.total`); `extra` rewards are scored into their own
    columns and left out of it (an accuracy reward the training does not use).

    >>> r = score([{"answer": "3"}, {"answer": "5"}], ["3", "five"], RewardSet(names=("correct_answer",)), [1, 1])
    >>> r.reward, r.per_reward
    (0.5, {'correct_answer': 0.5})
    >>> score([{"answer": "3"}], ["3"], RewardSet(names=("correct_answer", "number_only"), weights=(1.0, 0.5)), [1]).reward
    1.5
    """
    keys = dict.fromkeys(k for row in rows for k in row if k != "prompt")  # a column one row lacks is null there
    columns = {k: [row.get(k) for row in rows] for k in keys}
    logged: dict[str, float] = defaultdict(float)

    def log_metric(name: str, value: float) -> None:
        logged[name] += value

    inputs = {
        **columns,
        "prompts": [row.get("prompt") for row in rows],
        "completion_lengths": list(lengths),
        "log_metric": log_metric,
    }
    names = list(rewards.names) + [e for e in extra if e not in rewards.names]
    functions = resolve_rewards(names, rewards.args, max_completion_length=max_completion_length)
    per_sample = {name: fn(completions, **inputs) if rows else [] for name, fn in zip(names, functions, strict=True)}
    out_rows = []
    for i, row in enumerate(rows):
        scores = {name: per_sample[name][i] for name in names}
        out_rows.append(
            {
                "key": row.get("key", i),
                "prompt": last_user_message(row.get("prompt", "")),
                **({"answer": row["answer"]} if "answer" in row else {}),
                "completion": completions[i],
                **scores,
                "total": rewards.total(scores),
                "length": lengths[i],
            }
        )
    return EvalResult(
        reward=statistics.fmean(r["total"] for r in out_rows) if out_rows else 0.0,
        per_reward={name: statistics.fmean(per_sample[name]) for name in rewards.names} if out_rows else {},
        metrics=dict(logged),
        n=len(out_rows),
        rows=out_rows,
    )


def score_columns(rewards: RewardSet, cfg: EvalConfig) -> list[str]:
    """The numeric per-sample columns of an evaluation's rows (`score`, `evaluate_model`): each reward, the
    evaluation's own accuracy and format rewards, the weighted total, the length, and pass@k when sampled.
    What the promotion may compare (`promote.metric`) and guard (`promote.guardrails`).

    >>> score_columns(RewardSet(names=("math_answer",)), EvalConfig(accuracy_reward="math_answer",
    ...                                                          format_reward="think_format", samples_k=4))
    ['math_answer', 'think_format', 'total', 'length', 'pass_at_4']
    """
    extra = [r for r in (cfg.accuracy_reward, cfg.format_reward) if r and r not in rewards.names]
    sampled = [f"pass_at_{cfg.samples_k}"] if cfg.samples_k and cfg.accuracy_reward else []
    return [*rewards.names, *dict.fromkeys(extra), "total", "length", *sampled]


def pick_examples(result: EvalResult, column: str | None, k: int) -> list[dict]:
    """Up to k right and k wrong samples by `column` (the accuracy reward: right when it scores above 0),
    in holdout order, each with its prompt, reference, completion (its last EXAMPLE_CHARS characters) and scores.

    >>> rows = [{"key": "a", "prompt": "2+2?", "answer": "4", "completion": "4", "math_answer": 1.0, "total": 1.0, "length": 1},
    ...         {"key": "b", "prompt": "3+3?", "answer": "6", "completion": "7", "math_answer": 0.0, "total": 0.0, "length": 1}]
    >>> [(e["verdict"], e["key"]) for e in pick_examples(EvalResult(reward=0.5, per_reward={}, n=2, rows=rows), "math_answer", 1)]
    [('right', 'a'), ('wrong', 'b')]
    """
    if not column or not k or not result.rows or column not in result.rows[0]:
        return []
    picked: dict[str, list[dict]] = {"right": [], "wrong": []}
    for row in result.rows:
        verdict = "right" if row[column] > 0 else "wrong"
        if len(picked[verdict]) < k:
            text = row["completion"]
            picked[verdict].append(
                {
                    "verdict": verdict,
                    "key": row["key"],
                    "prompt": row.get("prompt", ""),
                    "answer": row.get("answer"),
                    "completion": text if len(text) <= EXAMPLE_CHARS else "..." + text[-EXAMPLE_CHARS:],
                    "scores": {
                        name: v
                        for name, v in row.items()
                        if name not in ("key", "prompt", "answer", "completion", "length")
                        and not name.startswith("pass_at_")
                    },
                }
            )
    return picked["right"] + picked["wrong"]


def contrast(candidate: EvalResult, baseline: EvalResult, column: str, k: int = 3) -> dict[str, list[dict]]:
    """The prompts where the two models disagree by `column`: up to k the candidate fixed (baseline wrong,
    candidate right) and k it broke, each with both completions; for the report.

    >>> base = EvalResult(reward=0, per_reward={}, n=2, rows=[{"key": "a", "prompt": "p", "completion": "x", "m": 0.0},
    ...                                                      {"key": "b", "prompt": "q", "completion": "y", "m": 1.0}])
    >>> cand = EvalResult(reward=0, per_reward={}, n=2, rows=[{"key": "a", "prompt": "p", "completion": "z", "m": 1.0},
    ...                                                      {"key": "b", "prompt": "q", "completion": "y", "m": 1.0}])
    >>> [(e["key"], e["baseline"], e["candidate"]) for e in contrast(cand, base, "m")["fixed"]]
    [('a', 'x', 'z')]
    """
    by_key = {row["key"]: row for row in baseline.rows}
    out: dict[str, list[dict]] = {"fixed": [], "broken": []}
    for row in candidate.rows:
        other = by_key.get(row["key"])
        if other is None or column not in row or column not in other:
            continue
        kind = "fixed" if row[column] > 0 >= other[column] else "broken" if other[column] > 0 >= row[column] else None
        if kind and len(out[kind]) < k:
            trim = lambda t: t if len(t) <= EXAMPLE_CHARS else "..." + t[-EXAMPLE_CHARS:]  # noqa: E731
            out[kind].append(
                {
                    "key": row["key"],
                    "prompt": row.get("prompt", ""),
                    "answer": row.get("answer"),
                    "baseline": trim(other["completion"]),
                    "candidate": trim(row["completion"]),
                }
            )
    return out


class EvalProgress:
    """Plain progress lines for a log that is not a terminal (a Prefect worker's, a CI job's), where a bar's
    every redraw would be one more line: one at each tenth of the prompts, with the rate and the time left.

    >>> clock = iter([0.0, 10.0, 15.0, 40.0]).__next__
    >>> p = EvalProgress("evaluating base", total=40, clock=clock)
    >>> p.advance(4)
    'evaluating base: 4/40 (10%), 0.40 prompts/s, ETA 1m 30s'
    >>> p.advance(2) is None  # still within the second tenth
    True
    >>> p.advance(34)
    'evaluating base: 40/40 (100%), 1.00 prompts/s, done in 40s'
    """

    def __init__(self, label: str, total: int, clock: Callable[[], float] | None = None):
        self.label, self.total = label, total
        self.clock = clock or time.monotonic
        self.started = self.clock()
        self.done = self.tenths = 0

    def advance(self, n: int) -> str | None:
        self.done += n
        now = self.clock()
        tenths = self.done * 10 // self.total
        if tenths <= self.tenths:
            return None
        self.tenths = tenths
        rate = self.done / (now - self.started) if now > self.started else 0.0
        left = (
            f"done in {format_duration(now - self.started)}"
            if self.done >= self.total
            else f"ETA {format_duration((self.total - self.done) / rate)}"
            if rate
            else "ETA --"
        )
        return f"{self.label}: {self.done}/{self.total} ({self.done / self.total:.0%}), {rate:.2f} prompts/s, {left}"


def eval_bar(
    label: str, total: int, console: Console | None = None, get_time: Callable[[], float] | None = None
) -> tuple[Progress, TaskID]:
    """A rich bar for a terminal, with the count, the time spent and the time left, and its task id.

    rich estimates the speed over the last 30 s by default: with a batch slower than that it holds one
    sample and shows the time left as -:--:--, so the whole run's average is used; a first sample at zero
    makes it known after the first batch."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console or Console(stderr=True),
        transient=True,
        speed_estimate_period=7 * 24 * 3600,
        get_time=get_time,
    )
    task_id = progress.add_task(label, total=total)
    progress.advance(task_id, 0)
    return progress, task_id


def _log_line(line: str) -> None:
    """Into the Prefect run's log when there is one (the UI and the worker's output show it), else stderr."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(line)
    except MissingContextError:
        print(line, file=sys.stderr, flush=True)


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    """`advance(n)` for n more prompts done: a bar on a terminal (stderr, where rich draws), plain lines
    otherwise."""
    from grpo_pipeline.trainer.callbacks import interactive  # here, not at the top: it brings transformers

    if interactive():
        bar, task_id = eval_bar(label, total)
        with bar:
            yield lambda n: bar.advance(task_id, n)
    else:
        lines = EvalProgress(label, total)

        def advance(n: int) -> None:
            if line := lines.advance(n):
                _log_line(line)

        yield advance


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    max_new_tokens: int,
    batch_size: int,
    label: str = "",
) -> tuple[list[str], list[int]]:
    """Greedy completions for chat prompts and their lengths in tokens, in batches, with progress shown as
    "evaluating <label>"."""
    import torch

    tokenizer.padding_side = "left"  # decoder-only models continue from the right edge
    texts = render(tokenizer, prompts)
    out: list[str] = []
    lengths: list[int] = []
    with progress(f"evaluating {label}".strip(), len(texts)) as advance, torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            )
            generated = model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            new_tokens = generated[:, batch["input_ids"].shape[1] :]
            out += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            lengths += (new_tokens != tokenizer.pad_token_id).sum(dim=1).tolist()
            advance(len(batch["input_ids"]))
    return out, lengths


def summary_metrics(result: EvalResult, cfg: EvalConfig) -> dict[str, float]:
    """Accuracy, format rate and mean length from the per-sample rows.

    >>> rows = [{"correct_answer": 1.0, "number_only": 1.0, "length": 2}, {"correct_answer": 0.0, "number_only": 1.0, "length": 4}]
    >>> summary_metrics(EvalResult(reward=0, per_reward={}, n=2, rows=rows), EvalConfig())
    {'mean_length': 3.0, 'accuracy': 0.5, 'format_rate': 1.0}
    """
    out = {"mean_length": statistics.fmean(r["length"] for r in result.rows)} if result.rows else {}
    for name, column in (("accuracy", cfg.accuracy_reward), ("format_rate", cfg.format_reward)):
        if column and result.rows and column in result.rows[0]:
            out[name] = statistics.fmean(r[column] for r in result.rows)
    return out


# transformers samples from torch's process-wide generator, and loading a model may draw from it too (weights its
# checkpoint lacks): two threads loading and sampling at once (the search's parallel trials, each scored on an
# Optuna thread) would interleave their draws, and neither would get the seeded ones. Re-entrant: `sampled_means`
# holds it over the load and `sample` over the draws.
_SEEDED_DRAWS = threading.RLock()


def sample(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[dict], cfg: EvalConfig
) -> tuple[list[list[str]], list[list[int]]]:
    """k sampled completions per prompt (transformers) and their lengths in tokens, seeded so every model draws
    alike. Each prompt's k rows are laid out as `num_return_sequences` lays them out, so the draws are the same, and
    its prompt is prefilled once for them (`grpo_pipeline.trainer.generation.prefill_once`), not k times."""
    import torch

    from grpo_pipeline.trainer.generation import prefill_once

    def plain(reason: str) -> None:  # the prompts are prefilled per row then; the same samples either way
        log.info("sampling prefills every row: %s", reason)

    with _SEEDED_DRAWS:  # the seed's draws, not another thread's
        torch.manual_seed(cfg.seed)
        tokenizer.padding_side = "left"  # decoder-only models continue from the right edge
        samples: list[list[str]] = []
        lengths: list[list[int]] = []
        k = cfg.samples_k
        for start in range(0, len(rows), cfg.batch_size):
            texts = render(tokenizer, [r["prompt"] for r in rows[start : start + cfg.batch_size]])
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            repeated = {name: batch[name].repeat_interleave(k, dim=0) for name in ("input_ids", "attention_mask")}
            with torch.inference_mode(), prefill_once(model, plain):
                out = model.generate(
                    **repeated,
                    max_new_tokens=cfg.max_new_tokens,
                    do_sample=True,
                    temperature=cfg.temperature,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new_tokens = out[:, batch["input_ids"].shape[1] :]
            completions = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            counts = (new_tokens != tokenizer.pad_token_id).sum(dim=1).tolist()
            samples += [completions[i * k : (i + 1) * k] for i in range(len(texts))]
            lengths += [counts[i * k : (i + 1) * k] for i in range(len(texts))]
    return samples, lengths


def pass_at_k(rows: list[dict], samples: list[list[str]], reward_name: str, args: dict | None = None) -> list[float]:
    """1.0 per prompt when any of its k samples is right (n = k samples, so the estimate is exact for k).

    >>> pass_at_k([{"answer": "4"}, {"answer": "5"}], [["3", "4"], ["6", "7"]], "correct_answer")
    [1.0, 0.0]
    """
    reward = resolve_reward(reward_name, args)  # an answer check: it takes no lengths
    out = []
    for row, completions in zip(rows, samples, strict=True):
        columns = {k: [row[k]] * len(completions) for k in row if k != "prompt"}
        out.append(float(any(reward(completions, **columns))))
    return out


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM accepts as max_lora_rank


def vllm_usable() -> bool:
    """vLLM generates on CUDA GPUs; the [gpu] extra installs it."""
    import torch

    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def generate_vllm(
    model_path: str, model_cfg: ModelConfig, adapter: str | None, texts: list[str], cfg: EvalConfig
) -> tuple[list[str], list[int], list[list[str]]]:
    """Greedy completions and their token lengths, plus k samples per prompt when `cfg.samples_k` is set."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    rank = json.loads((Path(adapter) / "adapter_config.json").read_text())["r"] if adapter else 0
    llm = LLM(
        model=model_path,
        dtype=model_cfg.compute_dtype,
        seed=cfg.seed,
        quantization="bitsandbytes" if model_cfg.quantization != "none" else None,
        trust_remote_code=model_cfg.trust_remote_code,
        enable_lora=adapter is not None,
        max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= rank),
    )
    lora = LoRARequest("candidate", 1, adapter) if adapter else None
    from grpo_pipeline.trainer.callbacks import interactive

    bars = interactive()  # vLLM's tqdm, only where a person sees it
    greedy = llm.generate(
        texts, SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens), lora_request=lora, use_tqdm=bars
    )
    samples: list[list[str]] = []
    if cfg.samples_k:
        params = SamplingParams(
            n=cfg.samples_k, temperature=cfg.temperature, seed=cfg.seed, max_tokens=cfg.max_new_tokens
        )
        samples = [[c.text for c in o.outputs] for o in llm.generate(texts, params, lora_request=lora, use_tqdm=bars)]
    return [o.outputs[0].text for o in greedy], [len(o.outputs[0].token_ids) for o in greedy], samples


def evaluate_model(
    model_path: str,
    model_cfg: ModelConfig,
    holdout: Path,
    rewards: RewardSet,
    cfg: EvalConfig,
    adapter: str | None = None,
    label: str | None = None,
) -> EvalResult:
    """Load a base model (plus an adapter when given) and score it on a holdout file.

    `rewards`: the training's (`TrainConfig.reward_set`), so each total is the weighted one GRPO optimised.
    `label`: the model, as progress names it ("evaluating champion v3"); else candidate or base."""
    rows = read_jsonl(holdout)
    label = label or ("candidate" if adapter else "base")
    from grpo_pipeline.trainer.callbacks import hide_library_bars, interactive

    if not interactive():  # a log, not a person: no model-loading bars
        hide_library_bars()
    use_vllm = cfg.engine == "vllm" or (cfg.engine == "auto" and vllm_usable())
    if use_vllm:
        if not vllm_usable():
            raise RuntimeError("evaluate.engine=vllm needs vLLM (pip install '.[gpu]') and a CUDA GPU; use 'auto'")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=model_cfg.trust_remote_code)
        completions, lengths, samples = generate_vllm(
            model_path, model_cfg, adapter, render(tokenizer, [r["prompt"] for r in rows]), cfg
        )
    else:
        model, tokenizer = load_model(model_path, model_load(model_cfg), adapter=adapter)
        model.eval()
        with _merged(model):  # an unmerged adapter doubled the holdout's time on a CPU (1.8 vs 3.5 prompts/s)
            completions, lengths = generate(
                model,
                tokenizer,
                [r["prompt"] for r in rows],
                cfg.max_new_tokens,
                cfg.batch_size,
                label=label,
            )
    result = score(
        rows,
        [completion_text(c) for c in completions],
        rewards,
        lengths,
        extra=[r for r in (cfg.accuracy_reward, cfg.format_reward) if r],
        max_completion_length=cfg.max_new_tokens,
    )
    metrics = result.metrics | summary_metrics(result, cfg)
    if cfg.samples_k and cfg.accuracy_reward:
        if not use_vllm:
            samples, _ = sample(model, tokenizer, rows, cfg)
        passed = pass_at_k(rows, samples, cfg.accuracy_reward, rewards.args_for(cfg.accuracy_reward))
        for row, value in zip(result.rows, passed, strict=True):
            row[f"pass_at_{cfg.samples_k}"] = value
        metrics[f"pass_at_{cfg.samples_k}"] = statistics.fmean(passed)
    return result.model_copy(
        update={"metrics": metrics, "examples": pick_examples(result, cfg.accuracy_reward, cfg.examples)}
    )


def _merged(model: Any) -> AbstractContextManager[None]:
    """A plain LoRA adapter computes from its merged weights inside (`merge_blocker`): the same policy, fewer
    matmuls; any other model as it is."""
    from grpo_pipeline.trainer.generation import merge_blocker, merged_adapter

    return merged_adapter(model) if merge_blocker(model) is None else nullcontext()


def sampled_means(
    model_path: str,
    model_cfg: ModelConfig,
    prompts: Path,
    rewards: RewardSet,
    cfg: EvalConfig,
    adapter: str | None = None,
    enough: Callable[[list[float]], bool] | None = None,
    chunk: int | None = None,
) -> list[float]:
    """Per prompt of a JSONL file, the mean skill score (`RewardSet.skill`) of `cfg.samples_k` completions
    sampled at `cfg.temperature` (seeded: every adapter draws alike), from the base plus `adapter`: an estimate
    of what the policy scores on that prompt, which moves as soon as the policy does (a greedy answer changes
    only once the right reply becomes the likeliest).

    With `enough`, the prompts are sampled `chunk` at a time (the i-th chunk seeded `cfg.seed + i`, so every
    adapter draws alike whatever the chunking stops at) and the scoring stops after the first chunk whose
    running list of means `enough` accepts: the list returned is then a prefix of the file's prompts. A plain
    LoRA adapter samples from its merged weights (`merge_blocker`): the same policy, fewer matmuls."""
    rows = read_jsonl(prompts)
    k = cfg.samples_k
    size = (chunk or cfg.batch_size) if enough else max(len(rows), 1)
    means: list[float] = []
    with _SEEDED_DRAWS:
        model, tokenizer = load_model(model_path, model_load(model_cfg), adapter=adapter)
        model.eval()
        with _merged(model):
            for i, start in enumerate(range(0, len(rows), size)):
                part = rows[start : start + size]
                seed = cfg.seed + i if enough else cfg.seed
                samples, lengths = sample(model, tokenizer, part, cfg.model_copy(update={"seed": seed}))
                result = score(
                    [row for row in part for _ in range(k)],
                    [completion_text(c) for group in samples for c in group],
                    rewards,
                    [n for group in lengths for n in group],
                    max_completion_length=cfg.max_new_tokens,
                )
                skill = [float(r[rewards.skill]) for r in result.rows]
                means += [statistics.fmean(skill[j * k : (j + 1) * k]) for j in range(len(part))]
                if enough and enough(means):
                    break
    return means


evaluate_task = task(name="evaluate")(evaluate_model)
