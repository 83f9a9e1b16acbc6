"""Dynamic sampling on real generation and training (tiny random Llama): a reward that gives variance only to
half of the prompts, so a group drawn for a "same" prompt teaches nothing. The step trains on its configured
batch (one group of four), chosen among four generated groups, and the trained groups have variance where the
generated ones often do not."""

import ast
import json

import pytest
import torch

from grpo_pipeline.configs.sampling import DynamicSamplingConfig
from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.spec import JobSpec
from tests.integration.curriculum_rewards import same_for_some, varied_shape

pytestmark = pytest.mark.integration
REWARD = "tests.integration.curriculum_rewards:same_for_some"
KINDS = ["same", "varied", "same", "varied"]  # 3 extra prompts of these 4 always include a "varied" one


def _rows():
    return [
        {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1), "kind": kind}
        for i, kind in enumerate(KINDS)
    ]


def _spec(tmp_path, tiny_model, tiny_config, *overrides: str) -> JobSpec:
    """A job on `_rows()` scored by `REWARD` with dynamic sampling at oversample 4, plus `overrides`."""
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    cfg = tiny_config(
        f"train.rewards=[{REWARD}]",
        "train.dynamic_sampling.enabled=true",
        "train.dynamic_sampling.oversample=4",
        *overrides,
    )
    return JobSpec(
        model_path=str(tiny_model),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(train_file),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
    )


def _trainer(tmp_path, tiny_model, reward_funcs, skill=None, **settings):
    """A StepTrainer in training mode on `_rows()`, one group of four a step, dynamic sampling at oversample 4 (and
    `settings`)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from grpo_pipeline.trainer.cuts import Cuts
    from grpo_pipeline.trainer.step import StepTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=6,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
    )
    trainer = StepTrainer(
        model=str(tiny_model),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_list(_rows()),
        cuts=Cuts(dynamic_sampling=DynamicSamplingConfig(enabled=True, oversample=4, **settings)),
        skill=skill,
    )
    trainer.model.train()
    return trainer


def test_one_generation_keeps_the_batch_size_and_trains_on_a_group_with_variance(tmp_path, tiny_model):
    trainer = _trainer(tmp_path, tiny_model, [same_for_some])
    batch = [dict(_rows()[0]) for _ in range(4)]  # the dataloader's group: a "same" prompt, flat whatever is said
    out = trainer._generate_and_score_completions(batch)

    assert {
        out[k].size(0) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    } == {4}
    assert out["advantages"].abs().sum() > 0  # an extra "varied" group replaced the flat one
    assert out["num_items_in_batch"].item() == out["completion_mask"].sum().item()  # the kept rows' tokens only
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/generated_groups"] == [4.0]
    assert metrics["dynamic_sampling/trained_zero_std"] == [0.0]
    assert metrics["frac_reward_zero_std"][-1] >= 0.25  # TRL's figure counts every generated group
    trainer.model.eval()  # evaluation generates what it is given, nothing more
    assert trainer._generate_and_score_completions(batch)["advantages"].size(0) == 4
    assert metrics["dynamic_sampling/generated_groups"] == [4.0]


def _group(kind_index: int) -> list[dict]:
    """The data loader's group for `_rows()[kind_index]`: its prompt four times."""
    return [dict(_rows()[kind_index]) for _ in range(4)]


def test_a_spare_mixed_group_is_trained_on_at_the_next_step_once_and_saves_its_generation(tmp_path, tiny_model):
    """Step 1 trains on its own "varied" group and keeps a spare "varied" extra; step 2's own group is flat, and it
    trains on the spare group, as generated, without generating any extra; step 3 has nothing carried (a group
    is trained on once) and generates extra groups again, as many as the share of mixed groups measured says."""
    trainer = _trainer(tmp_path, tiny_model, [same_for_some], carry=True, adaptive=True)
    metrics = trainer._metrics["train"]
    pad = trainer.processing_class.pad_token_id

    trainer._generate_and_score_completions(_group(1))
    assert metrics["dynamic_sampling/generated_groups"] == [4.0]  # the prior share: the most, 1 + 3
    spare = {k: v.clone() for k, v in trainer._dynamic._carried_rows.items()}
    assert spare["completion_ids"].size(0) == 4  # one whole group carried

    out = trainer._generate_and_score_completions(_group(0))  # a "same" prompt: flat
    assert metrics["dynamic_sampling/generated_groups"][-1] == 1.0  # the carried group fills the step
    assert metrics["dynamic_sampling/carried_groups"][-1] == 1.0
    assert metrics["dynamic_sampling/trained_zero_std"][-1] == 0.0
    assert out["advantages"].abs().sum() > 0 and out["advantages"].size(0) == 4
    assert torch.equal(out["advantages"], spare["advantages"])
    for trained, kept in zip(out["completion_ids"], spare["completion_ids"], strict=True):  # the rows as generated
        assert [t for t in trained.tolist() if t != pad] == [t for t in kept.tolist() if t != pad]
    assert out["num_items_in_batch"].item() == out["completion_mask"].sum().item()

    trainer._generate_and_score_completions(_group(0))
    assert metrics["dynamic_sampling/carried_groups"][-1] == 0.0  # trained once: not carried again
    share = metrics["dynamic_sampling/mixed_share"][-2]  # measured over the first two generations
    assert 0 < share < 1 and 1 < metrics["dynamic_sampling/generated_groups"][-1] <= 4.0


def test_by_default_every_step_generates_the_most_and_keeps_nothing(tmp_path, tiny_model):
    trainer = _trainer(tmp_path, tiny_model, [same_for_some])
    for kind in (1, 0, 0):
        trainer._generate_and_score_completions(_group(kind))
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/generated_groups"] == [4.0] * 3
    assert metrics["dynamic_sampling/carried_groups"] == [0.0] * 3 and trainer._dynamic._carried_rows is None


@pytest.mark.parametrize(("skill", "allowed"), [("same_for_some", {"1", "3"}), (None, {"0"})])
def test_a_group_that_differs_on_the_skill_ranks_above_one_that_differs_only_on_shaping(
    tmp_path, tiny_model, skill, allowed
):
    """Every group differs on the shaping reward; only the "varied" prompts (1 and 3) differ on the skill. Told
    the skill, the step trains on one of those (DAPO's accuracy filter); not told, the dataloader's own group."""
    trainer = _trainer(tmp_path, tiny_model, [same_for_some, varied_shape], skill)
    out = trainer._generate_and_score_completions([dict(_rows()[0]) for _ in range(4)])  # a "same" prompt's group
    prompts = {trainer.processing_class.decode(ids, skip_special_tokens=True) for ids in out["prompt_ids"]}
    kept = {i for i in "0123" if any(f"What is {i} + 1?" in p for p in prompts)}
    assert len(kept) == 1 and kept <= allowed  # the step's one group
    groups = trainer._metrics["train"]["dynamic_sampling/skill_groups"]
    assert (groups[0] >= 1) if skill else (groups == [0.0])  # the "varied" groups counted, told the skill


@pytest.mark.parametrize("carried", [False, True], ids=["fixed", "carried"])
def test_a_run_with_dynamic_sampling_reports_the_trained_and_the_generated_zero_signal(
    tmp_path, tiny_model, tiny_config, carried
):
    from grpo_pipeline.trainer.train import run

    # the curriculum (on by default) runs over the same prompts; carried: groups of other widths padded into a step
    sets = [f"train.dynamic_sampling.carry={carried}", f"train.dynamic_sampling.adaptive={carried}"]
    result = run(_spec(tmp_path, tiny_model, tiny_config, "train.grpo.max_steps=4", "train.checkpoint_every=4", *sets))
    zero = result.zero_signal
    assert result.global_step == 4 and zero.logged_steps == 4
    assert zero.trained_fraction == 0.0 and zero.trained_wasted_steps == 0  # every step found a group with variance
    assert zero.mean_fraction >= 0.25 > zero.trained_fraction  # each step generated a flat group or more
    assert zero.skipped_draws is not None  # the curriculum ran beside it


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_each_keep_their_batch_and_stay_in_step(tmp_path, tiny_model, tiny_config):
    """Two ranks (torchrun, gloo), one group each per step: each chooses among its own four groups, keeps one,
    and the loss normalizer sums both ranks' kept tokens; a rank that kept a different number of rows would
    hang a collective or fail DDP's gradient reduction."""
    import subprocess
    import sys
    from pathlib import Path

    from grpo_pipeline.trainer.launch import free_port
    from grpo_pipeline.trainer.spec import TrainResult

    spec = _spec(
        tmp_path,
        tiny_model,
        tiny_config,
        "train.grpo.max_steps=3",
        "train.checkpoint_every=100",
        "train.distributed.processes_per_node=2",
        "train.curriculum.enabled=false",
    ).write(tmp_path / "job.json")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_pipeline.trainer.launch", "--spec", str(spec), "--master-port", str(free_port())],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = TrainResult.model_validate_json(proc.stdout.strip().splitlines()[-1])
    assert result.world_size == 2 and result.global_step == 3
    zero = result.zero_signal
    assert zero.trained_fraction == 0.0 < zero.mean_fraction  # both ranks found a group with variance each step
    logs = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{'loss'")]  # HF's
    assert [log["dynamic_sampling/generated_groups"] for log in logs] == [8.0] * 3  # 2 ranks x (1 + 3 extra)
