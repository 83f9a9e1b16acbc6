"""A reward that fails on the node is bad input: exit 2 at the first step, the reward and the row named,
and no relaunch (a relaunch would fail the same way and spend the restart budget). The reward's argument comes
from its `train.rewards` entry, so this also shows the trainer binding them. A reward whose service is down (a real
HTTP server on 127.0.0.1 answering 500) is not: exit 1, relaunched, as a preemption would be."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import mlflow
import pytest

from grpo_pipeline.configs.schema import ConfigError
from grpo_pipeline.infra.launch import BadTrainingInput, TrainingFailed
from grpo_pipeline.infra.launch.local import LocalLauncher
from grpo_pipeline.tasks.job import build_job_spec
from grpo_pipeline.trainer.rewards import RewardError, RewardUnavailable, resolve_reward

pytestmark = pytest.mark.integration

BROKEN = "tests.integration.broken_reward:nan_on_row"


def _launch(cfg, tmp_path, tiny_model, tiny_splits):
    """The job on the local launcher with the config's restart budget, its own MLflow store, stdout dropped."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = build_job_spec(cfg.train, cfg.model, str(tiny_model), tiny_splits, tmp_path / "run", mlflow_tracking_uri=uri)
    launcher = LocalLauncher(max_restarts=cfg.train.max_restarts, on_line=lambda line: None)
    return launcher, launcher.launch(spec), spec, mlflow.MlflowClient(uri)


def _runs(client):
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.slow
def test_a_reward_that_returns_nan_fails_once_with_exit_2_naming_the_reward_and_row(
    tmp_path, tiny_model, tiny_splits, tiny_config
):
    cfg = tiny_config(
        f"train.rewards=[{{name: '{BROKEN}', args: {{row: 2}}}}]",
        "train.grpo.max_steps=3",
        "train.max_restarts=3",
    )
    launcher, handle, spec, client = _launch(cfg, tmp_path, tiny_model, tiny_splits)
    with pytest.raises(BadTrainingInput) as failed:  # a TrainingFailed, and a ConfigError: exit 2 from the CLI
        launcher.wait(handle)
    assert isinstance(failed.value, ConfigError)

    message = str(failed.value)
    assert "trainer exited with code 2 (bad input: not relaunched) after 0 restart(s)" in message
    assert message.startswith(f"reward '{BROKEN}' returned nan for row 2 (key ")  # the reason first
    assert handle.restarts == 0
    log = (Path(spec.work_dir) / "trainer.log").read_text()
    assert log.count("bad input: reward") == 1  # one attempt, not max_restarts + 1
    assert not (Path(spec.work_dir) / "result.json").exists()
    (run,) = _runs(client)
    assert run.info.status == "FAILED"
    assert run.data.tags["failure"].startswith(f"reward '{BROKEN}' returned nan for row 2")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_reward_that_fails_on_rank_1_alone_still_ends_the_run_failed_with_the_reason(
    tmp_path, tiny_model, tiny_splits, tiny_config
):
    """Rank 0 never sees rank 1's reward fail (it waits in the gather, until torchrun stops it): rank 1, which
    knows why, ends the MLflow run FAILED with the reason, and the job is bad input all the same."""
    on_rank = "tests.integration.broken_reward:nan_on_rank"
    cfg = tiny_config(
        f"train.rewards=['{on_rank}']",
        "train.grpo.max_steps=3",
        "train.max_restarts=1",
        "train.distributed.processes_per_node=2",
        "train.distributed.timeout_s=60",
        "train.grpo.per_device_train_batch_size=2",
    )
    launcher, handle, spec, client = _launch(cfg, tmp_path, tiny_model, tiny_splits)
    with pytest.raises(BadTrainingInput) as failed:
        launcher.wait(handle)
    assert str(failed.value).startswith(f"reward '{on_rank}' returned nan for row 0")
    assert handle.restarts == 0
    (run,) = _runs(client)
    assert run.info.status == "FAILED"
    assert run.data.tags["failure"].startswith(f"reward '{on_rank}' returned nan for row 0")


class _Down(BaseHTTPRequestHandler):
    """A grader in an outage: every request answers 500."""

    calls = 0

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls += 1
        self.send_error(500, "grader restarting")


@pytest.fixture()
def grader_down():
    _Down.calls = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Down)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/score"
    httpd.shutdown()
    httpd.server_close()


def test_a_grader_outage_is_retryable_not_bad_input(grader_down):
    """remote_verifier's service answering 500 through its retries is an outage: RewardUnavailable (exit 1, a
    relaunch resumes), while a NaN from the same reward path stays bad input (exit 2)."""
    fn = resolve_reward("remote_verifier", {"url": grader_down, "retries": 1, "backoff_s": 0.0})
    with pytest.raises(
        RewardUnavailable,
        match=r"'remote_verifier' at .*/score failed for row 0 of 1: HTTP 500 "
        r".*\(after 2 attempts\)",
    ):
        fn(["72"], answer=["72"])
    assert _Down.calls == 2
    with pytest.raises(RewardError) as nan:
        resolve_reward(BROKEN, {"row": 0})(["72"])
    assert not isinstance(nan.value, RewardUnavailable)


@pytest.mark.slow
def test_the_trainer_exits_1_on_a_grader_outage_and_is_relaunched(
    tmp_path, tiny_model, tiny_splits, tiny_config, grader_down
):
    args = f"{{url: '{grader_down}', retries: 1, backoff_s: 0.0, batch_size: 64}}"
    cfg = tiny_config(
        f"train.rewards=[{{name: remote_verifier, args: {args}}}]",
        "train.grpo.max_steps=3",
        "train.max_restarts=1",
    )
    launcher, handle, spec, client = _launch(cfg, tmp_path, tiny_model, tiny_splits)
    with pytest.raises(TrainingFailed) as failed:
        launcher.wait(handle)
    assert not isinstance(failed.value, ConfigError)  # exit 1 from the CLI, not 2
    assert "trainer exited with code 1 after 1 restart(s)" in str(failed.value)
    assert handle.restarts == 1  # relaunched: the outage may be over by then
    log = (Path(spec.work_dir) / "trainer.log").read_text()
    assert log.count("reward unavailable (exit 1") == 2
    assert "grpo-bad-input" not in log
    assert _Down.calls == 4  # each attempt: one chunk, tried twice
    runs = _runs(client)
    assert runs and all("failure" not in r.data.tags and r.info.status != "FAILED" for r in runs)
