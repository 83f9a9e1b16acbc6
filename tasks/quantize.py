"""What quantizing the base costs: reward and perplexity on a validation slice, quantized against unquantized.

Both sides load the same model at the same compute dtype, see the same rows and decode greedily with
the same settings (`grpo_pipeline.tasks.evaluate.generate` and `score`), so the difference is the quantization's alone.
Perplexity is that of the reference answers (the `answer` column) after the chat-rendered prompt: how
much less the quantized model believes the right answer. A mode past `model.max_quantization_cost` is
refused with the measured figures.

    >>> judge(Measurement(reward=1.0, per_reward={}, perplexity=2.0, footprint_bytes=100, seconds=1),
    ...       Measurement(reward=0.9, per_reward={}, perplexity=2.4, footprint_bytes=30, seconds=1),
    ...       "nf4", QuantizationBound(max_reward_drop=0.05, max_perplexity_ratio=1.1), n_rows=8).reasons
    ['reward drops by 0.100 (1.000 -> 0.900), more than max_reward_drop=0.05', 'perplexity grows 1.20x (2.00 -> 2.40), more than max_perplexity_ratio=1.1']
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import task
from pydantic import BaseModel

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ConfigError, EvalConfig, ModelConfig, QuantizationBound
from grpo_pipeline.tasks.evaluate import generate, read_jsonl, render, score
from grpo_pipeline.tasks.job import model_load
from grpo_pipeline.trainer.loading import load_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
from grpo_pipeline.trainer.rewards import completion_text


class QuantizationRefused(ConfigError):
    """The configured quantization costs more quality than `model.max_quantization_cost` allows."""


class Measurement(BaseModel):
    reward: float  # mean weighted total (`RewardSet.total`), greedy: what training and promotion rank by
    per_reward: dict[str, float]
    perplexity: float  # of the reference answers
    footprint_bytes: int  # model.get_memory_footprint(): parameters and buffers as loaded
    seconds: float


class QuantizationCost(BaseModel):
    mode: str
    double_quant: bool
    compute_dtype: str
    n_rows: int
    unquantized: Measurement
    quantized: Measurement
    reward_drop: float
    perplexity_ratio: float
    footprint_ratio: float
    accepted: bool
    reasons: list[str]

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow."""
        return {
            "quant/reward_unquantized": self.unquantized.reward,
            "quant/reward_quantized": self.quantized.reward,
            "quant/reward_drop": self.reward_drop,
            "quant/perplexity_unquantized": self.unquantized.perplexity,
            "quant/perplexity_quantized": self.quantized.perplexity,
            "quant/perplexity_ratio": self.perplexity_ratio,
            "quant/footprint_mb_unquantized": self.unquantized.footprint_bytes / 1e6,
            "quant/footprint_mb_quantized": self.quantized.footprint_bytes / 1e6,
            "quant/accepted": float(self.accepted),
        }


def judge(
    full: Measurement,
    quant: Measurement,
    mode: str,
    bound: QuantizationBound | None,
    *,
    n_rows: int,
    double_quant: bool = False,
    compute_dtype: str = "float32",
) -> QuantizationCost:
    """Compare the two measurements against the bound (pure); no bound accepts whatever was measured."""
    drop = full.reward - quant.reward
    ratio = quant.perplexity / full.perplexity if full.perplexity > 0 else math.inf
    reasons = []
    if bound is None:
        pass
    elif drop > bound.max_reward_drop:
        reasons.append(
            f"reward drops by {drop:.3f} ({full.reward:.3f} -> {quant.reward:.3f}), "
            f"more than max_reward_drop={bound.max_reward_drop:g}"
        )
    if bound is not None and ratio > bound.max_perplexity_ratio:
        reasons.append(
            f"perplexity grows {ratio:.2f}x ({full.perplexity:.2f} -> {quant.perplexity:.2f}), "
            f"more than max_perplexity_ratio={bound.max_perplexity_ratio:g}"
        )
    return QuantizationCost(
        mode=mode,
        double_quant=double_quant,
        compute_dtype=compute_dtype,
        n_rows=n_rows,
        unquantized=full,
        quantized=quant,
        reward_drop=drop,
        perplexity_ratio=ratio,
        footprint_ratio=quant.footprint_bytes / full.footprint_bytes,
        accepted=not reasons,
        reasons=reasons,
    )


def answer_perplexity(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[dict], batch_size: int = 16
) -> float:
    """exp(mean negative log-likelihood) of each row's `answer` as the assistant's reply to its prompt."""
    import torch

    prompts = render(tokenizer, [r["prompt"] for r in rows])
    fulls = [
        tokenizer.apply_chat_template(
            [*r["prompt"], {"role": "assistant", "content": str(r["answer"])}], tokenize=False
        )
        for r in rows
    ]
    total_nll, total_tokens = 0.0, 0
    tokenizer.padding_side = "right"
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            batch = tokenizer(
                fulls[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            )
            labels = batch["input_ids"].clone()
            labels[batch["attention_mask"] == 0] = -100
            for i, prompt in enumerate(prompts[start : start + batch_size]):
                # score only the answer: the prompt's tokens (and the template around it) are given
                labels[i, : len(tokenizer(prompt, add_special_tokens=False)["input_ids"])] = -100
            batch = {k: v.to(model.device) for k, v in batch.items()}
            logits = model(**batch).logits[:, :-1].float()
            target = labels[:, 1:].to(model.device)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="sum")
            total_nll += nll.item()
            total_tokens += int((target != -100).sum())
    if not total_tokens:
        raise ValueError("no answer tokens to score: the val rows need an 'answer' column")
    return math.exp(total_nll / total_tokens)


def measure(
    model_path: str, model_cfg: ModelConfig, rows: list[dict], rewards: RewardSet, eval_cfg: EvalConfig
) -> Measurement:
    """Load the model at `model_cfg`'s quantization once; footprint, answer perplexity and greedy reward."""
    started = time.monotonic()
    model, tokenizer = load_model(model_path, model_load(model_cfg))
    model.eval()
    footprint = model.get_memory_footprint()
    ppl = answer_perplexity(model, tokenizer, rows, eval_cfg.batch_size)
    completions, lengths = generate(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        eval_cfg.max_new_tokens,
        eval_cfg.batch_size,
        label=model_cfg.quantization,
    )
    result = score(rows, [completion_text(c) for c in completions], rewards, lengths)
    del model
    return Measurement(
        reward=result.reward,
        per_reward=result.per_reward,
        perplexity=ppl,
        footprint_bytes=footprint,
        seconds=time.monotonic() - started,
    )


def measure_quantization_cost(
    model_path: str,
    model_cfg: ModelConfig,
    val_file: Path,
    rewards: RewardSet,
    eval_cfg: EvalConfig,
    bound: QuantizationBound | None = None,
) -> QuantizationCost | None:
    """Quantized (`model_cfg.quantization`) against unquantized on the first `bound.rows` val rows.

    The bound is `bound`, else `model.max_quantization_cost`; with neither the cost is measured (on
    QuantizationBound().rows rows) and reported but nothing is refused. None when the base is not
    quantized (nothing to measure). Never raises for a refused mode: the result says so (`accepted`,
    `reasons`), so it can be logged first; `require_accepted` then refuses.
    """
    if model_cfg.quantization == "none":
        return None
    bound = bound or model_cfg.max_quantization_cost
    rows = read_jsonl(val_file)[: (bound or QuantizationBound()).rows]
    if not rows:
        raise ValueError(f"{val_file} has no rows to measure quantization on; raise data.demo.n_val")
    full = measure(model_path, model_cfg.model_copy(update={"quantization": "none"}), rows, rewards, eval_cfg)
    quant = measure(model_path, model_cfg, rows, rewards, eval_cfg)
    return judge(
        full,
        quant,
        model_cfg.quantization,
        bound,
        n_rows=len(rows),
        double_quant=model_cfg.double_quant,
        compute_dtype=model_cfg.compute_dtype,
    )


def require_accepted(cost: QuantizationCost | None) -> None:
    """Refuse a quantization mode whose measured cost passes the bound, with the figures.

    >>> require_accepted(None)
    """
    if cost is not None and not cost.accepted:
        raise QuantizationRefused(
            f"model.quantization={cost.mode} refused on {cost.n_rows} val rows: "
            + "; ".join(cost.reasons)
            + ". Use a milder mode (int8, or none), loosen model.max_quantization_cost, or choose another base"
        )


quantization_cost_task = task(name="quantization-cost")(measure_quantization_cost)
