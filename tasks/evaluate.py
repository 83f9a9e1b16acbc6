"""Evaluation: greedy, batched generation on a holdout, scored by every reward, per sample; plus pass@k
from k sampled completions when `evaluate.samples_k` is set.

The base model, the champion and the candidate see the same prompts with the same decoding and seed, so
their per-sample scores can be compared pairwise.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from prefect import task
from pydantic import BaseModel

from trainer.loading import load_model
from tasks.job import model_load
from trainer.rewards import completion_text, resolve_reward
from configs.schema import EvalConfig, ModelConfig


class EvalResult(BaseModel):
    reward: float  # mean over samples of the summed rewards, as GRPO sees them
    per_reward: dict[str, float]
    metrics: dict[str, float] = {}  # accuracy, format_rate, mean_length, pass@k
    n: int
    rows: list[dict]


def read_jsonl(path: Path) -> list[dict]:
    """One dict per line. Only a newline ends a line (`splitlines` would also split at U+2028, which
    GSM8K has inside questions)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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


def render(tokenizer, prompts: list) -> list[str]:
    """Chat prompts as the model's own template writes them, ready for generation."""
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]


def generate(
    model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int, label: str = ""
) -> tuple[list[str], list[int]]:
    """Greedy completions for chat prompts and their lengths in tokens, in batches, with a progress bar."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    tokenizer.padding_side = "left"  # decoder-only models continue from the right edge
    texts = render(tokenizer, prompts)
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


def sample(model, tokenizer, rows: list[dict], cfg: EvalConfig) -> list[list[str]]:
    """k sampled completions per prompt (transformers), seeded so every model draws alike."""
    import torch

    torch.manual_seed(cfg.seed)
    samples: list[list[str]] = []
    k = cfg.samples_k
    for start in range(0, len(rows), cfg.batch_size):
        texts = render(tokenizer, [r["prompt"] for r in rows[start : start + cfg.batch_size]])
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=cfg.max_new_tokens, do_sample=True,
                                 temperature=cfg.temperature, num_return_sequences=k,
                                 pad_token_id=tokenizer.pad_token_id)
        completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        samples += [completions[i * k : (i + 1) * k] for i in range(len(texts))]
    return samples


def pass_at_k(rows: list[dict], samples: list[list[str]], reward_name: str) -> list[float]:
    """1.0 per prompt when any of its k samples is right (n = k samples, so the estimate is exact for k).

    >>> pass_at_k([{"answer": "4"}, {"answer": "5"}], [["3", "4"], ["6", "7"]], "correct_answer")
    [1.0, 0.0]
    """
    reward = resolve_reward(reward_name)
    out = []
    for row, completions in zip(rows, samples, strict=True):
        columns = {k: [row[k]] * len(completions) for k in row if k != "prompt"}
        out.append(float(any(reward(completions, **columns))))
    return out


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM accepts as max_lora_rank


def vllm_usable() -> bool:
    """vLLM generates on CUDA GPUs; the [gpu] extra installs it."""
    import importlib.util

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
    greedy = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens), lora_request=lora)
    samples: list[list[str]] = []
    if cfg.samples_k:
        params = SamplingParams(n=cfg.samples_k, temperature=cfg.temperature, seed=cfg.seed,
                                max_tokens=cfg.max_new_tokens)
        samples = [[c.text for c in o.outputs] for o in llm.generate(texts, params, lora_request=lora)]
    return [o.outputs[0].text for o in greedy], [len(o.outputs[0].token_ids) for o in greedy], samples


def evaluate_model(
    model_path: str,
    model_cfg: ModelConfig,
    holdout: Path,
    rewards: list[str],
    cfg: EvalConfig,
    adapter: str | None = None,
) -> EvalResult:
    """Load a base model (plus an adapter when given) and score it on a holdout file."""
    rows = read_jsonl(holdout)
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
        completions, lengths = generate(
            model, tokenizer, [r["prompt"] for r in rows], cfg.max_new_tokens, cfg.batch_size,
            label="candidate" if adapter else "base",
        )
    result = score(rows, [completion_text(c) for c in completions], rewards, lengths)
    metrics = summary_metrics(result, cfg)
    if cfg.samples_k and cfg.accuracy_reward:
        if not use_vllm:
            samples = sample(model, tokenizer, rows, cfg)
        passed = pass_at_k(rows, samples, cfg.accuracy_reward)
        for row, value in zip(result.rows, passed, strict=True):
            row[f"pass_at_{cfg.samples_k}"] = value
        metrics[f"pass_at_{cfg.samples_k}"] = statistics.fmean(passed)
    return result.model_copy(update={"metrics": metrics})


evaluate_task = task(evaluate_model, name="evaluate")
