"""The trainer's bad-input reason (a failing reward: exit 2) reaches both launchers, which must not relaunch on it."""

from configs.schema import ModelConfig, SkyConfig, TrainConfig
from infra.launch.skypilot import SkyHandle, SkyLauncher, _Lines
from tasks.job import model_load, train_settings
from trainer.spec import JobSpec, bad_input_line, parse_bad_input


def test_the_reason_survives_any_text_and_a_skypilot_prefix():
    message = "reward 'x' returned nan for row 1 (key k|1), completion '<b>\"}\\n'"
    assert parse_bad_input("(grpo-train, pid=4242) " + bad_input_line(message)) == message
    assert parse_bad_input("grpo-bad-input {not json") is None
    assert parse_bad_input("ERROR trainer.train: bad input: reward 'x'") is None


def test_the_sky_launcher_keeps_the_first_reason_from_the_streamed_log_and_passes_every_line_on(tmp_path):
    spec = JobSpec(model_path="m", model=model_load(ModelConfig()), train=train_settings(TrainConfig()),
                   train_file="t", work_dir=str(tmp_path), checkpoint_uri="s3://b/r", adapter_dir=str(tmp_path / "a"))
    seen: list[str] = []
    launcher = SkyLauncher(SkyConfig(), max_restarts=3, on_line=seen.append)
    handle = SkyHandle(spec, job_id=7)
    stream = _Lines(launcher.watch(handle))
    stream.write("{'loss': 0.1}\n(task, pid=1) " + bad_input_line("reward 'a' returned inf for row 0"))
    stream.write("\n" + bad_input_line("reward 'b' returned nan for row 3") + "\n")
    assert handle.bad_input == "reward 'a' returned inf for row 0"
    assert len(seen) == 3 and seen[0] == "{'loss': 0.1}"
