"""What users see while a run works: the trainer's one line per log, the parent's step x/N with the time
left, and evaluation progress with a total and an ETA. Clocks are injected; HF's own callback machinery is
real (no model needed). And what `deploy` shows while it registers."""

import io
import os
import select

import pytest

from grpo_pipeline.tasks.evaluate import EvalProgress, eval_bar
from grpo_pipeline.tasks.job import TrainProgress
from grpo_pipeline.trainer.callbacks import print_logs_once, step_log_line


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_progress_reads_the_step_the_trainer_prints_not_a_count_of_lines():
    clock = Clock(1000.0)
    progress = TrainProgress(clock=clock)
    # logging_steps=10, resumed from checkpoint 20: the first line this process sees is step 30
    assert progress.update(step_log_line({"loss": 0.1, "reward": 0.5}, 30, 100)).startswith("step 30/100 (30%), ETA --")
    clock.now += 50.0
    line = progress.update(
        "(grpo-train, pid=7) " + step_log_line({"loss": 0.1, "reward": 0.6}, 40, 100)
    )  # SkyPilot's prefix
    assert line.startswith("step 40/100 (40%), 0.20 steps/s, ETA 5m 0s"), line


def test_a_non_finite_value_does_not_lose_the_step():
    line = step_log_line({"loss": float("nan"), "reward": float("inf"), "grad_norm": 1.5}, 3, 8)
    assert TrainProgress(clock=Clock()).update(line).startswith("step 3/8 (38%)")


def test_evaluation_and_summary_logs_are_not_steps():
    progress = TrainProgress(clock=Clock())
    assert progress.update(step_log_line({"eval_reward": 0.4, "eval_loss": 0.1}, 5, 8)) is None
    assert progress.update(step_log_line({"train_runtime": 12.0, "train_loss": 0.1}, 8, 8)) is None


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_each_log_is_printed_once_with_its_step(tmp_path, capsys, disable_tqdm):
    """HF prints each log itself (PrinterCallback, or its tqdm bar's copy); after print_logs_once only
    StepLog does, through HF's real callback handler."""
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, PrinterCallback, ProgressCallback

    handler = CallbackHandler(
        [DefaultFlowCallback, PrinterCallback if disable_tqdm else ProgressCallback], None, None, None, None
    )
    print_logs_once(handler)  # the Trainer's add/pop/remove_callback are its handler's
    args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=disable_tqdm, use_cpu=True, report_to=[])
    state, control = TrainerState(global_step=0, max_steps=4), TrainerControl()
    handler.on_train_begin(args, state, control)
    for step in (1, 2):
        state.global_step = step
        handler.on_log(args, state, control, {"loss": 0.5, "reward": 0.25, "total_flos": 1.0})
    handler.on_train_end(args, state, control)

    logs = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert logs == [
        "{'loss': 0.5, 'reward': 0.25, 'step': 1, 'max_steps': 4}",
        "{'loss': 0.5, 'reward': 0.25, 'step': 2, 'max_steps': 4}",
    ]


def test_tqdm_is_off_in_a_log_and_on_at_a_terminal_unless_the_user_says(monkeypatch, trainer_args):
    args = trainer_args

    monkeypatch.setattr("sys.stderr", io.StringIO())  # a pipe or a file
    assert args().disable_tqdm is True
    assert args("train.grpo.disable_tqdm=false").disable_tqdm is False
    primary, secondary = os.openpty()  # a real terminal
    with open(secondary, "w") as terminal:
        monkeypatch.setattr("sys.stderr", terminal)
        assert args().disable_tqdm is False
        assert args("train.grpo.disable_tqdm=true").disable_tqdm is True
    os.close(primary)


def test_evaluation_lines_come_at_each_tenth_with_the_time_left():
    clock = Clock()
    progress = EvalProgress("evaluating champion v3", total=100, clock=clock)
    lines = []
    for _ in range(25):  # batches of 4 prompts, 2 s each
        clock.now += 2.0
        lines.append(progress.advance(4))
    shown = [line for line in lines if line]
    assert len(shown) == 10
    assert shown[0] == "evaluating champion v3: 12/100 (12%), 2.00 prompts/s, ETA 44s"
    assert shown[-1] == "evaluating champion v3: 100/100 (100%), 2.00 prompts/s, done in 50s"


def test_the_bar_has_a_total_and_knows_the_time_left_after_one_slow_batch():
    """rich's default speed window (30 s) holds no rate when a batch takes longer: ETA -:--:--."""
    from rich.console import Console

    clock = Clock(500.0)
    bar, task_id = eval_bar("evaluating base", 32, console=Console(file=io.StringIO()), get_time=clock)
    clock.now += 40.0  # one batch of 8 prompts on a slow CPU
    bar.advance(task_id, 8)
    task = bar.tasks[0]
    assert (task.description, task.total) == ("evaluating base", 32)
    assert task.time_remaining == pytest.approx(120.0)


def read_until(primary: int, wanted: str, quiet_s: float = 10.0) -> str:
    """What the terminal was sent, read until `wanted` shows or nothing more comes for `quiet_s`.

    The kernel hands a pty's output to its reader in chunks, on its own schedule: one read can return
    the bar's first frame while the last is still on its way, so a single read flakes on a busy machine.
    """
    drawn = b""  # decoded once at the end: a chunk may end inside a character of the bar (3 bytes each)
    while wanted.encode() not in drawn:
        readable, _, _ = select.select([primary], [], [], quiet_s)
        if not readable:
            break
        try:
            drawn += os.read(primary, 65536)
        except OSError:  # EIO: the terminal side is closed and all it was sent is read
            break
    return drawn.decode(errors="replace")


def test_evaluation_progress_is_lines_in_a_log_and_a_bar_at_a_terminal(monkeypatch):
    """The same test of "a person sees it" as the trainer's (grpo_pipeline.trainer.callbacks.interactive)."""
    from grpo_pipeline.tasks.evaluate import progress

    log = io.StringIO()  # a pipe or a file
    monkeypatch.setattr("sys.stderr", log)
    with progress("evaluating base", total=4) as advance:
        advance(4)
    assert log.getvalue().startswith("evaluating base: 4/4 (100%)")
    primary, secondary = os.openpty()  # a real terminal
    with open(secondary, "w") as terminal:
        monkeypatch.setattr("sys.stderr", terminal)
        with progress("evaluating base", total=4) as advance:
            assert advance(4) is None  # rich's bar, no line
    monkeypatch.undo()
    drawn = read_until(primary, "4/4")
    os.close(primary)
    assert "evaluating base" in drawn and "4/4" in drawn


def test_deploy_names_each_step_on_stderr_and_keeps_stdout_for_its_json(tmp_path, monkeypatch):
    """`grpo-pipeline deploy` works for a minute (`prefect deploy` alone takes tens of seconds): never silent, and
    its stdout stays the JSON summary. The server's side is stubbed; the steps and the command are real."""
    import json

    from typer.testing import CliRunner

    from grpo_pipeline.cli import app
    from grpo_pipeline.flows import deploy

    monkeypatch.setattr(deploy, "check_server", lambda: "http://127.0.0.1:4200/api")
    monkeypatch.setattr(deploy, "ensure_work_pool", lambda name: ("process", []))
    monkeypatch.setattr(deploy, "register", lambda spec, workdir: "")
    monkeypatch.setattr(deploy, "deployments_summary", lambda: {"manual": {}})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["deploy", "--set", f"data_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["deployments"] == {"manual": {}}
    done = [line.rpartition(" (")[0] for line in result.stderr.splitlines() if line.endswith(" s)")]
    assert done == ["Prefect server answered", "work pool grpo-process ready", "deployments registered"]
