"""The MLflow model registry: candidates as model versions, and the aliases `champion`, `challenger`,
`previous-champion` that say which adapter serves.

What moves is planned by pure functions (`plan_promotion`, `plan_rollback`) and applied by `Registry`
under a lock, after checking that the champion is still the version the decision was made against:
two runs finishing at once leave exactly one consistent champion. The lock is a registered model whose
name is unique in MLflow's database, so any backend (SQLite, PostgreSQL) makes taking it atomic.
"""

from __future__ import annotations

import getpass
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous-champion"


class ChampionMoved(RuntimeError):
    """The champion changed after the decision was made; the decision no longer applies."""


class RegistryError(RuntimeError):
    pass


@dataclass(frozen=True)
class AliasMove:
    alias: str
    version: str | None  # None: remove the alias


def plan_promotion(champion: str | None, candidate: str, promote: bool) -> list[AliasMove]:
    """Alias moves for a decided candidate.

    >>> plan_promotion("3", "4", promote=True)
    [AliasMove(alias='previous-champion', version='3'), AliasMove(alias='champion', version='4'), AliasMove(alias='challenger', version=None)]
    >>> plan_promotion("3", "4", promote=False)
    [AliasMove(alias='challenger', version='4')]
    """
    if not promote:
        return [AliasMove(CHALLENGER, candidate)]
    moves = [AliasMove(PREVIOUS, champion)] if champion else []
    return moves + [AliasMove(CHAMPION, candidate), AliasMove(CHALLENGER, None)]


def plan_rollback(champion: str | None, previous: str | None) -> list[AliasMove]:
    """Swap champion and previous-champion, so that a second rollback undoes the first.

    >>> plan_rollback("4", "3")
    [AliasMove(alias='champion', version='3'), AliasMove(alias='previous-champion', version='4')]
    """
    if previous is None:
        raise RegistryError("there is no previous champion to roll back to")
    return [AliasMove(CHAMPION, previous), AliasMove(PREVIOUS, champion)]


def operator() -> str:
    """Who acts: the CI or Prefect user when set, else the OS user."""
    return os.environ.get("GRPO_OPERATOR") or os.environ.get("GITHUB_ACTOR") or getpass.getuser()


class Registry:
    def __init__(self, client, name: str, lock_timeout_s: float = 120, stale_lock_s: float = 900):
        self.client, self.name = client, name
        self.lock_timeout_s, self.stale_lock_s = lock_timeout_s, stale_lock_s

    def ensure(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            try:
                self.client.create_registered_model(self.name, description="GRPO adapters; aliases mark what serves")
            except MlflowException:  # created by a concurrent run in between
                self.client.get_registered_model(self.name)

    def version_of(self, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(self.name, alias).version
        except MlflowException:
            return None

    def aliases(self) -> dict[str, str | None]:
        return {alias: self.version_of(alias) for alias in (CHAMPION, CHALLENGER, PREVIOUS)}

    def register(self, source: str, run_id: str, tags: dict[str, str]) -> str:
        """The candidate's version; a retried pipeline run finds the one it registered before."""
        self.ensure()
        for existing in self.client.search_model_versions(f"run_id = '{run_id}'"):
            if existing.name == self.name and existing.source == source:
                return existing.version
        return self.client.create_model_version(self.name, source, run_id=run_id, tags=tags).version

    def tag(self, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, version, key, value)

    def apply(self, moves: list[AliasMove]) -> None:
        for move in moves:
            if move.version is None:
                if self.version_of(move.alias) is not None:
                    self.client.delete_registered_model_alias(self.name, move.alias)
            else:
                self.client.set_registered_model_alias(self.name, move.alias, move.version)

    @contextmanager
    def lock(self):
        """Exclusive access to the aliases: creating a registered model is atomic in MLflow's database."""
        from mlflow.exceptions import MlflowException

        name, deadline = f"{self.name}.promotion-lock", time.monotonic() + self.lock_timeout_s
        while True:
            try:
                self.client.create_registered_model(name, tags={"holder": operator(), "since": str(time.time())})
                break
            except MlflowException:
                self._break_if_stale(name)
                if time.monotonic() > deadline:
                    raise RegistryError(
                        f"the registry lock {name} is held; if no promotion is running, delete that registered model"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            self.client.delete_registered_model(name)

    def _break_if_stale(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            since = float(self.client.get_registered_model(name).tags.get("since", "inf"))
            if time.time() - since > self.stale_lock_s:  # its holder died mid-promotion
                self.client.delete_registered_model(name)
        except MlflowException:
            pass  # released meanwhile

    def settle(self, candidate: str, decided_against: str | None, promote: bool, tags: dict[str, str]) -> list[AliasMove]:
        """Move the aliases for a decision, unless the champion moved since the decision was made."""
        with self.lock():
            champion = self.version_of(CHAMPION)
            if self.version_of(CHAMPION if promote else CHALLENGER) == candidate:
                return []  # settled by an earlier attempt of this run, which failed after it
            if champion != decided_against:
                raise ChampionMoved(
                    f"the champion is now version {champion}, but the decision was made against "
                    f"{decided_against or 'the base model'}; re-run to decide against the new champion"
                )
            moves = plan_promotion(champion, candidate, promote)
            self.tag(candidate, tags)
            self.apply(moves)
        return moves

    def rollback(self, reason: str) -> list[AliasMove]:
        with self.lock():
            aliases = self.aliases()
            moves = plan_rollback(aliases[CHAMPION], aliases[PREVIOUS])
            self.apply(moves)
            self.tag(aliases[CHAMPION], {"rolled_back_by": operator(), "rolled_back_reason": reason})
        return moves

    def force(self, version: str, reason: str) -> list[AliasMove]:
        """An operator's promotion, with no A/B decision; recorded with who and why."""
        self.client.get_model_version(self.name, version)  # fails clearly on an unknown version
        with self.lock():
            moves = plan_promotion(self.version_of(CHAMPION), version, promote=True)
            self.apply(moves)
            self.tag(version, {"forced_by": operator(), "forced_reason": reason, "decision": "forced"})
        return moves
