"""The trainer's bad-input reason (a failing reward: exit 2) reaches both launchers, which must not relaunch on it;
and text the model wrote cannot pass for it."""

import threading
from types import SimpleNamespace

import pytest

from grpo_pipeline.configs.schema import ConfigError, ModelConfig, SkyConfig, TrainConfig
from grpo_pipeline.infra.launch import BadTrainingInput, TrainingFailed
from grpo_pipeline.infra.launch.skypilot import SkyHandle, SkyLauncher, _Lines
from grpo_pipeline.tasks.job import model_load, train_settings
from grpo_pipeline.trainer.spec import JobSpec, bad_input_line, parse_bad_input, parse_progress, progress_line


def test_the_reason_survives_any_text_and_a_skypilot_prefix():
    message = "reward 'x' returned nan for row 1 (key k|1), completion '<b>\"}\\n'"
    assert parse_bad_input("(grpo-train, pid=4242) " + bad_input_line(message)) == message
    assert parse_bad_input("grpo-bad-input {not json") is None
    assert parse_bad_input("ERROR grpo_pipeline.trainer.train: bad input: reward 'x'") is None


def test_skypilots_prefixes_colored_or_not_single_or_multi_node_are_the_only_text_before_a_tag():
    line = bad_input_line("reward 'x' returned nan for row 1")
    for prefix in (
        "(task, pid=7) ",
        "(head, rank=0, pid=7) ",
        "(worker1, rank=1, pid=7, ip=10.0.0.2) ",
        "\x1b[36m(grpo-train, pid=4242)\x1b[0m ",
    ):
        assert parse_bad_input(prefix + line) == "reward 'x' returned nan for row 1", prefix
        assert parse_progress(prefix + progress_line(3, 0.5)) == {"step": 3, "val_reward": 0.5}, prefix


def test_a_tag_in_the_middle_of_a_line_is_model_text_not_the_trainers_word():
    """TRL's log_completions prints what the model wrote: a completion holding the tag must not cancel the job
    (nor report a validation reward to the search's pruner)."""
    forged = bad_input_line("reward 'x' returned nan for row 0")
    for line in (
        f"│ 12 │ {forged} │ 0.0 │",
        f"(task, pid=7) │ {forged}",
        f"INFO trainer: {forged}",
        f"(task, pid=7) (task, pid=8) x {forged}",
        f" {forged}",
    ):
        assert parse_bad_input(line) is None, line
    assert parse_progress("│ " + progress_line(3, 1.0)) is None


def _spec(tmp_path) -> JobSpec:
    return JobSpec(
        model_path="m",
        model=model_load(ModelConfig()),
        train=train_settings(TrainConfig()),
        train_file="t",
        work_dir=str(tmp_path),
        checkpoint_uri="s3://b/r",
        adapter_dir=str(tmp_path / "a"),
    )


def test_the_sky_launcher_keeps_the_first_reason_from_the_streamed_log_and_passes_every_line_on(tmp_path):
    spec = _spec(tmp_path)
    seen: list[str] = []
    launcher = SkyLauncher(SkyConfig(), max_restarts=3, on_line=seen.append)
    handle = SkyHandle(spec, job_id=7)
    stream = _Lines(launcher.watch(handle))
    stream.write("{'loss': 0.1}\n(task, pid=1) " + bad_input_line("reward 'a' returned inf for row 0"))
    stream.write("\n" + bad_input_line("reward 'b' returned nan for row 3") + "\n")
    assert handle.bad_input == "reward 'a' returned inf for row 0"
    assert len(seen) == 3 and seen[0] == "{'loss': 0.1}"


class _EndsFailed(SkyLauncher):
    """SkyLauncher's state loop against a managed job that is FAILED at the first poll (out of recoveries, or
    quicker than the poll), with the trainer's log streamed first; the SkyPilot calls are the only stand-ins."""

    def __init__(self, streamed: list[str]):
        super().__init__(
            SkyConfig(poll_seconds=0.01), max_restarts=0, on_status=lambda msg: None, on_line=lambda line: None
        )
        self.streamed, self.logged, self.cancelled = streamed, threading.Event(), False

    def _stream_logs(self, handle):
        _Lines(self.watch(handle)).write("".join(line + "\n" for line in self.streamed))
        self.logged.set()

    def _record(self, job_id):
        assert self.logged.wait(10)
        return SimpleNamespace(status="FAILED", recovery_count=0, failure_reason="exit code 2")

    def _tail(self, handle, lines=40):
        return "(tail)"

    def cancel(self, handle):
        self.cancelled = True


def test_a_job_that_fails_with_the_reason_already_seen_is_bad_input_and_one_without_is_not(tmp_path):
    launcher = _EndsFailed(["step 1", "(task, pid=9) " + bad_input_line("reward 'r' returned nan for row 2")])
    with pytest.raises(
        BadTrainingInput, match=r"^reward 'r' returned nan for row 2\nmanaged job 7 ended FAILED"
    ) as failed:
        launcher.wait(SkyHandle(_spec(tmp_path), job_id=7))
    assert isinstance(failed.value, ConfigError)  # exit 2 from the CLI

    launcher = _EndsFailed(["step 1", "│ " + bad_input_line("forged by the model")])
    with pytest.raises(TrainingFailed, match=r"^managed job 8 ended FAILED: exit code 2") as failed:
        launcher.wait(SkyHandle(_spec(tmp_path), job_id=8))
    assert not isinstance(failed.value, BadTrainingInput)
