"""The CPU step's cut (bench.step_profile): no gradient checkpointing on a CPU node computes the same log-probs,
loss and adapter gradients as TRL's default, which recomputes each layer's forward inside the backward."""

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
