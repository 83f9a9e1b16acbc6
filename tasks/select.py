"""Base model selection: each candidate in `model.candidates` is priced by the planner and, when it fits the
memory and the budget, scored zero-shot on the validation split by the training's weighted total
(`RewardSet.total`, what training optimises and promotion compares); the best score wins.

Pricing comes first because it is free (no model load): a candidate that cannot fit or is over budget is
listed with the reason and never loaded. With no candidates (or one) there is nothing to choose, so the
base is priced but not scored.

    >>> rows = [CandidateRow(base="a", reward=0.4, cost_usd=3.0, fits=True, within_budget=True),
    ...         CandidateRow(base="b", reward=0.7, cost_usd=9.0, fits=True, within_budget=True),
    ...         CandidateRow(base="c", reward=0.9, cost_usd=90.0, fits=True, within_budget=False)]
    >>> choose(rows).base
    'b'
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from pydantic import BaseModel

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import ConfigError, EvalConfig, ModelConfig, PlanConfig, TrainConfig
from grpo_pipeline.tasks.evaluate import evaluate_model
from grpo_pipeline.tasks.model import ModelNotFound, resolve_base_model
from grpo_pipeline.tasks.plan import GIB, PlanError, plan_run


class SelectionError(ConfigError):
    """No candidate base fits the memory and the budget."""


class CandidateRow(BaseModel):
    base: str
    path: str | None = None
    params_b: float | None = None
    reward: float | None = None  # mean weighted total on val, greedy; None when not scored
    per_reward: dict[str, float] = {}
    metrics: dict[str, float] = {}
    memory_gib: float | None = None
    gpu: str | None = None
    gpus_total: int | None = None  # every GPU the plan rents, all nodes and a vLLM server's included (its price)
    cost_usd: float | None = None
    fits: bool = False
    within_budget: bool = False
    note: str = ""


class Selection(BaseModel):
    chosen: str
    chosen_path: str
    rows: list[CandidateRow]

    def table(self) -> dict[str, list]:
        """Columns for `mlflow.log_table`."""
        keys = (
            "base",
            "params_b",
            "reward",
            "memory_gib",
            "gpu",
            "gpus_total",
            "cost_usd",
            "fits",
            "within_budget",
            "note",
        )
        return {k: [getattr(r, k) for r in self.rows] for k in keys} | {
            "chosen": [r.base == self.chosen for r in self.rows]
        }


def choose(rows: list[CandidateRow]) -> CandidateRow:
    """The best val reward among candidates that fit and are within budget; ties go to the cheaper, then smaller.
    An unscored candidate (the only one) is eligible as it is."""
    eligible = [r for r in rows if r.fits and r.within_budget]
    if not eligible:
        reasons = "; ".join(f"{r.base}: {r.note or 'does not fit'}" for r in rows)
        raise SelectionError(
            f"no candidate base fits the memory and budget ({reasons}); add smaller candidates, "
            "quantize (model.quantization=nf4), allow larger GPUs or raise plan.budget_usd"
        )
    return max(
        eligible,
        key=lambda r: (r.reward if r.reward is not None else float("-inf"), -(r.cost_usd or 0.0), -(r.params_b or 0.0)),
    )


def price(
    model: ModelConfig, train: TrainConfig, planning: PlanConfig, path: str, train_rows: int | None = None
) -> CandidateRow:
    """The planner's verdict for one candidate (`model.base`, resolved at `path`): memory, GPU, cost, fits,
    within budget."""
    base = model.base
    try:
        plan = plan_run(model, train, planning, path, train_rows)
    except PlanError as exc:
        return CandidateRow(base=base, path=path, note=str(exc))
    budget = planning.budget_usd
    within = budget is None or plan.estimate.usd <= budget
    fits = all(o.fits for o in plan.options if o.gpu == plan.settings.gpu)
    note = "" if within else f"estimated ${plan.estimate.usd:,.2f} > plan.budget_usd ${budget:,.2f}"
    if not fits:
        note = plan.notes[-1]
    return CandidateRow(
        base=base,
        path=path,
        params_b=plan.params / 1e9,
        memory_gib=plan.memory.total / GIB,
        gpu=plan.settings.gpu,
        gpus_total=plan.settings.gpus,
        cost_usd=plan.estimate.usd,
        fits=fits,
        within_budget=within,
        note=note,
    )


def select_base_model(
    model: ModelConfig,
    train: TrainConfig,
    planning: PlanConfig,
    evaluation: EvalConfig,
    rewards: RewardSet,
    val_file: Path,
    cache_dir: Path,
    train_rows: int | None = None,
) -> Selection:
    """Price every candidate of `model.candidates` (for training as `train` sets it, within `planning`'s budget),
    score those that fit on the val split by `rewards`' weighted total (`grpo_pipeline.tasks.evaluate.evaluate_model`
    with `evaluation`'s settings), choose."""
    candidates = list(dict.fromkeys(model.candidates or [model.base]))
    rows = []
    for base in candidates:
        one = model.model_copy(update={"base": base})
        try:
            path = resolve_base_model(one, cache_dir)
        except ModelNotFound as exc:
            rows.append(CandidateRow(base=base, note=str(exc)))
            continue
        row = price(one, train, planning, path, train_rows)
        if row.fits and row.within_budget and len(candidates) > 1:
            result = evaluate_model(path, one, val_file, rewards, evaluation, label=f"base {base}")
            row = row.model_copy(
                update={"reward": result.reward, "per_reward": result.per_reward, "metrics": result.metrics}
            )
        rows.append(row)
    best = choose(rows)
    return Selection(chosen=best.base, chosen_path=best.path or "", rows=rows)


select_task = task(name="select-base-model")(select_base_model)
