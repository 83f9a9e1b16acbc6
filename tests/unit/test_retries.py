"""The registry tasks' one retry policy (flows/retries.py): a service that did not answer is retried, a decision
(the aliases moved, the registry's lock held or lost) never is; each registry task of both flows is under it."""

import pytest
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed

from grpo_pipeline.flows.ab import decide_task, settle_round_task
from grpo_pipeline.flows.retries import retry_service_errors
from grpo_pipeline.flows.stages.evaluate import fetch_champion_task
from grpo_pipeline.flows.stages.promote import register_task, settle_promotion_task
from grpo_pipeline.tasks.promote.registry import ChampionMoved, LockLost, RegistryError
from grpo_pipeline.tasks.serve.ab import AliasesMoved


@pytest.mark.parametrize(
    "error",
    [ChampionMoved("champion is v3 now"), AliasesMoved("challenger moved"), RegistryError("locked"), LockLost("lost")],
    ids=lambda e: type(e).__name__,
)
def test_a_decision_is_not_retried(error):
    assert retry_service_errors(None, None, Failed(data=error)) is False


@pytest.mark.parametrize("error", [ConnectionError("refused"), TimeoutError("slow"), OSError("reset")])
def test_a_service_that_did_not_answer_is_retried(error):
    assert retry_service_errors(None, None, Failed(data=error)) is True


def test_a_run_that_did_not_fail_is_not_retried():
    assert retry_service_errors(None, None, Completed(data=1)) is False


@pytest.mark.parametrize(
    "registry_task",
    [decide_task, settle_round_task, settle_promotion_task, register_task, fetch_champion_task],
    ids=lambda t: t.name,
)
def test_every_registry_task_of_both_flows_is_under_the_policy(registry_task):
    assert registry_task.retry_condition_fn is retry_service_errors
    assert (registry_task.retries, registry_task.retry_delay_seconds) == (3, [5, 10, 20])
    assert isinstance(registry_task.cache_policy, type(NO_CACHE))  # the aliases are read anew on each attempt
