"""Evaluation: greedy, batched generation on a holdout, scored by every reward, per sample.

The base model and the trained candidate see the same prompts with the same decoding, so their
per-sample scores can be compared pairwise.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from prefect import task
from pydantic import BaseModel

from trainer.loading import load_model
from trainer.rewards import completion_text, resolve_reward
from grpo_pipeline.config import ModelConfig


class EvalResult(BaseModel):
    reward: float  # mean over samples of the summed rewards, as GRPO sees them
    per_reward: dict[str, float]
    n: int
    rows: list[dict]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def score(rows: list[dict], completions: list[str], rewards: list[str], lengths: list[int]) -> EvalResult:
    """Score completions with each reward and keep their token lengths; pure, so it is tested without a model.

    >>> r = score([{"answer": "3"}, {"answer": "5"}], ["3", "five"], ["correct_answer"], [1, 1])
    >>> r.reward, r.per_reward
    (0.5, {'correct_answer': 0.5})
    """
    columns = {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"} if rows else {}
    per_sample = {name: resolve_reward(name)(completions, **columns) for name in rewards}
    out_rows = []
    for i, row in enumerate(rows):
        scores = {name: per_sample[name][i] for name in rewards}
        out_rows.append({
            "key": row.get("key", i),
            "completion": completions[i],
            **scores,
            "total": sum(scores.values()),
            "length": lengths[i],
        })
    return EvalResult(
        reward=statistics.fmean(r["total"] for r in out_rows) if out_rows else 0.0,
        per_reward={name: statistics.fmean(per_sample[name]) for name in rewards} if out_rows else {},
        n=len(out_rows),
        rows=out_rows,
    )


def generate(
    model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int, label: str = ""
) -> tuple[list[str], list[int]]:
    """Greedy completions for chat prompts and their lengths in tokens, in batches, with a progress bar."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    tokenizer.padding_side = "left"  # decoder-only models continue from the right edge
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    out: list[str] = []
    lengths: list[int] = []
    with Progress(console=Console(stderr=True), transient=True) as progress, torch.inference_mode():
        bar = progress.add_task(f"evaluating {label}".strip(), total=len(texts))
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            generated = model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            new_tokens = generated[:, batch["input_ids"].shape[1] :]
            out += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            lengths += (new_tokens != tokenizer.pad_token_id).sum(dim=1).tolist()
            progress.advance(bar, len(batch["input_ids"]))
    return out, lengths


def evaluate_model(
    model_path: str,
    model_cfg: ModelConfig,
    holdout: Path,
    rewards: list[str],
    *,
    adapter: str | None = None,
    max_new_tokens: int = 16,
    batch_size: int = 32,
) -> EvalResult:
    """Load a base model (plus an adapter when given) and score it on a holdout file."""
    rows = read_jsonl(holdout)
    model, tokenizer = load_model(model_path, model_cfg, adapter=adapter)
    model.eval()
    completions, lengths = generate(
        model, tokenizer, [r["prompt"] for r in rows], max_new_tokens, batch_size, label="candidate" if adapter else "base"
    )
    return score(rows, [completion_text(c) for c in completions], rewards, lengths)


evaluate_task = task(evaluate_model, name="evaluate")
