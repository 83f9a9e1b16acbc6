"""What the step's cuts (trainer/step.py) take from TRL's GRPOTrainer and from transformers, one test per internal:
the name exists, its signature is the one the cut calls, and it behaves as the cut assumes, on the tiny model. A
library upgrade that changes one of them fails here, under the internal's name, before a run trains wrongly.

The cuts' own equivalence tests (test_faster_step.py, test_dynamic_sampling.py, test_curriculum.py) say whether
each cut still computes what TRL computes; these say which of TRL's promises a failure there comes from.
"""

import inspect

import pytest
import torch

from grpo_pipeline.trainer.zero_advantage import PROPORTIONAL

pytestmark = pytest.mark.integration


def _params(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


@pytest.fixture(scope="module")
def grpo(tiny_model, tmp_path_factory):
    """TRL's own GRPOTrainer (no cut) with a LoRA adapter on the tiny model: 2 prompts x 2 generations a step, and
    one generation batch it made and scored in train mode (`grpo.batch`, `grpo.inputs`)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    def length_reward(completions, **_):  # varies within a group: non-zero advantages
        return [len(c) / 10 for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("contracts")),
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=6,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        beta=0.0,
        gradient_checkpointing=False,
        save_strategy="no",
    )
    data = Dataset.from_list([{"prompt": f"What is {a} + {a}?" + " Reply with a number." * (a % 2)} for a in range(8)])
    trainer = GRPOTrainer(
        model=str(tiny_model),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=data,
        peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear"),
    )
    trainer.model.train()
    trainer.inputs = [dict(data[i]) for i in (0, 0, 1, 1)]
    torch.manual_seed(0)
    trainer.batch = trainer._generate_and_score_completions(trainer.inputs)
    return trainer


def test_the_trainer_attributes_the_cuts_read(grpo):
    """Read by every cut to decide whether it applies, and to cut the batch (sampling, dynamic_sampling,
    zero_advantage, generation)."""
    from collections import defaultdict

    for name in ("num_generations", "num_iterations", "shuffle_dataset", "use_vllm", "beta", "loss_type"):
        assert hasattr(grpo, name), name
    assert isinstance(grpo.use_transformers_continuous_batching, bool)
    assert isinstance(grpo.aux_loss_enabled, bool) and isinstance(grpo._entropy_bonus_enabled, bool)
    assert isinstance(grpo.reward_weights, torch.Tensor) and grpo.reward_weights.shape == (1,)
    assert isinstance(grpo._metrics["train"], defaultdict) and grpo._metrics["train"].default_factory is list
    assert grpo.args.generation_batch_size == 4 and grpo.args.steps_per_generation >= 1
    assert grpo.accelerator.unwrap_model(grpo.model_wrapped) is grpo.model


def test_get_train_sampler_draws_what_the_curriculum_replays(grpo):
    """sampling.CurriculumCut stands in for `_get_train_sampler`, replaying RepeatSampler's index stream: TRL's
    sampler for an epoch must be what `curriculum_sampler` yields with nothing benched."""
    from grpo_pipeline.configs.sampling import CurriculumConfig
    from grpo_pipeline.trainer.sampling import Curriculum, curriculum_sampler

    assert _params(type(grpo)._get_train_sampler) == ["dataset"]
    trl_sampler = grpo._get_train_sampler()
    curriculum = Curriculum(
        n=len(grpo.train_dataset),
        batch_size=grpo.args.generation_batch_size // grpo.num_generations,
        seed=grpo.args.seed,
        settings=CurriculumConfig(),
        shuffle=grpo.shuffle_dataset,
    )
    ours = curriculum_sampler(curriculum, grpo.num_generations, grpo.num_iterations * grpo.args.steps_per_generation)
    assert list(ours) == list(trl_sampler) and len(ours) == len(trl_sampler)


def test_calculate_rewards_returns_every_row_per_reward_function(grpo):
    """The curriculum's verdicts and dynamic sampling's choice read `_calculate_rewards`'s result: one row per
    completion (every rank's, gathered), one column per reward function, weighted by `reward_weights` later."""
    from grpo_pipeline.trainer.rewards import completion_text

    assert _params(type(grpo)._calculate_rewards) == ["inputs", "prompts", "completions", "completion_ids_list"]
    completions = ["1", "22", "333", "4444"]
    rewards = grpo._calculate_rewards(
        grpo.inputs, [x["prompt"] for x in grpo.inputs], completions, [[1]] * len(completions)
    )
    assert rewards.shape == (4, 1)
    assert rewards[:, 0].tolist() == pytest.approx([len(completion_text(c)) / 10 for c in completions])


def test_generate_and_score_completions_returns_one_row_per_input(grpo):
    """dynamic_sampling.DynamicSampling extends `_generate_and_score_completions`'s input with whole groups and cuts
    every per-row tensor of its output back: rows in input order, `num_items_in_batch` the loss's normaliser."""
    assert _params(type(grpo)._generate_and_score_completions) == ["inputs"]
    batch = grpo.batch
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
        assert batch[key].size(0) == len(grpo.inputs), key
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())
    # the two rows of the first prompt share its tokens: groups are consecutive rows
    assert torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][1])
    assert not torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][2])


def test_generate_and_score_completions_scores_through_calculate_rewards(grpo, monkeypatch):
    """The rewards DynamicSampling.record keeps are those of the batch it extended: `_calculate_rewards` is called
    once per `_generate_and_score_completions`, on all of its rows."""
    seen = []
    calculate = grpo._calculate_rewards
    monkeypatch.setattr(grpo, "_calculate_rewards", lambda *a: seen.append(calculate(*a)) or seen[-1])
    grpo._generate_and_score_completions(grpo.inputs)
    assert len(seen) == 1 and seen[0].shape[0] == len(grpo.inputs)


def test_generate_single_turn_calls_the_models_generate_by_name_with_left_padded_prompts(grpo, monkeypatch):
    """generation.PrefillOnce wraps the transformers model's `generate` (under PEFT: the base model's) for the span
    of `_generate_single_turn`, and understands only keyword inputs: input_ids, attention_mask, generation_config,
    the prompts left-padded. generation.MergedGeneration swaps weights around the same span."""
    from grpo_pipeline.trainer.generation import _UNDERSTOOD, transformers_model

    assert _params(type(grpo)._generate_single_turn)[:4] == [
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
    ]
    target = transformers_model(grpo.accelerator.unwrap_model(grpo.model_wrapped))
    calls = []
    plain = target.generate

    def generate(*args, **kwargs):
        calls.append((args, kwargs))
        return plain(*args, **kwargs)

    monkeypatch.setattr(target, "generate", generate)
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    completions, _ = grpo._generate_single_turn(prompts, None, {}, grpo.num_generations)
    assert len(calls) == 1 and len(completions) == 4
    args, kwargs = calls[0]
    assert args == () and set(kwargs) <= _UNDERSTOOD
    mask = kwargs["attention_mask"]
    assert mask[2:, 0].eq(0).all() and mask[:, -1].eq(1).all()  # the shorter prompts padded on the left


def test_get_per_token_logps_and_entropies_scores_through_the_fused_head(grpo, monkeypatch):
    """shared_prompt.SharedPromptForward calls TRL's `_get_per_token_logps_and_entropies` positionally as its plain
    path, and the policy as TRL calls it: `model(input_ids, attention_mask, labels, fused_lm_head=True)` with
    `log_probs` and `entropy` in the output; it returns (log-probs, entropies, aux loss)."""
    assert _params(type(grpo)._get_per_token_logps_and_entropies)[:6] == [
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
    ]
    batch = grpo.batch
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].size(1)
    seen = []
    forward = grpo.model.forward
    monkeypatch.setattr(grpo.model, "forward", lambda *a, **k: (seen.append(k), forward(*a, **k))[1])
    with torch.no_grad():
        logps, entropies, aux = grpo._get_per_token_logps_and_entropies(grpo.model, ids, mask, width, None, True)
    assert logps.shape == entropies.shape == (len(ids), width) and aux is None
    assert seen and all(k.get("fused_lm_head") is True and "labels" in k for k in seen)
    out = forward(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), fused_lm_head=True)
    assert hasattr(out, "log_probs") and hasattr(out, "entropy")


@pytest.mark.parametrize("loss_type", sorted(PROPORTIONAL))
def test_compute_loss_of_a_batch_without_advantages_is_zero_with_a_zero_gradient(grpo, loss_type):
    """zero_advantage.ZeroAdvantageSkip skips TRL's `compute_loss` for a batch whose advantages are all zero,
    trusting that, for each loss type it lists, beta 0 and no entropy bonus, TRL's loss is then exactly zero and so
    is every trainable weight's gradient."""
    assert _params(type(grpo).compute_loss) == ["model", "inputs", "return_outputs", "num_items_in_batch"]
    inputs = dict(grpo.batch)
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])
    grpo.loss_type = loss_type
    grpo.current_gradient_accumulation_steps = 1  # what TRL's training loop sets before its first compute_loss
    grpo.model.zero_grad()
    try:
        loss = grpo.compute_loss(grpo.model, inputs, num_items_in_batch=inputs["num_items_in_batch"])
        loss.backward()
    finally:
        grpo.loss_type = grpo.args.loss_type
    assert loss.item() == 0.0
    grads = [p.grad for p in grpo.model.parameters() if p.requires_grad]
    assert grads and all(g is None or not g.any() for g in grads)


def test_save_checkpoint_writes_the_folder_the_curriculum_writes_into(grpo, tmp_path):
    """sampling.CurriculumCut.save writes curriculum.json into `output_dir/checkpoint_name(step)` after TRL's
    `_save_checkpoint(model, trial)`: the folder HF names that way."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from grpo_pipeline.trainer.checkpoints import checkpoint_name

    assert _params(type(grpo)._save_checkpoint) == ["model", "trial"]
    assert checkpoint_name(7) == f"{PREFIX_CHECKPOINT_DIR}-7"
    output_dir, step = grpo.args.output_dir, grpo.state.global_step
    grpo.args.output_dir = str(tmp_path)
    grpo.create_optimizer_and_scheduler(num_training_steps=1)  # as train() has before its first save
    try:
        grpo.state.global_step = 3
        grpo._save_checkpoint(grpo.model, None)
    finally:
        grpo.args.output_dir, grpo.state.global_step = output_dir, step
    assert (tmp_path / checkpoint_name(3)).is_dir()


def test_the_fused_lm_head_chooses_its_compact_branch_by_use_triton_at_call_time(grpo, monkeypatch):
    """lm_head.compact_lm_head swaps `trl.trainer.utils._use_triton` for the span of training: the fused head must
    look it up at each call, with the hidden states' device, and project only the labelled rows when it says so."""
    import trl.trainer.utils as trl_utils

    assert callable(trl_utils.add_fused_lm_head) and _params(trl_utils._use_triton) == ["device"]
    assert trl_utils._use_triton(torch.device("cpu")) is False
    devices = []
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: devices.append(device.type) or True)
    ids = torch.cat([grpo.batch["prompt_ids"], grpo.batch["completion_ids"]], dim=1)
    labels = ids.clone()
    labels[:, : grpo.batch["prompt_ids"].size(1)] = -100
    with torch.no_grad():
        out = grpo.model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert devices and set(devices) == {"cpu"}
    # position i predicts token i + 1: the rows before the last prompt token predict unlabelled tokens, not projected
    assert (out.log_probs[:, : grpo.batch["prompt_ids"].size(1) - 1] == 0).all()


def test_nanstd_groups_rewards_as_trl_normalises_them():
    """The curriculum's and dynamic sampling's zero-variance test is TRL's: `nanstd` over each group's rewards."""
    from trl.trainer.utils import nanstd

    nan = float("nan")
    std = nanstd(torch.tensor([[1.0, 1.0], [0.0, 1.0], [nan, nan]]), dim=1)
    assert std[0] == 0 and std[1] > 0
    assert torch.isnan(std[2])  # an unscorable group is neither flat nor informative: the cuts test it apart


def test_the_transformers_internals_prefill_and_the_shared_prompt_forward_use(grpo):
    """generation.prefill_blocker / prefilled_generate and shared_prompt_logps: the generation config as generate
    resolves it, the cache kinds, the one-position logits, and a DynamicCache whose rows can be repeated."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    from transformers.generation.configuration_utils import GenerationMode

    from grpo_pipeline.trainer.generation import cache_blocker, cache_kwarg, transformers_model

    model = transformers_model(grpo.model)
    assert cache_blocker(model) is None and cache_kwarg(model) in ("cache", "past_key_values")
    config, rest = model._prepare_generation_config(None, do_sample=True)
    assert rest == {} and config.get_generation_mode() == GenerationMode.SAMPLE
    assert model._supports_default_dynamic_cache() and model._supports_logits_to_keep()
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    assert all(type(layer) is DynamicLayer for layer in cache.layers)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), **{cache_kwarg(model): cache}, use_cache=True)
    cache.batch_select_indices(torch.tensor([0, 0, 1]))
    assert cache.get_seq_length() == 3 and cache.layers[0].keys.shape[0] == 3
