"""A reward that fails on the node is bad input: exit 2 at the first step, the reward and the row named,
and no relaunch (a relaunch would fail the same way and spend the restart budget). The reward's argument comes
from `train.reward_args`, so this also shows the trainer binding them."""

from pathlib import Path

import mlflow
import pytest

from configs.schema import ConfigError
from infra.launch import BadTrainingInput
from infra.launch.local import LocalLauncher
from tasks.job import build_job_spec

pytestmark = pytest.mark.integration

BROKEN = "tests.integration.broken_reward:nan_on_row"


def test_a_reward_that_returns_nan_fails_once_with_exit_2_naming_the_reward_and_row(tmp_path, tiny_model,
                                                                                      tiny_splits, tiny_config):
    cfg = tiny_config(f"train.rewards=['{BROKEN}']", f"train.reward_args={{'{BROKEN}': {{row: 2}}}}",
                      "train.grpo.max_steps=3", "train.max_restarts=3")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = build_job_spec(cfg.train, cfg.model, str(tiny_model), tiny_splits, tmp_path / "run", mlflow_tracking_uri=uri)
    launcher = LocalLauncher(max_restarts=3, on_line=lambda line: None)
    handle = launcher.launch(spec)
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
    (run,) = mlflow.MlflowClient(uri).search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(uri).search_experiments()])
    assert run.info.status == "FAILED"
    assert run.data.tags["failure"].startswith(f"reward '{BROKEN}' returned nan for row 2")
