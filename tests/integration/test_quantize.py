"""Quantization cost and base model selection on tiny random Llamas (real bitsandbytes NF4 on the CPU)."""

from __future__ import annotations

import pytest

from grpo_pipeline.configs.schema import QuantizationBound, load_config
from grpo_pipeline.tasks.quantize import QuantizationRefused, judge, measure_quantization_cost, require_accepted
from grpo_pipeline.tasks.select import SelectionError, select_base_model

pytestmark = pytest.mark.integration

FAST_EVAL = ["evaluate.max_new_tokens=4", "evaluate.engine=transformers"]


@pytest.fixture(scope="module")
def nf4_cost(tiny_model, tiny_splits):
    """One measurement (both loads) shared by the tests below; the tight bound leaves nothing tolerated."""
    cfg = load_config(None, ["model.quantization=nf4", *FAST_EVAL])
    tight = QuantizationBound(max_reward_drop=0.0, max_perplexity_ratio=1.0, rows=4)
    return measure_quantization_cost(
        str(tiny_model), cfg.model, tiny_splits["val"], cfg.train.reward_set(), cfg.evaluate, tight
    )


def test_nf4_footprint_is_below_fp32_and_the_cost_is_measured(nf4_cost):
    assert nf4_cost.quantized.footprint_bytes < nf4_cost.unquantized.footprint_bytes
    assert nf4_cost.footprint_ratio < 0.5  # 4-bit linears; embeddings and norms stay fp32
    assert nf4_cost.n_rows == 4
    assert nf4_cost.unquantized.perplexity > 1 and nf4_cost.quantized.perplexity > 1
    assert nf4_cost.perplexity_ratio != 1.0  # the 4-bit weights changed the model's beliefs
    metrics = nf4_cost.metrics()
    assert metrics["quant/reward_drop"] == nf4_cost.reward_drop and "quant/perplexity_ratio" in metrics


def test_a_tight_bound_refuses_the_mode_with_the_figures(nf4_cost):
    # NF4 rounding moves the tiny model's perplexity away from the fp32 one; a bound of 1.0 tolerates nothing
    assert nf4_cost.perplexity_ratio > 1.0
    assert not nf4_cost.accepted and any("perplexity grows" in r for r in nf4_cost.reasons)
    with pytest.raises(QuantizationRefused, match="model.quantization=nf4 refused on 4 val rows: perplexity grows"):
        require_accepted(nf4_cost)
    # without a configured bound the same figures are reported and nothing is refused
    unbounded = judge(nf4_cost.unquantized, nf4_cost.quantized, "nf4", None, n_rows=4)
    assert unbounded.accepted and unbounded.perplexity_ratio == nf4_cost.perplexity_ratio
    require_accepted(unbounded)


def test_nothing_to_measure_without_quantization(tiny_model, tiny_splits, tiny_config):
    cfg = tiny_config()
    assert (
        measure_quantization_cost(str(tiny_model), cfg.model, tiny_splits["val"], cfg.train.reward_set(), cfg.evaluate)
        is None
    )


def test_selection_scores_candidates_that_fit_and_picks_the_best(tiny_model, tiny_splits, tiny_config, tmp_path):
    from tests.tiny_model import create_random_model

    bigger = create_random_model(tmp_path / "bigger", hidden_size=128, seed=1)
    cfg = tiny_config(f"model.candidates=[{tiny_model}, {bigger}]", *FAST_EVAL)
    selection = select_base_model(
        cfg.model, cfg.train, cfg.plan, cfg.evaluate, cfg.train.reward_set(), tiny_splits["val"], tmp_path / "cache"
    )
    assert [r.base for r in selection.rows] == [str(tiny_model), str(bigger)]
    assert all(r.fits and r.within_budget and r.reward is not None and r.cost_usd == 0 for r in selection.rows)
    best = max(selection.rows, key=lambda r: (r.reward, -r.params_b))
    assert selection.chosen == best.base and selection.chosen_path == best.path
    assert selection.table()["chosen"].count(True) == 1


def test_selection_refuses_when_no_candidate_is_within_budget(tiny_model, tiny_splits, tiny_config, tmp_path):
    cfg = tiny_config(
        f"model.candidates=[{tiny_model}]",
        "train.launcher=sky",
        "train.grpo.max_steps=100",
        "train.sky.accelerators=[H100:1]",
        "plan.budget_usd=0.001",
    )
    with pytest.raises(SelectionError, match=r"estimated \$.* > plan.budget_usd \$0.00"):
        select_base_model(
            cfg.model, cfg.train, cfg.plan, cfg.evaluate, cfg.train.reward_set(), tiny_splits["val"], tmp_path / "cache"
        )
