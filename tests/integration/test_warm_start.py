"""The trainer continues an existing adapter (model.init_adapter): real GRPO steps on the tiny random Llama."""

import json

import pytest

from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.spec import JobSpec

pytestmark = pytest.mark.integration


def _spec(tmp_path, tiny_model, tiny_splits, cfg, init_adapter) -> JobSpec:
    return JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tiny_splits["train"]),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
        init_adapter=str(init_adapter),
    )


def _parent_adapter(tiny_model, directory, r=4):
    """An adapter whose weights are not PEFT's fresh ones (lora_B nonzero), as a trained champion's are."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        LoraConfig(task_type="CAUSAL_LM", r=r, target_modules="all-linear", init_lora_weights=False),
    )
    model.save_pretrained(directory)
    return directory


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def test_continues_the_adapter_with_a_fresh_step_count(tmp_path, tiny_model, tiny_splits, tiny_config):
    from grpo_pipeline.trainer.train import run

    parent = _parent_adapter(tiny_model, tmp_path / "parent")
    cfg = tiny_config(
        "train.grpo.max_steps=1",
        "train.checkpoint_every=1",
        "train.rewards=[{name: 'tests.integration.varied_reward:text_checksum', role: skill}]",  # varies: weights move
    )
    result = run(_spec(tmp_path, tiny_model, tiny_splits, cfg, parent))

    assert (result.global_step, result.max_steps, result.resumed_from_step) == (1, 1, None)  # steps from 0
    before, after = _weights(parent), _weights(tmp_path / "adapter")
    assert before.keys() == after.keys()  # the same modules, the same shapes
    b = next(k for k in before if "lora_B" in k)
    moved = (after[b] - before[b]).abs().max().item()
    # started from the parent's weights (a fresh adapter's lora_B is zero), and trained them
    assert 0 < moved < before[b].abs().max().item()
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_another_rank_exits_2_before_the_model_loads(tmp_path, tiny_model, tiny_splits, tiny_config, capsys):
    from grpo_pipeline.trainer.spec import EXIT_BAD_INPUT
    from grpo_pipeline.trainer.train import main

    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "adapter_config.json").write_text(json.dumps({"r": 16, "target_modules": ["q_proj"]}))
    spec = _spec(tmp_path, tiny_model, tiny_splits, tiny_config(), parent).write(tmp_path / "job.json")
    assert main(str(spec)) == EXIT_BAD_INPUT
    assert "LoRA rank r=16, train.lora.r is 4" in capsys.readouterr().out
    assert not (tmp_path / "work").exists()  # no work done


@pytest.mark.slow  # make test-slow: a real search trial through the local launcher (20 s)
def test_search_trials_continue_the_adapter_the_run_continues(tmp_path, tiny_model, tiny_splits, tiny_config):
    """A daily run that continues an adapter searches from it too: a real trial (the local launcher) trains the
    parent's weights further, and its study records where its trials started."""
    import functools

    from grpo_pipeline.infra.launch import make_launcher
    from grpo_pipeline.tasks.hpo import START, open_study, run_trial, search
    from grpo_pipeline.tasks.job import WarmStart

    parent = _parent_adapter(tiny_model, tmp_path / "parent")
    cfg = tiny_config(
        f"data_dir={tmp_path / 'data'}",
        "hpo.trials=1",
        "hpo.keep_configured=false",
        "hpo.steps=1",
        "hpo.eval_every=1",
        "hpo.budget_steps=1",
        "hpo.pruner=none",
        "hpo.trial_score=trainer",
        "hpo.study_name=warm",
        "hpo.space.lora_r=null",
        "hpo.space.lora_alpha_ratio=null",
        "train.rewards=[{name: 'tests.integration.varied_reward:text_checksum', role: skill}]",  # varies: weights move
    )
    warm = WarmStart(requested="champion", uri="models:/grpo-adapter/1", adapter_dir=str(parent))
    run_dir = tmp_path / "run"
    result = search(
        cfg.hpo,
        cfg.train,
        cfg.model,
        cfg.evaluate,
        str(tiny_model),
        tiny_splits,
        run_dir,
        data_dir=cfg.data_dir,
        rewards=cfg.train.reward_set(),
        run_one=functools.partial(run_trial, launcher_for=make_launcher),
        warm_start=warm,
    )

    assert [t.state for t in result.trials] == ["COMPLETE"]
    trial_adapter = run_dir / "hpo" / "run-trial-000" / "adapter"
    before, after = _weights(parent), _weights(trial_adapter)
    assert before.keys() == after.keys()
    b = next(k for k in before if "lora_B" in k)
    # the trial started from the parent's weights and trained them: one Adam step at a learning rate <= 1e-3
    # moves a weight by about that much, while a fresh adapter's lora_B (zero) would differ by the parent's size
    assert 0 < (after[b] - before[b]).abs().max().item() < before[b].abs().max().item() / 10
    assert open_study(cfg.hpo, cfg.model.base, cfg.data_dir, "warm", start=warm.uri).user_attrs[START] == warm.uri
