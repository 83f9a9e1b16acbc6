"""The search's sampled trial score (`hpo.trial_score: sampled`) on a tiny random model: one mean per prompt over
its own k samples, drawn alike on every call."""

import pytest

from grpo_pipeline.configs.rewards import RewardSet
from grpo_pipeline.configs.schema import EvalConfig, ModelConfig
from grpo_pipeline.tasks.evaluate import read_jsonl, sampled_means

ROW_ONLY = RewardSet(names=("tests.integration.sampled_rewards:answer_tenth",))
DRAW_ONLY = RewardSet(names=("tests.integration.sampled_rewards:odd_characters",))


@pytest.fixture(scope="module")
def evaluate():
    # a batch that splits the 8 prompts unevenly: samples must stay with their prompt across batches
    return EvalConfig(samples_k=3, temperature=1.0, max_new_tokens=6, batch_size=3, seed=5)


def test_each_prompts_mean_is_over_its_own_samples(tiny_model, tiny_splits, evaluate):
    rows = read_jsonl(tiny_splits["holdout"])
    assert len({r["answer"] for r in rows}) > 1  # else a misplaced sample could not show
    means = sampled_means(str(tiny_model), ModelConfig(), tiny_splits["holdout"], ROW_ONLY, evaluate)
    assert means == pytest.approx([int(r["answer"]) / 10 for r in rows])


def test_the_draws_are_seeded_and_averaged_over_k(tiny_model, tiny_splits, evaluate):
    first = sampled_means(str(tiny_model), ModelConfig(), tiny_splits["holdout"], DRAW_ONLY, evaluate)
    again = sampled_means(str(tiny_model), ModelConfig(), tiny_splits["holdout"], DRAW_ONLY, evaluate)
    assert first == again  # every adapter scored on the same draws: paired differences are the policies'
    assert all(round(m * 3, 9) in (0, 1, 2, 3) for m in first)  # a mean of three 0/1 scores
    other = evaluate.model_copy(update={"seed": 6})
    draws = [sampled_means(str(tiny_model), ModelConfig(), tiny_splits["holdout"], DRAW_ONLY, other)]
    draws.append(sampled_means(str(tiny_model), ModelConfig(), tiny_splits["holdout"], DRAW_ONLY, evaluate))
    assert draws[0] != first and draws[1] == first  # the seed, not the call, decides the draws


def test_a_scoring_stops_after_the_first_chunk_its_rule_accepts(tiny_model, tiny_splits, evaluate):
    rows = read_jsonl(tiny_splits["holdout"])
    seen: list[int] = []

    def enough(means):
        seen.append(len(means))
        return len(means) >= 3

    means = sampled_means(
        str(tiny_model), ModelConfig(), tiny_splits["holdout"], ROW_ONLY, evaluate, enough=enough, chunk=2
    )
    assert seen == [2, 4]  # asked after each chunk, and no chunk sampled once it said yes
    assert means == pytest.approx([int(r["answer"]) / 10 for r in rows[:4]])  # the file's first prompts


def test_a_stopped_scoring_draws_what_the_full_one_drew_on_its_prompts(tiny_model, tiny_splits, evaluate):
    def scored(stop_at):
        return sampled_means(
            str(tiny_model),
            ModelConfig(),
            tiny_splits["holdout"],
            DRAW_ONLY,
            evaluate,
            enough=lambda means: len(means) >= stop_at,
            chunk=2,
        )

    full, short = scored(99), scored(4)
    assert len(full) == len(read_jsonl(tiny_splits["holdout"])) and short == full[:4]
    assert scored(99) == full  # seeded per chunk: where a scoring stops does not move the draws before it


def test_an_adapter_samples_from_its_merged_weights_what_it_samples_unmerged(
    tiny_model, tiny_splits, evaluate, tmp_path, monkeypatch
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import grpo_pipeline.trainer.generation as generation

    torch_model = AutoModelForCausalLM.from_pretrained(tiny_model)
    # init_lora_weights=False: B random too, so the adapter moves the policy
    adapter = get_peft_model(torch_model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")

    def scored(adapter_dir=str(tmp_path / "adapter")):
        return sampled_means(str(tiny_model), ModelConfig(), tiny_splits["holdout"], DRAW_ONLY, evaluate, adapter_dir)

    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.trainer.loading import load_model

    loaded, _ = load_model(str(tiny_model), model_load(ModelConfig()), adapter=str(tmp_path / "adapter"))
    assert generation.merge_blocker(loaded.eval()) is None  # so the first scoring samples merged
    merged = scored()
    monkeypatch.setattr(generation, "merge_blocker", lambda model: "unmerged, for the comparison")
    assert scored() == merged  # W + s·BA in float32: the same draws pick the same tokens
    assert scored(None) != merged  # and the adapter was applied at all


def test_sampling_prefills_each_prompt_once_and_draws_what_num_return_sequences_draws(
    tiny_model, tiny_splits, evaluate, monkeypatch
):
    import torch
    from transformers.cache_utils import DynamicCache

    from grpo_pipeline.tasks.chat_prompts import render
    from grpo_pipeline.tasks.evaluate import sample
    from grpo_pipeline.tasks.job import model_load
    from grpo_pipeline.trainer.loading import load_model

    rows = read_jsonl(tiny_splits["holdout"])
    model, tokenizer = load_model(str(tiny_model), model_load(ModelConfig()))
    model.eval()
    selected: list = []
    select = DynamicCache.batch_select_indices
    monkeypatch.setattr(
        DynamicCache, "batch_select_indices", lambda self, i: (selected.append(i.tolist()), select(self, i))[1]
    )
    texts, _ = sample(model, tokenizer, rows, evaluate)
    assert selected[0] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # 3 distinct prompts prefilled once, for 3 rows each
    monkeypatch.setattr(DynamicCache, "batch_select_indices", select)
    torch.manual_seed(evaluate.seed)
    want = []
    for start in range(0, len(rows), evaluate.batch_size):  # what sampling ran before: every copy prefilled
        batch = tokenizer(
            render(tokenizer, [r["prompt"] for r in rows[start : start + evaluate.batch_size]]),
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=evaluate.max_new_tokens,
                do_sample=True,
                temperature=evaluate.temperature,
                num_return_sequences=evaluate.samples_k,
                pad_token_id=tokenizer.pad_token_id,
            )
        done = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        want += [done[i : i + evaluate.samples_k] for i in range(0, len(done), evaluate.samples_k)]
    assert texts == want


def test_two_threads_sampling_at_once_each_get_the_seeded_draws(tiny_model, tiny_splits, evaluate):
    """The search scores parallel trials on Optuna's threads; transformers draws from torch's process-wide
    generator, so unguarded the two scorings would interleave their draws."""
    from concurrent.futures import ThreadPoolExecutor

    def score(_):
        return sampled_means(str(tiny_model), ModelConfig(), tiny_splits["holdout"], DRAW_ONLY, evaluate)

    alone = score(None)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(score, range(4)))
    assert together == [alone] * 4
