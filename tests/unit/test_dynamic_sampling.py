"""Dynamic sampling's pure parts (`grpo_pipeline.trainer.dynamic_sampling`): which generated groups a step trains
on, where the extra prompts come from, and the `train.dynamic_sampling` section's validation (exit 2 from the CLI,
naming the field and the fix)."""

import pytest
from typer.testing import CliRunner

from grpo_pipeline.cli import app
from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.trainer.dynamic_sampling import choose_groups, extra_groups, extra_prompts


def test_groups_with_variance_are_trained_first_and_flat_ones_only_fill_up():
    assert choose_groups([False, False, True, False, True, True], 2) == [2, 4]
    assert choose_groups([False, False, False, True], 3) == [0, 1, 3]  # one informative, two flat fill up
    assert choose_groups([False] * 4, 2) == [0, 1]  # all flat: the dataloader's own groups
    assert choose_groups([True, False, True], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot keep 3 groups of 2"):
        choose_groups([True, True], 3)


@pytest.mark.parametrize("informative", [[True, False, False, True, True, False, False, True], [False] * 8])
def test_the_choice_keeps_exactly_the_batch_and_as_many_informative_groups_as_there_are(informative):
    for keep in range(1, len(informative) + 1):
        chosen = choose_groups(informative, keep)
        assert len(chosen) == len(set(chosen)) == keep and chosen == sorted(chosen)
        assert sum(informative[i] for i in chosen) == min(keep, sum(informative))


def test_extra_prompts_depend_on_seed_rank_and_step_only():
    draw = extra_prompts(50, 6, 42, 0, 7)
    assert draw == extra_prompts(50, 6, 42, 0, 7)  # a resume or rollback to step 7 draws them again
    assert len(set(draw)) == 6 and all(0 <= i < 50 for i in draw)
    assert draw != extra_prompts(50, 6, 42, 1, 7)  # another rank
    assert draw != extra_prompts(50, 6, 42, 0, 8)  # the next generation
    assert draw != extra_prompts(50, 6, 43, 0, 7)
    small = extra_prompts(3, 7, 0, 0, 0)  # fewer rows than asked: each is drawn before any repeats
    assert len(small) == 7 and set(small[:3]) == {0, 1, 2}


def test_extra_groups_follow_the_oversample_factor():
    assert [extra_groups(4, f) for f in (2.0, 1.5, 3.0, 1.01)] == [4, 2, 8, 1]


@pytest.mark.parametrize(
    "assignments, names",
    [
        (["train.dynamic_sampling.oversample=1"], "train.dynamic_sampling.oversample: Input should be greater than 1"),
        (
            ["train.dynamic_sampling.oversample=0.5"],
            "train.dynamic_sampling.oversample: Input should be greater than 1",
        ),
        (
            ["train.dynamic_sampling.oversample=lots"],
            "train.dynamic_sampling.oversample: Input should be a valid number",
        ),
        (["train.dynamic_sampling.enabled=perhaps"], "train.dynamic_sampling.enabled: Input should be a valid boolean"),
        (["train.dynamic_sampling.oversampling=2"], "train.dynamic_sampling.oversampling: unknown key"),
        (
            # two processes of 2 completions: whole groups of 4 globally (TRL's rule), half a group on each process
            [
                "train.dynamic_sampling.enabled=true",
                "train.distributed.processes_per_node=2",
                "train.grpo.num_generations=4",
                "train.grpo.per_device_train_batch_size=2",
            ],
            "train.dynamic_sampling needs whole groups on each process: per_device_train_batch_size x "
            "steps_per_generation = 2 x 1 = 2 completions is not a multiple of num_generations (4): set "
            "train.grpo.per_device_train_batch_size=4, or train.dynamic_sampling.enabled=false",
        ),
    ],
)
def test_a_bad_dynamic_sampling_setting_names_the_field_and_exits_2(assignments, names):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*assignments, "train.grpo.max_steps=10"])
    assert names in str(caught.value)
    if len(assignments) == 1:  # the CLI checks each --set on its own to name the one at fault
        result = CliRunner().invoke(app, ["plan", "--json", "--set", assignments[0]])
        assert result.exit_code == 2 and f"--set {assignments[0]}: " in result.output and names in result.output


def test_the_same_batch_on_one_process_is_whole_groups():
    cfg = load_config(
        None,
        [
            "train.dynamic_sampling.enabled=true",
            "train.grpo.num_generations=4",
            "train.grpo.per_device_train_batch_size=4",
        ],
    )
    assert cfg.train.dynamic_sampling.enabled and cfg.train.dynamic_sampling.oversample == 2.0
