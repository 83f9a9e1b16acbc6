"""The curriculum's selection logic (`grpo_pipeline.trainer.sampling`): TRL's order until a prompt recurs, benched
prompts passed over and brought back by the cap, the same decisions on every rank, and a resume that continues
as the uninterrupted run would have."""

import json

import pytest

from grpo_pipeline.configs.sampling import CurriculumConfig
from grpo_pipeline.configs.schema import ConfigError, load_config
from grpo_pipeline.trainer.sampling import Curriculum, curriculum_sampler, summarize


def _curriculum(n=10, batch_size=2, seed=3, shuffle=True, **settings) -> Curriculum:
    return Curriculum(n=n, batch_size=batch_size, seed=seed, settings=CurriculumConfig(**settings), shuffle=shuffle)


def _observe_all(c: Curriculum, chunk: list[int], zero: set[int]) -> None:
    c.observe([(i, i in zero) for i in chunk])


def test_with_nothing_benched_the_stream_is_trls_repeat_sampler():
    from trl.trainer.utils import RepeatSampler

    ours = curriculum_sampler(_curriculum(n=11, batch_size=3, seed=7), mini_repeat_count=4, repeat_count=2)
    theirs = RepeatSampler(list(range(11)), mini_repeat_count=4, batch_size=3, repeat_count=2, seed=7)
    for _epoch in range(3):  # each epoch a new permutation, the incomplete last chunk dropped, as TRL does
        assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)


def test_a_prompt_without_variance_sits_out_at_most_max_skips_passes_then_returns():
    c = _curriculum(n=4, batch_size=2, shuffle=False, max_skips=2)
    for chunk in c.epoch_chunks(0):
        _observe_all(c, chunk, zero={0})  # prompt 0: every completion got the same reward
    assert c.benched(0) and not c.benched(1)
    drawn = []
    for epoch in (1, 2, 3):
        for chunk in c.epoch_chunks(epoch):
            drawn.append(chunk)
            _observe_all(c, chunk, zero=set())  # when 0 is drawn again, it now has variance: back for good
    flat = [i for chunk in drawn for i in chunk]
    assert drawn[:2] == [[1, 2], [3, 1]]  # passed over twice: epoch 1's pass, then the pass that tops it up
    assert flat.index(0) == 4 and c.skipped_total == 2 and not c.benched(0)
    assert flat.count(0) == 2  # back at TRL's rate afterwards: once per epoch (2 and 3)


def test_a_prompt_that_still_has_no_variance_when_it_returns_is_benched_again():
    c = _curriculum(n=4, batch_size=2, shuffle=False, max_skips=2)
    seen = []
    for epoch in range(6):
        for chunk in c.epoch_chunks(epoch):
            seen += [epoch] * chunk.count(0)
            _observe_all(c, chunk, zero={0})
    assert seen == [0, 2, 4]  # down-weighted, never dropped: the cap brings it back every third pass
    assert c.streak[0] == 3


def test_patience_waits_for_that_many_zero_variance_groups_in_a_row():
    c = _curriculum(patience=2)
    c.observe([(5, True)])
    assert not c.benched(5)
    c.observe([(5, False)])  # a group with variance resets the streak
    c.observe([(5, True)])
    assert not c.benched(5)
    c.observe([(5, True)])
    assert c.benched(5)


def test_every_rank_draws_the_same_chunks_from_the_same_observations():
    """Each rank holds its own Curriculum and sees the same gathered rewards (TRL gathers them before it
    normalizes groups): their draws must agree chunk by chunk, or a group would be split across prompts."""
    ranks = [_curriculum(n=20, batch_size=4, seed=1) for _ in range(2)]
    for epoch in range(4):
        streams = [c.epoch_chunks(epoch) for c in ranks]
        for chunks in zip(*streams, strict=True):
            assert chunks[0] == chunks[1]
            for c in ranks:
                _observe_all(c, chunks[0], zero={i for i in chunks[0] if i % 3 == 0})
    assert ranks[0].state() == ranks[1].state() and ranks[0].skipped_total > 0


def test_a_resumed_run_replays_its_epochs_chunks_and_continues_as_the_uninterrupted_one():
    """HF's resume re-iterates the epoch's data loader and skips the batches already trained; the saved state
    (through JSON, as in curriculum.json) replays them, then draws what the uninterrupted run drew."""
    zero = {1, 4, 7}

    def train(c, epochs, skip_in_first=0, stop_after=None):
        drawn = []
        for n, epoch in enumerate(epochs):
            for chunk in _skipping(c.epoch_chunks(epoch), skip_in_first if n == 0 else 0):
                drawn.append(chunk)
                _observe_all(c, chunk, zero)
                if len(drawn) == stop_after:
                    return drawn
        return drawn

    whole = train(_curriculum(n=12, batch_size=3, seed=5), range(4))
    assert any(len(set(chunk)) == 3 and not set(chunk) & zero for chunk in whole[4:])  # the curriculum acted
    first = _curriculum(n=12, batch_size=3, seed=5)
    before = train(first, range(4), stop_after=9)  # stops mid-epoch 2 (4 chunks per epoch), after its first chunk
    saved = json.loads(json.dumps(first.state()))

    resumed = _curriculum(n=12, batch_size=3, seed=5)
    resumed.load(saved)
    after = train(resumed, (2, 3), skip_in_first=1)  # HF skips the epoch's chunk trained before the save
    assert before + after == whole


def _skipping(chunks, n):
    for i, chunk in enumerate(chunks):
        if i >= n:
            yield chunk


def test_a_chunk_drawn_after_the_save_is_replayed_not_redrawn():
    """The data loader draws one batch ahead: a checkpoint's state can hold a chunk not yet trained, which the
    resumed run must train (HF skips only the chunks of steps already taken)."""
    c = _curriculum(n=12, batch_size=3, seed=5)
    chunks = c.epoch_chunks(0)
    trained = next(chunks)
    prefetched = next(chunks)
    resumed = _curriculum(n=12, batch_size=3, seed=5)
    resumed.load(json.loads(json.dumps(c.state())))
    assert list(resumed.epoch_chunks(0))[:2] == [trained, prefetched]


def test_a_state_for_other_data_is_not_replayed():
    c = _curriculum(n=10)
    c.observe([(3, True)])
    list(c.epoch_chunks(0))
    other = _curriculum(n=12)
    other.load(c.state())
    assert other.drawn == [] and other.streak == {}


def test_summary_counts_wasted_steps_from_the_log_history():
    history = [
        {"step": 1, "frac_reward_zero_std": 0.0, "loss": 0.1},
        {"step": 2, "frac_reward_zero_std": 1.0},
        {"step": 3, "frac_reward_zero_std": 0.5},
        {"step": 3, "train_runtime": 9.0},
    ]
    c = _curriculum()
    c.observe([(2, True)])
    summary = summarize(history, c)
    assert (summary.wasted_steps, summary.logged_steps, summary.benched_prompts) == (1, 3, 1)
    assert summary.mean_fraction == pytest.approx(0.5)
    assert summarize([{"step": 1, "loss": 0.1}], None) is None


@pytest.mark.parametrize(
    "assignment, names",
    [
        ("train.curriculum.max_skips=0", "train.curriculum.max_skips: Input should be greater than or equal to 1"),
        ("train.curriculum.patience=soon", "train.curriculum.patience: Input should be a valid integer"),
        ("train.curriculum.skip=true", "train.curriculum.skip: unknown key"),
    ],
)
def test_a_bad_curriculum_setting_names_the_field(assignment, names):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [assignment, "train.grpo.max_steps=10"])
    assert names in str(caught.value)
