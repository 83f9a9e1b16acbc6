"""The CPU step's cuts (bench.step_profile), each computing what the path it replaces computes: no gradient
checkpointing (TRL's default recomputes each layer's forward inside the backward); generation from the merged LoRA
weights and each distinct prompt prefilled once (trainer/generation.py); the loss's forward over each distinct
prompt once (trainer/shared_prompt.py); the fused LM head scoring only the completion's positions
(trainer/lm_head.py)."""

import contextlib
import functools

import pytest
import torch

pytestmark = pytest.mark.integration


def _loss_and_grads(model_dir, checkpointing: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    model.train()
    if checkpointing:  # as TRL's GRPOConfig(gradient_checkpointing=True) sets it up for a PEFT model
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids).logits[:, :-1]
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(logps * torch.linspace(-1, 1, 4)[:, None]).mean()  # advantage-weighted, like GRPO's objective
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), loss.detach(), grads


def test_the_step_without_checkpointing_computes_what_the_default_does(tiny_model):
    logps_on, loss_on, grads_on = _loss_and_grads(tiny_model, checkpointing=True)
    logps_off, loss_off, grads_off = _loss_and_grads(tiny_model, checkpointing=False)
    # fp32, the same ops in the same order: equal to rounding (1e-6 relative)
    torch.testing.assert_close(logps_off, logps_on, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss_off, loss_on, rtol=1e-6, atol=1e-7)
    assert grads_on.keys() == grads_off.keys() and len(grads_on) > 0
    for name in grads_on:
        torch.testing.assert_close(grads_off[name], grads_on[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in grads_off.values())


def test_a_cpu_node_trains_without_checkpointing_unless_the_recipe_asks(trainer_args):
    args = trainer_args

    assert not torch.cuda.is_available()
    assert args().gradient_checkpointing is False
    assert args("train.grpo.gradient_checkpointing=true").gradient_checkpointing is True


def _peft_model(model_dir, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # init_lora_weights=False: a non-zero B, so the merged weights differ from the base's
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **lora)
    return get_peft_model(model, config).eval()


def test_generation_from_merged_weights_computes_the_adapters_log_probs(tiny_model):
    """Inside `merged_adapter` the model computes with W + s·BA: the same per-token log-probs as the unmerged adapter
    to float32 rounding (one matmul instead of two summed), the same greedy tokens; afterwards the base weights are
    the very tensors they were (bit for bit) and the adapter is live and trainable again."""
    from grpo_pipeline.trainer.generation import merge_blocker, merged_adapter

    model = _peft_model(tiny_model)
    assert merge_blocker(model) is None
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    bases = {n: p for n, p in model.named_parameters() if "base_layer.weight" in n}
    storage = {n: p.data_ptr() for n, p in bases.items()}
    copies = {n: p.detach().clone() for n, p in bases.items()}
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=ids).logits, -1)
        with model.disable_adapter():
            base_only = torch.log_softmax(model(input_ids=ids).logits, -1)
        greedy = model.generate(input_ids=ids[:, :8], max_new_tokens=6, do_sample=False, pad_token_id=0)
        with merged_adapter(model):
            # merged copies in place of the base weights, which stay untouched
            assert all(p.data_ptr() != storage[n] and not p.data.equal(copies[n]) for n, p in bases.items())
            merged = torch.log_softmax(model(input_ids=ids).logits, -1)
            merged_greedy = model.generate(input_ids=ids[:, :8], max_new_tokens=6, do_sample=False, pad_token_id=0)
        after = torch.log_softmax(model(input_ids=ids).logits, -1)
    assert (merged - base_only).abs().max() > 1e-3  # the adapter changes the model: the check below means something
    # fp32, (W + s·BA)x against Wx + s·B(Ax): equal to rounding, 1e-5 absolute on log-probs of order 1-10
    torch.testing.assert_close(merged, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(merged_greedy, greedy)
    assert all(p.data_ptr() == storage[n] and torch.equal(p.data, copies[n]) for n, p in bases.items())
    assert torch.equal(after, reference)  # the unmerged path again, bit for bit
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_merged_weights_made_in_the_autocast_dtype_compute_what_autocast_computes(tiny_model):
    """bf16 mixed precision: autocast casts every frozen float32 weight again at each forward; `cast_to` makes the
    merged weights (and the tied LM head's) in bf16 once. The forward under autocast gives the same logits, bit for
    bit, and afterwards the weights are float32 again, the head tied to the embedding as before."""
    from grpo_pipeline.trainer.generation import merged_adapter

    model = _peft_model(tiny_model)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embedding.weight  # tied: the case a cast in place would get wrong
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with merged_adapter(model):
            cast_by_autocast = model(input_ids=ids).logits
        with merged_adapter(model, cast_to=torch.bfloat16):
            assert head.weight.dtype == torch.bfloat16 and embedding.weight.dtype == torch.float32
            cast_once = model(input_ids=ids).logits
    assert torch.equal(cast_once, cast_by_autocast)
    assert head.weight is embedding.weight and head.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_merged_generation_falls_back_where_it_cannot_be_exact(tiny_model):
    from grpo_pipeline.trainer.generation import lora_dropout, merge_blocker

    assert "variant" in merge_blocker(_peft_model(tiny_model, use_dora=True))
    assert "lora_bias" in merge_blocker(_peft_model(tiny_model, lora_bias=True))
    assert merge_blocker(torch.nn.Linear(2, 2)) == "the model has no PEFT adapter"
    # TRL samples in train mode: a live LoRA dropout masks the adapter's input, which merged weights cannot
    dropping = _peft_model(tiny_model, lora_dropout=0.1)
    assert merge_blocker(dropping) is None  # eval mode: the dropout is the identity
    assert merge_blocker(dropping.train()) == "LoRA dropout is active while sampling (lora_dropout=0.1)"
    # the trainer decides once for the run, in whatever mode the model is at its first sampling call: a dropout
    # configured at all blocks it (an evaluation first would sample in eval mode, every training call in train mode)
    assert lora_dropout(dropping.eval()) == 0.1 and lora_dropout(_peft_model(tiny_model)) == 0.0


def _two_steps(
    model_dir,
    trainer_args,
    merged: bool | None,
    prefill: bool | None = False,
    *overrides: str,
    watch=None,
    shared: bool | None = False,
    zero: bool | None = False,
    flat_after: int | None = None,
    **lora,
) -> dict:
    """Two GRPO steps of the trainer's settings (and `overrides`) on the tiny model: the completions each step
    sampled, the per-token log-probs of the loss's forward (policy, with grad) and the logged losses; the adapter's
    weights at the end. `merged`, `prefill`: the switches of generation from merged weights and prefill once;
    `watch(model)` sees the loaded model before training; `shared`: the loss's forward over each distinct prompt
    once; `zero`: no loss pass for a batch without advantages (each switch: True asked for, None auto, False off);
    `flat_after`: every completion scores 0 after that many steps. With every cut off, TRL's own GRPOTrainer runs:
    the cuts are compared with TRL as it ships."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOTrainer

    from grpo_pipeline.trainer import zero_advantage
    from grpo_pipeline.trainer.cuts import Cuts
    from grpo_pipeline.trainer.loading import load_model
    from grpo_pipeline.trainer.spec import ModelLoad
    from grpo_pipeline.trainer.step import StepTrainer

    seen: dict = {"completions": [], "logps": []}

    def length_reward(completions, **_):  # varies within a group: non-zero advantages, a loss that trains
        seen["completions"].append(list(completions))
        if flat_after is not None and len(seen["completions"]) > flat_after:
            return [0.0] * len(completions)
        return [len(c) / 10 for c in completions]

    load = ModelLoad(quantization="none", double_quant=False, compute_dtype="float32", trust_remote_code=False)
    model, tokenizer = load_model(str(model_dir), load)
    if watch is not None:
        watch(model)
    cuts = Cuts(merged_generation=merged, prefill_once=prefill, share_prompt_forward=shared, skip_zero_advantage=zero)
    trainer = (GRPOTrainer if cuts == Cuts() else functools.partial(StepTrainer, cuts=cuts))(
        model=model,
        reward_funcs=[length_reward],
        # one reward weight
        args=trainer_args("train.grpo.max_steps=2", "train.rewards=[{name: number_only, role: skill}]", *overrides),
        # the odd sums' prompts longer: two prompts in a batch are left-padded to the longer one
        train_dataset=Dataset.from_list(
            [
                {"prompt": f"What is {a} + {b}?" + " Reply with just the number." * ((a + b) % 2)}
                for a in range(6)
                for b in range(6)
            ]
        ),
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear", **lora),
    )
    logps = trainer._get_per_token_logps_and_entropies

    def recorded(*args, **kwargs):
        out = logps(*args, **kwargs)
        seen["logps"].append(out[0].detach().clone())
        return out

    trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    seen["loss"] = torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h and "reward" in h])
    seen["adapter"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    seen["skipped"] = [h[zero_advantage.METRIC] for h in trainer.state.log_history if zero_advantage.METRIC in h]
    return seen


def test_the_trainer_with_merged_generation_trains_as_the_default(tiny_model, trainer_args):
    """The real GRPOTrainer, two steps from the same seed, in float32 (bf16 mixed precision samples in bf16 from
    merged weights, below): generating from the merged adapter samples the same completions (step 2's adapter is
    non-zero after step 1's update), so the loss's forward sees the same tokens and computes the same per-token
    log-probs and loss, to float32 rounding (1e-6), and the adapter ends the same."""
    plain = _two_steps(tiny_model, trainer_args, False, False, "train.grpo.bf16=false")
    merged = _two_steps(tiny_model, trainer_args, True, False, "train.grpo.bf16=false")
    assert merged["completions"] == plain["completions"] and len(plain["completions"]) == 2
    assert len(merged["logps"]) == len(plain["logps"]) == 2
    for got, want in zip(merged["logps"], plain["logps"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(merged["loss"], plain["loss"], rtol=1e-6, atol=1e-6)
    for name, want in plain["adapter"].items():
        torch.testing.assert_close(merged["adapter"][name], want, rtol=1e-5, atol=1e-7, msg=name)


def test_bf16_mixed_precision_samples_in_bf16_from_weights_merged_once(tiny_model, trainer_args):
    """bf16 mixed precision: the loss's forward autocasts, and now so does the sampling pass (PEFT's generate calls
    the base model's forward, outside accelerate's autocast wrapper, so it sampled in float32). While sampling the
    linears compute in bf16 from weights merged in bf16 once per call; the loss's forward autocasts the float32
    weights as before, and the trained model ends all float32."""
    seen: list[tuple[bool, torch.dtype, torch.dtype]] = []  # (with grad, weight dtype, output dtype) per matmul

    def watch(model):  # before the trainer adds the adapter: every linear here is the base's or the LM head
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(
                    lambda m, _, out: seen.append((torch.is_grad_enabled(), m.weight.dtype, out.dtype))
                )

    run = _two_steps(tiny_model, trainer_args, True, False, "train.grpo.bf16=true", watch=watch)
    sampling = {(w, o) for grad, w, o in seen if not grad}
    scoring = {(w, o) for grad, w, o in seen if grad}
    assert sampling == {(torch.bfloat16, torch.bfloat16)}
    assert scoring == {(torch.float32, torch.bfloat16)}
    assert len(run["completions"]) == 2 and torch.isfinite(run["loss"]).all()
    assert all(p.dtype == torch.float32 for p in run["adapter"].values())


def test_merged_generation_warns_once_and_trains_unmerged_with_a_lora_variant(tiny_model, trainer_args, caplog):
    with caplog.at_level("WARNING", logger="grpo_pipeline.trainer.generation"):
        run = _two_steps(tiny_model, trainer_args, True, False, use_dora=True)
    warnings = [r.getMessage() for r in caplog.records if r.name == "grpo_pipeline.trainer.generation"]
    assert len(warnings) == 1 and warnings[0].startswith("train.merged_generation: generating from the unmerged")
    assert len(run["completions"]) == 2 and torch.isfinite(run["loss"]).all()


def test_merged_generation_asked_for_with_a_lora_dropout_warns_once_and_samples_from_the_unmerged_adapter(
    tiny_model, trainer_args, caplog
):
    """A LoRA dropout above 0 (a GPU recipe may set it): TRL samples in train mode, where the unmerged adapter drops
    part of its input and merged weights cannot. One warning naming the setting and the dropout, then the two steps
    sample as TRL does: the same completions and losses as TRL's own trainer from the same seed."""
    with caplog.at_level("WARNING", logger="grpo_pipeline.trainer.generation"):
        run = _two_steps(tiny_model, trainer_args, True, False, "train.grpo.bf16=false", lora_dropout=0.1)
    warnings = [r.getMessage() for r in caplog.records if r.name == "grpo_pipeline.trainer.generation"]
    assert len(warnings) == 1 and warnings[0].startswith("train.merged_generation: generating from the unmerged")
    assert "lora_dropout=0.1" in warnings[0]
    plain = _two_steps(tiny_model, trainer_args, False, False, "train.grpo.bf16=false", lora_dropout=0.1)
    assert run["completions"] == plain["completions"]
    assert torch.equal(run["loss"], plain["loss"])


def test_cuts_left_unset_fall_back_silently_and_train_as_trl_does(tiny_model, trainer_args, caplog):
    """Every cut left unset (auto) where none can apply (a LoRA dropout: merged generation, prefill once and the
    shared prompt forward cannot; a KL term: the zero-advantage skip cannot): no warning, and TRL's own trainer's
    completions, log-probs, losses and adapter, bit for bit."""
    two = ("train.grpo.num_generations=2", "train.grpo.bf16=false", "train.grpo.beta=0.1")
    with caplog.at_level("DEBUG", logger="grpo_pipeline.trainer"):
        auto = _two_steps(tiny_model, trainer_args, None, None, *two, shared=None, zero=None, lora_dropout=0.1)
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30 and r.name.startswith("grpo_pipeline")] == []
    told = {r.getMessage().split(":")[0] for r in caplog.records if r.name.startswith("grpo_pipeline.trainer.")}
    assert {
        "train.merged_generation",
        "train.prefill_once",
        "train.share_prompt_forward",
        "train.skip_zero_advantage",
    } <= told  # each fallback said why, at debug level
    plain = _two_steps(tiny_model, trainer_args, False, False, *two, lora_dropout=0.1)
    assert auto["completions"] == plain["completions"] and len(plain["completions"]) == 2
    for got, want in zip(auto["logps"], plain["logps"], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(auto["loss"], plain["loss"])
    assert all(torch.equal(auto["adapter"][n], w) for n, w in plain["adapter"].items())


def test_a_cpu_node_generates_from_merged_weights_unless_the_recipe_says_not(tiny_config):
    from grpo_pipeline.tasks.job import train_settings
    from grpo_pipeline.trainer.generation import wanted

    assert train_settings(tiny_config().train).merged_generation is None
    assert wanted(train_settings(tiny_config().train).merged_generation, cuda=torch.cuda.is_available())
    assert train_settings(tiny_config("train.merged_generation=false").train).merged_generation is False


def _prompt_batch(tokenizer, order):
    """Two prompts of different lengths, repeated in `order` (not grouped), left-padded as TRL pads them."""
    prompts = [tokenizer("What is 3 + 4? Reply with just the number.").input_ids, tokenizer("What is 2 + 5?").input_ids]
    width = max(len(p) for p in prompts)
    assert len(prompts[1]) < width  # the shorter one is padded: the positions and mask must carry over
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(prompts[i])) + prompts[i] for i in order])
    mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in order])
    return ids, mask


def _generate(model, ids, mask, prefill: bool, warnings: list, **config):
    from grpo_pipeline.trainer.generation import prefill_once

    torch.manual_seed(0)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, pad_token_id=model.config.pad_token_id)
    with prefill_once(model, warnings.append) if prefill else contextlib.nullcontext():
        return model.generate(**kwargs, return_dict_in_generate=True, output_logits=True, **config)


def _token_logps(out, width: int):
    """The log-probs of each generated token under the logits generate sampled it from."""
    logps = torch.log_softmax(torch.stack(out.logits, 1), -1)
    return logps.gather(-1, out.sequences[:, width:, None]).squeeze(-1)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_prefill_once_generates_what_generate_does(tiny_model, monkeypatch, sampled):
    """Each distinct prompt prefilled once, its cache repeated to its rows (interleaved, left-padded), then HF
    generate continues from it: the same tokens, greedy or sampled from one seed (the decode batch draws the same
    numbers), and the per-token log-probs to float32 rounding (1e-5): the prompt's keys and values come from a
    batch of 2 instead of 8, the first new token's logits from a one-token step."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = _peft_model(tiny_model)  # as TRL generates: through the PeftModel, its adapter live
    ids, mask = _prompt_batch(tokenizer, [0, 1, 1, 0, 1, 0, 0, 1])
    selected = _count_prefills(monkeypatch)
    config = dict(do_sample=True, temperature=0.8) if sampled else dict(do_sample=False)
    warnings: list = []
    plain = _generate(model, ids, mask, False, warnings, **config)
    assert not selected  # the plain call shares nothing
    once = _generate(model, ids, mask, True, warnings, **config)
    assert selected == [[0, 1, 1, 0, 1, 0, 0, 1]] and warnings == []  # prefilled: 2 rows, mapped back in order
    assert "generate" not in vars(model.get_base_model())  # the model's own generate again
    assert torch.equal(once.sequences, plain.sequences)
    width = ids.shape[1]
    torch.testing.assert_close(_token_logps(once, width), _token_logps(plain, width), rtol=0, atol=1e-5)
    if sampled:  # not one greedy path: the rows of one prompt sampled different completions
        assert len({tuple(r) for r in plain.sequences[mask[:, 0] == 0].tolist()}) > 1


def test_prefill_once_falls_back_to_the_plain_call(tiny_model):
    """Where it cannot be exact (beam search here) or has nothing to share (no repeated prompt), the plain generate
    runs: the same output, the reason passed to `warn` only in the first case."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = _peft_model(tiny_model)
    ids, mask = _prompt_batch(tokenizer, [0, 1, 0, 1])
    warnings: list = []
    beams = _generate(model, ids, mask, True, warnings, do_sample=False, num_beams=2)
    assert torch.equal(beams.sequences, _generate(model, ids, mask, False, [], do_sample=False, num_beams=2).sequences)
    assert warnings == ["beam_search decoding"]
    warnings.clear()
    distinct = _generate(model, ids[:2], mask[:2], True, warnings, do_sample=False)
    assert torch.equal(distinct.sequences, _generate(model, ids[:2], mask[:2], False, [], do_sample=False).sequences)
    assert warnings == []


def _count_prefills(monkeypatch) -> list:
    from transformers.cache_utils import DynamicCache

    selected: list = []
    select = DynamicCache.batch_select_indices
    monkeypatch.setattr(
        DynamicCache, "batch_select_indices", lambda self, i: (selected.append(i.tolist()), select(self, i))[1]
    )
    return selected


def test_the_trainer_with_prefill_once_trains_as_the_default(tiny_model, trainer_args, monkeypatch):
    """The real GRPOTrainer, two steps from one seed, 2 prompts x 2 generations a step: prefilling each distinct
    prompt once samples the same completions, so the loss's forward computes the same log-probs and loss (1e-6) and
    the adapter ends the same (1e-5); so does it together with generation from merged weights."""
    two = ("train.grpo.num_generations=2", "train.grpo.bf16=false")
    plain = _two_steps(tiny_model, trainer_args, False, False, *two)
    selected = _count_prefills(monkeypatch)
    runs = {"prefill": _two_steps(tiny_model, trainer_args, False, True, *two)}
    assert len(selected) == 2 and all(len(set(s)) == 2 and len(s) == 4 for s in selected)  # both steps prefilled
    runs["merged + prefill"] = _two_steps(tiny_model, trainer_args, True, True, *two)
    assert len(selected) == 4
    for name, run in runs.items():
        assert run["completions"] == plain["completions"] and len(plain["completions"]) == 2, name
        for got, want in zip(run["logps"], plain["logps"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(run["loss"], plain["loss"], rtol=1e-6, atol=1e-6, msg=name)
        for key, want in plain["adapter"].items():
            torch.testing.assert_close(run["adapter"][key], want, rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_prefill_once_warns_once_and_generates_plainly_where_dropout_samples(
    tiny_model, trainer_args, caplog, monkeypatch
):
    """TRL samples in train mode: a LoRA dropout draws a mask per row, which a shared prefill would not. Two steps,
    one warning that names the setting, no prefill."""
    selected = _count_prefills(monkeypatch)
    with caplog.at_level("WARNING", logger="grpo_pipeline.trainer.generation"):
        run = _two_steps(tiny_model, trainer_args, False, True, lora_dropout=0.1)
    warnings = [r.getMessage() for r in caplog.records if r.name == "grpo_pipeline.trainer.generation"]
    assert len(warnings) == 1 and warnings[0].startswith("train.prefill_once: prefilling every row"), warnings
    assert "dropout" in warnings[0] and selected == []
    assert len(run["completions"]) == 2 and torch.isfinite(run["loss"]).all()


def test_prefill_once_is_on_unless_the_recipe_says_not(tiny_config):
    from grpo_pipeline.tasks.job import train_settings

    assert train_settings(tiny_config().train).prefill_once is None  # auto: on where it can apply
    assert train_settings(tiny_config("train.prefill_once=false").train).prefill_once is False


def _fused_head_pass(model_dir, compact: bool):
    """The loss's pass as TRL runs it: its fused LM head on the policy, labels only on the completion (the last 6 of
    24 positions, one row's completion cut short by padding), log-probs and entropies, the backward's adapter grads."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from grpo_pipeline.trainer.lm_head import compact_lm_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))  # as GRPOTrainer adds it
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(model, config).train()
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # a completion that ended early: padded
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-6] = -100  # the prompt's positions carry no label
    with compact_lm_head() if compact else contextlib.nullcontext():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        loss = -(out.log_probs[:, -6:] * torch.linspace(-1, 1, 4)[:, None]).sum() / (labels != -100).sum()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.log_probs.detach(), out.entropy.detach(), loss.detach(), grads


def test_the_compact_lm_head_scores_the_completion_as_the_full_one_does(tiny_model):
    """TRL's fused head on the CPU projects every position and zeroes the unlabelled ones; `compact_lm_head` projects
    only the labelled ones (TRL's GPU branch). Same per-token log-probs, entropies, loss and adapter gradients, to
    float32 rounding (1e-6 relative; 1e-7 absolute on gradients)."""
    full = _fused_head_pass(tiny_model, compact=False)
    compact = _fused_head_pass(tiny_model, compact=True)
    for got, want in zip(compact[:3], full[:3], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (full[0][:, :-6] == 0).all() and (full[0][:, -6:] != 0).sum() == 4 * 6 - 2
    assert full[3].keys() == compact[3].keys() and len(full[3]) > 0
    for name, want in full[3].items():
        torch.testing.assert_close(compact[3][name], want, rtol=1e-5, atol=1e-7, msg=name)


def test_the_compact_lm_head_is_scoped_and_warns_where_trl_has_no_compact_branch(monkeypatch, caplog):
    import trl.trainer.utils as trl_utils

    from grpo_pipeline.trainer.lm_head import compact_lm_head

    shipped = trl_utils._use_triton
    with compact_lm_head():
        assert trl_utils._use_triton(torch.device("cpu"))
    assert trl_utils._use_triton is shipped and not shipped(torch.device("cpu"))
    monkeypatch.delattr(trl_utils, "_use_triton")
    with caplog.at_level("WARNING", logger="grpo_pipeline.trainer.lm_head"), compact_lm_head():
        pass
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["train.compact_lm_head"]


def _shared_prompt_batch(model):
    """A loss batch as TRL builds it: 2 distinct prompts of different lengths (left-padded) x 3 rows each, in mixed
    order, then 5 completion tokens per row, one completion cut short by right padding."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (9, 6)]
    order = [0, 1, 1, 0, 0, 1]
    width = 9
    ids = torch.zeros(len(order), width + 5, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, which in enumerate(order):
        prompt = prompts[which]
        ids[row, width - len(prompt) : width] = prompt
        mask[row, width - len(prompt) :] = 1
    ids[:, width:] = torch.randint(3, model.config.vocab_size, (len(order), 5), generator=gen)
    mask[4, -2:] = 0  # this completion ended early
    ids[4, -2:] = 0
    return ids, mask


def _loss_pass(model_dir, shared: bool):
    """The loss's pass on `_shared_prompt_batch`: TRL's fused-head call, or `shared_prompt_logps`; log-probs,
    entropies and the adapter's gradients of an advantage-weighted loss."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from grpo_pipeline.trainer.shared_prompt import shared_prompt_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(model, config).train()
    ids, mask = _shared_prompt_batch(model)
    if shared:
        logps, entropies = shared_prompt_logps(model, ids, mask, 5, True, contextlib.nullcontext())
    else:  # as TRL's _get_per_token_logps_and_entropies calls it
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-5] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        logps, entropies = out.log_probs[:, -5:], out.entropy[:, -5:]
    loss = -(logps * torch.linspace(-1, 1, len(ids))[:, None] * mask[:, -5:]).sum() / mask[:, -5:].sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), entropies.detach(), loss.detach(), grads


def test_the_loss_forward_over_each_distinct_prompt_once_computes_what_trls_does(tiny_model):
    """Each prompt's pass run once and its keys and values shared: the same per-token log-probs and entropies of the
    completions, the same loss, and the same adapter gradients (the prompt's copies' gradients summed into it), to
    float32 rounding (1e-5 relative, 1e-6 absolute): a prompt's keys come from a smaller batch."""
    plain = _loss_pass(tiny_model, shared=False)
    shared = _loss_pass(tiny_model, shared=True)
    assert (plain[0][4, -2:] == 0).all() and (plain[0] != 0).sum() == 6 * 5 - 2
    for got, want in zip(shared[:3], plain[:3], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert plain[3].keys() == shared[3].keys() and len(plain[3]) > 0
    assert any(g.abs().sum() > 0 for g in plain[3].values())
    for name, want in plain[3].items():
        torch.testing.assert_close(shared[3][name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_the_trainer_sharing_the_prompts_forward_trains_as_the_default(tiny_model, trainer_args, monkeypatch):
    """The real GRPOTrainer, two steps from one seed, 2 prompts x 2 generations a step: with the loss's forward over
    each distinct prompt once, the same completions, log-probs and loss (1e-5) and the same adapter at the end; so
    with every other cut on as train.py stacks them."""
    from grpo_pipeline.trainer import shared_prompt

    shared_calls: list = []
    real = shared_prompt.shared_prompt_logps
    monkeypatch.setattr(
        shared_prompt,
        "shared_prompt_logps",
        lambda *a, **k: (out := real(*a, **k), shared_calls.append(out is not None))[0],
    )
    two = ("train.grpo.num_generations=2", "train.grpo.bf16=false")
    plain = _two_steps(tiny_model, trainer_args, False, False, *two)
    assert shared_calls == []
    runs = {"shared": _two_steps(tiny_model, trainer_args, False, False, *two, shared=True)}
    assert shared_calls == [True, True]  # both steps' loss forwards shared their prompts
    runs["all cuts"] = _two_steps(tiny_model, trainer_args, True, True, *two, shared=True)
    for name, run in runs.items():
        assert run["completions"] == plain["completions"] and len(plain["completions"]) == 2, name
        for got, want in zip(run["logps"], plain["logps"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(run["loss"], plain["loss"], rtol=1e-5, atol=1e-6, msg=name)
        for key, want in plain["adapter"].items():
            torch.testing.assert_close(run["adapter"][key], want, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.parametrize(
    ("overrides", "lora", "names"),
    [
        ((), {"lora_dropout": 0.1}, "dropout"),
        (("train.grpo.gradient_checkpointing=true",), {}, "gradient checkpointing"),
    ],
    ids=["dropout", "checkpointing"],
)
def test_sharing_the_prompts_forward_warns_once_and_runs_every_row_where_it_cannot_be_exact(
    tiny_model, trainer_args, caplog, overrides, lora, names
):
    with caplog.at_level("WARNING", logger="grpo_pipeline.trainer.shared_prompt"):
        run = _two_steps(tiny_model, trainer_args, False, False, *overrides, shared=True, **lora)
    warnings = [r.getMessage() for r in caplog.records if r.name == "grpo_pipeline.trainer.shared_prompt"]
    assert len(warnings) == 1 and warnings[0].startswith("train.share_prompt_forward: "), warnings
    assert names in warnings[0]
    assert len(run["completions"]) == 2 and torch.isfinite(run["loss"]).all()


def test_sharing_the_prompts_forward_is_on_unless_the_recipe_says_not(tiny_config):
    from grpo_pipeline.tasks.job import train_settings

    assert train_settings(tiny_config().train).share_prompt_forward is None  # auto: on where it can apply
    assert train_settings(tiny_config("train.share_prompt_forward=false").train).share_prompt_forward is False


def test_a_batch_without_advantages_runs_no_loss_pass_and_trains_as_the_default(tiny_model, trainer_args):
    """The real GRPOTrainer, two steps from one seed: the first batch's rewards vary, the second's are flat. With
    the skip, the second step runs no loss forward, yet the adapter ends the same: AdamW still moved it by the
    first step's momentum, as it does with TRL's zero gradient (a weight left without a gradient would not move)."""
    two = ("train.grpo.num_generations=2", "train.grpo.bf16=false")
    plain = _two_steps(tiny_model, trainer_args, False, False, *two, flat_after=1)
    skipping = _two_steps(tiny_model, trainer_args, False, False, *two, zero=True, flat_after=1)
    assert skipping["completions"] == plain["completions"] and len(plain["completions"]) == 2
    assert len(plain["logps"]) == 2 and len(skipping["logps"]) == 1  # no loss forward at the flat step
    assert skipping["skipped"] == [0.0, 1.0] and plain["skipped"] == []
    torch.testing.assert_close(skipping["loss"], plain["loss"], rtol=0, atol=0)
    moved = False
    for name, want in plain["adapter"].items():
        torch.testing.assert_close(skipping["adapter"][name], want, rtol=0, atol=0, msg=name)
        moved |= bool(want.abs().sum() > 0)
    assert moved


def test_a_kl_term_keeps_the_loss_pass_of_a_batch_without_advantages_with_one_warning(tiny_model, trainer_args, caplog):
    with caplog.at_level("WARNING", logger="grpo_pipeline.trainer.zero_advantage"):
        run = _two_steps(
            tiny_model,
            trainer_args,
            False,
            False,
            "train.grpo.beta=0.1",
            "train.grpo.num_generations=2",
            zero=True,
            flat_after=0,
        )
    warnings = [r.getMessage() for r in caplog.records if r.name == "grpo_pipeline.trainer.zero_advantage"]
    assert len(warnings) == 1 and warnings[0].startswith("train.skip_zero_advantage: ") and "beta=0.1" in warnings[0]
    # both flat batches ran TRL's loss: each step, the reference's log-probs and the loss's forward
    assert len(run["logps"]) == 4 and run["skipped"] == [0.0, 0.0]


def test_skipping_a_batch_without_advantages_is_on_unless_the_recipe_says_not(tiny_config):
    from grpo_pipeline.tasks.job import train_settings

    assert train_settings(tiny_config().train).skip_zero_advantage is None  # auto: on where it can apply
    assert train_settings(tiny_config("train.skip_zero_advantage=false").train).skip_zero_advantage is False
