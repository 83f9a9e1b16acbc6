"""One retry policy for the flow tasks that call the registry (the pipeline's registration, its champion's download
and its promotion; the live A/B's decision and its aliases): a service that did not answer (the registry's server,
the request log's store) is retried with backoff; a decision never is. The aliases moved since the decision
(`ChampionMoved`, `AliasesMoved`) or the registry refused (`RegistryError`: its lock held, or lost; a version that
names no artifacts): another attempt would repeat the same refusal or act on versions nobody decided on, so the
caller gets it at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas import TaskRun
from prefect.states import State
from prefect.tasks import exponential_backoff

from grpo_pipeline.tasks.promote.registry import ChampionMoved, RegistryError
from grpo_pipeline.tasks.serve.ab import AliasesMoved

P = ParamSpec("P")
R = TypeVar("R")

DECISIONS = (ChampionMoved, AliasesMoved, RegistryError)


def retry_service_errors(task: Task[..., Any], task_run: TaskRun, state: State) -> bool:
    """Prefect's `retry_condition_fn`: whether the failed run is worth another attempt."""
    try:
        state.result()
    except DECISIONS:
        return False
    except Exception:
        return True
    return False


def registry_task(name: str) -> Callable[[Callable[P, R]], Task[P, R]]:
    """`@task` for a registry call, under the policy above: three retries, 5 s apart and then longer, never cached
    (the aliases are read or moved anew each time)."""
    return task(
        name=name,
        cache_policy=NO_CACHE,
        retries=3,
        retry_delay_seconds=exponential_backoff(backoff_factor=5),
        retry_condition_fn=retry_service_errors,
    )
