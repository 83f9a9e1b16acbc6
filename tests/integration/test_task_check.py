"""The task check on the tiny random model: a task made trivially easy (every completion right) is already_solved, one
made impossible (none right) is too_hard, through the CLI (`task check --json`, exit 0 for both) and in a run, which
refuses the impossible one before training (exit 2). A rerun reads the cache; a corrupt entry is measured again."""

import json
import logging
import os
from pathlib import Path

import pytest

from grpo_pipeline.configs.schema import load_config
from tests.integration.test_flow import _cli, tiny_yaml  # noqa: F401  (tiny_yaml: the fixture)

# `make test-slow`: CLI processes and a run on the tiny model, over a minute in all; the verdict rule, its interval and
# cache are unit-tested in tests/unit/test_task_check.py, and the run's check stage in test_flow.py
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RIGHT = "tests.integration.check_rewards:always_right"
WRONG = "tests.integration.check_rewards:never_right"


def _env():
    """The reward's module importable from the test's own working directory."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.parametrize(("reward", "verdict"), [(RIGHT, "already_solved"), (WRONG, "too_hard")])
def test_task_check_json_through_the_cli(tmp_path, tiny_yaml, reward, verdict):  # noqa: F811
    proc = _cli(
        "task",
        "check",
        "--config",
        str(tiny_yaml),
        "--json",
        "--prompts",
        "6",
        "--set",
        f"train.rewards=[{reward}]",
        cwd=tmp_path,
        prefect_home=tmp_path / "prefect",
        extra_env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # a report: every verdict exits 0
    check = json.loads(proc.stdout)
    assert check["status"] == "completed" and check["verdict"] == verdict, check
    assert check["skill"] == reward and check["fixes"]
    # the tiny config's val split holds 4 rows: topped up from train, and said so
    assert (check["prompts"], check["prompts_from_val"], check["prompts_from_train"]) == (6, 4, 2)
    assert "topped up" in check["note"]
    assert check["samples"] == 6 * 4 and check["num_generations"] == 4 and check["max_completion_length"] == 6
    assert check["accuracy"] == (1.0 if reward == RIGHT else 0.0) and check["mixed_fraction"] == 0.0
    assert check["splits"] == {"train": 32, "val": 4, "holdout": 6} and check["rows_kept"] == 42
    assert check["estimate"]["steps"] == 2 and check["estimate"]["seconds"] > 0
    assert check["tokens_per_second"] > 0


def test_bad_input_exits_2_naming_it(tmp_path, tiny_yaml):  # noqa: F811
    proc = _cli(
        "task",
        "check",
        "--config",
        str(tiny_yaml),
        "--json",
        "--set",
        f"model.base={tmp_path / 'no-such-model'}",
        cwd=tmp_path,
        prefect_home=tmp_path / "prefect",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    failure = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failure["status"] == "failed" and "model.base" in failure["error"]


def test_a_rerun_reads_the_cache_and_a_corrupt_entry_is_measured_again(tmp_path, tiny_yaml):  # noqa: F811
    from grpo_pipeline.tasks.check import cache_dir, run_check
    from grpo_pipeline.tasks.data.stage import build_dataset

    cfg = load_config(tiny_yaml, ["check.prompts=3"])
    rewards = cfg.train.reward_set()
    version = build_dataset(cfg.data, cfg.data_dir / "datasets", cfg.model.base, rewards)
    args = (version, cfg.model.base, cfg.model, rewards, cfg.train, cfg.check, cache_dir(cfg.data_dir))
    first = run_check(*args)
    assert not first.cached and first.verdict == "too_hard"  # a random model is never right by correct_answer
    (entry,) = cache_dir(cfg.data_dir).glob("*.json")
    again = run_check(*args)
    assert again.cached and again.model_copy(update={"cached": False}) == first
    longer = run_check(*args[:4], cfg.train.model_copy(update={"grpo": cfg.train.grpo | {"max_steps": 4}}), *args[5:])
    assert longer.cached and longer.estimate.seconds == pytest.approx(2 * first.estimate.seconds)  # recomputed
    entry.write_text("{not json")
    # Prefect's logging set-up replaces the root's handlers (caplog's too): a handler of the test's own
    warned: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warned.append  # type: ignore[method-assign]
    logging.getLogger("grpo_pipeline.tasks.check").addHandler(handler)
    try:
        remeasured = run_check(*args)
    finally:
        logging.getLogger("grpo_pipeline.tasks.check").removeHandler(handler)
    assert not remeasured.cached
    assert any("ignoring the unreadable cache entry" in r.getMessage() for r in warned)
    assert remeasured.accuracy == first.accuracy and remeasured.mixed_fraction == first.mixed_fraction  # seeded
    other_seed = run_check(*args[:5], cfg.check.model_copy(update={"seed": 1}), args[6])
    assert not other_seed.cached
    assert len(list(cache_dir(cfg.data_dir).glob("*.json"))) == 2


def test_the_run_refuses_a_task_too_hard_before_training(tmp_path, tiny_yaml):  # noqa: F811
    proc = _cli(
        "run",
        "--config",
        str(tiny_yaml),
        "--json",
        "--set",
        "check.on_too_hard=refuse",
        cwd=tmp_path,
        prefect_home=tmp_path / "prefect",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    failure = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failure["status"] == "failed" and "too_hard" in failure["error"]
    assert "check.on_too_hard=warn" in failure["error"] and "base model" in failure["error"]
    assert "task check: too_hard" in proc.stdout + proc.stderr  # the verdict line, printed by the stage
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'data' / 'mlflow.db'}")
    runs = {r.info.run_name: r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])}
    assert "train" not in runs and "evaluate-base" not in runs, "nothing was trained or evaluated"
    stage = runs["task-check"]
    assert stage.data.tags["task_check.verdict"] == "too_hard"
    assert stage.data.metrics["task_check/accuracy"] == 0.0 and "task_check/mixed_ci_high" in stage.data.metrics
