"""The MLflow model registry: candidates as model versions, and the aliases `champion`, `challenger`,
`previous-champion` that say which model serves.

What moves is planned by pure functions (`plan_promotion`, `plan_force`, `plan_rollback`) and applied by
`Registry` under a lock, after checking that the champion is still the version the decision was made
against: two runs finishing at once leave exactly one consistent champion.

The lock is a ticket queue on the registered model `<name>.promotion-lock`: each taker creates a model version
there (MLflow numbers versions in its database, one past the highest ever given, deleted ones included, so a
number is never handed out twice on any backend), tagged with a random token. The lowest live ticket holds the
lock. A ticket whose holder shows no sign of life for `stale_lock_s` (its `seen` tag, renewed while it waits
and before each alias move) is deleted by whoever waits behind it: deleting a version by its number is a
compare-and-delete, it can never remove a ticket taken since, so two waiters breaking the same stale lock
still queue one behind the other. The holder checks its ticket (number and token) before each alias move and
at release, and stops (`LockLost`) if it is gone; release deletes only the holder's own ticket.

With a merged companion (`merge.enabled`), each adapter version that has a merged model records its version
of `<name>-merged` in the tag `merged_version`, and every alias move on the adapter model is mirrored
there, so both registered models name the same champion.

The clients it drives (a few REST calls over the standard library, or MLflow's own) and `open_client`, which picks
one for a tracking URI, are in `registry_client.py`.
"""

from __future__ import annotations

import getpass
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grpo_pipeline.tasks.promote.registry_client import RestClient, client_errors, error_code

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous-champion"
ALIASES = (CHAMPION, CHALLENGER, PREVIOUS)
MERGED_VERSION_TAG = "merged_version"
# what a lookup of something absent answers: RESOURCE_DOES_NOT_EXIST from SQL stores, INVALID_PARAMETER_VALUE
# from the server for a missing alias (and a version that is not a number)
MISSING = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def merged_name(name: str) -> str:
    """The registered model holding the merged models of `name`'s versions."""
    return f"{name}-merged"


class ChampionMoved(RuntimeError):
    """The champion changed after the decision was made; the decision no longer applies."""


class RegistryError(RuntimeError):
    """A registry state that refuses the request (a held lock, no such version): no retry changes it."""


class LockLost(RegistryError):
    """The promotion lock was taken from this holder (its ticket broken as stale): it must move nothing more."""


class RegistryServiceError(RuntimeError):
    """The MLflow server did not do a registry call (it does not answer, or it refused for a reason other than
    the registry's state); the message names its URL. A service fault, not a decision: the flow retries it."""


@dataclass(frozen=True)
class AliasMove:
    alias: str
    version: str | None  # None: remove the alias
    model: str = field(default="", compare=False, repr=False)  # filled in when applied
    before: str | None = field(default=None, compare=False, repr=False)  # the version it pointed at

    def describe(self) -> str:
        """One line of an operator command's output.

        >>> AliasMove("champion", "4", model="m", before="3").describe()
        'm@champion: 3 -> 4'
        """
        return f"{self.model}@{self.alias}: {self.before or '(none)'} -> {self.version or '(removed)'}"


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


def plan_canary(champion: str | None, candidate: str, passed: bool) -> list[AliasMove]:
    """Alias moves for a decided candidate under `promote.mode=canary`: one that passed the offline gate becomes
    `challenger` (replacing a running one: the online test restarts on the new version) and the champion is
    left to the online decision; with no champion yet there is nothing to test it against online, so it
    becomes champion directly; a rejected one gets no alias (a running test goes on undisturbed).

    >>> plan_canary("3", "5", passed=True)
    [AliasMove(alias='challenger', version='5')]
    >>> plan_canary(None, "1", passed=True)
    [AliasMove(alias='champion', version='1'), AliasMove(alias='challenger', version=None)]
    >>> plan_canary("3", "5", passed=False)
    []
    """
    if not passed:
        return []
    if champion is None:
        return plan_promotion(None, candidate, promote=True)
    return [AliasMove(CHALLENGER, candidate)]


def plan_settle(champion: str | None, candidate: str, promote: bool, mode: str = "offline") -> list[AliasMove]:
    """The moves of a decided candidate for `promote.mode` (`offline`: `plan_promotion`; `canary`: `plan_canary`).

    >>> plan_settle("3", "4", promote=True, mode="canary")
    [AliasMove(alias='challenger', version='4')]
    """
    if mode == "canary":
        return plan_canary(champion, candidate, promote)
    if mode != "offline":
        raise ValueError(f"promote.mode must be 'offline' or 'canary', got {mode!r}")
    return plan_promotion(champion, candidate, promote)


def plan_force(champion: str | None, challenger: str | None, version: str) -> list[AliasMove]:
    """An operator's promotion: `version` becomes champion and the champion it replaces becomes
    previous-champion (so `rollback` undoes it); the challenger stays unless it is `version` itself.

    >>> plan_force("3", "5", "4")
    [AliasMove(alias='previous-champion', version='3'), AliasMove(alias='champion', version='4')]
    >>> plan_force("3", "4", "4")
    [AliasMove(alias='previous-champion', version='3'), AliasMove(alias='champion', version='4'), AliasMove(alias='challenger', version=None)]
    >>> plan_force("4", None, "4")
    []
    """
    if champion == version:
        return []
    moves = [AliasMove(PREVIOUS, champion)] if champion else []
    moves.append(AliasMove(CHAMPION, version))
    return moves + ([AliasMove(CHALLENGER, None)] if challenger == version else [])


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


TOKEN_TAG, SEEN_TAG = "token", "seen"
# A ticket has no artifacts: a source the server takes without a run (an absolute path under a scheme of
# its own; not a local path, runs:/ or mlflow-artifacts:, which need a run that holds them).
LOCK_SOURCE = "grpo-lock:/promotion-lock"


@dataclass(frozen=True)
class Ticket:
    """A place in the promotion lock's queue: a model version of `<name>.promotion-lock`."""

    version: int
    token: str  # random per taker: a ticket is only ever checked or released by the one who took it
    seen: float  # when its taker last showed it was alive (seconds since the epoch)


def _ticket_tags(token: str) -> dict[str, str]:
    return {TOKEN_TAG: token, SEEN_TAG: str(time.time()), "holder": operator()}


def _seen(tags: dict) -> float:
    try:
        return float(tags.get(SEEN_TAG, "0"))
    except ValueError:
        return 0.0  # unreadable: as old as can be


def queue_ahead(tickets: list[Ticket], mine: Ticket, now: float, stale_s: float) -> tuple[list[Ticket], list[Ticket]]:
    """The live tickets ahead of `mine` (lowest first) and the stale ones ahead, which may be broken. Only
    numbers below `mine` count: a ticket taken later always gets a higher number.

    >>> t = lambda v, seen: Ticket(v, f"t{v}", seen)
    >>> queue_ahead([t(3, 100.0), t(5, 990.0), t(7, 999.0), t(9, 999.0)], t(7, 999.0), now=1000.0, stale_s=60)
    ([Ticket(version=5, token='t5', seen=990.0)], [Ticket(version=3, token='t3', seen=100.0)])
    """
    ahead = sorted((t for t in tickets if t.version < mine.version), key=lambda t: t.version)
    stale = [t for t in ahead if now - t.seen > stale_s]
    return [t for t in ahead if t not in stale], stale


class Registry:
    def __init__(
        self, client: RestClient | MlflowClient, name: str, lock_timeout_s: float = 120, stale_lock_s: float = 900
    ):
        self.client, self.name = client, name
        self.lock_timeout_s, self.stale_lock_s = lock_timeout_s, stale_lock_s
        self.heartbeat_s = min(10.0, stale_lock_s / 4)  # a waiter renews its ticket well inside the stale limit
        self.errors = client_errors(client)
        self._held: Ticket | None = None

    @property
    def merged(self) -> str:
        return merged_name(self.name)

    def ensure(self, name: str | None = None, description: str = "GRPO adapters; aliases mark what serves") -> None:
        name = name or self.name
        try:
            self.client.get_registered_model(name)
        except self.errors:
            try:
                self.client.create_registered_model(name, description=description)
            except self.errors:  # created by a concurrent run in between
                self.client.get_registered_model(name)

    def version_of(self, alias: str, name: str | None = None) -> str | None:
        """The version `alias` points at; None when it points nowhere (an unreachable server raises)."""
        try:
            # str: the SQL store hands back an int, the REST API a string
            return str(self.client.get_model_version_by_alias(name or self.name, alias).version)
        except self.errors as exc:
            if error_code(exc) in MISSING:
                return None
            raise

    def aliases(self, name: str | None = None) -> dict[str, str | None]:
        return {alias: self.version_of(alias, name) for alias in ALIASES}

    def register(
        self, source: str, run_id: str, tags: dict[str, str], *, name: str | None = None, model_id: str | None = None
    ) -> str:
        """The version of `source` (a logged model's URI); a retried pipeline run finds the one it registered."""
        name = name or self.name
        self.ensure(
            name,
            "GRPO adapters merged into their base; aliases follow the adapter model's"
            if name == self.merged
            else "GRPO adapters; aliases mark what serves",
        )
        for existing in self.client.search_model_versions(f"run_id = '{run_id}'"):
            if existing.name == name and existing.source == source:
                return str(existing.version)
        return str(
            self.client.create_model_version(name, source, run_id=run_id, tags=tags, model_id=model_id or None).version
        )

    def tag(self, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, version, key, value)

    def merged_version_of(self, version: str | None) -> str | None:
        """The merged model's version registered with adapter version `version`, if any."""
        if version is None:
            return None
        return self.client.get_model_version(self.name, version).tags.get(MERGED_VERSION_TAG)

    def _move(self, name: str, move: AliasMove) -> AliasMove | None:
        before = self.version_of(move.alias, name)
        if before == move.version:
            return None  # already so: not a move
        if self._held is not None:
            self.check_holder(self._held)  # a holder taken for dead moves nothing more
        if move.version is None:
            self.client.delete_registered_model_alias(name, move.alias)
        else:
            self.client.set_registered_model_alias(name, move.alias, move.version)
        return AliasMove(move.alias, move.version, model=name, before=before)

    def _has_merged_model(self) -> bool:
        try:
            self.client.get_registered_model(self.merged)
            return True
        except self.errors:
            return False

    def apply(self, moves: list[AliasMove]) -> list[AliasMove]:
        """Move the aliases, and the merged model's with them; return the moves made, with what they replaced."""
        done = [m for m in (self._move(self.name, move) for move in moves) if m]
        if done and self._has_merged_model():
            for move in moves:
                mirrored = AliasMove(move.alias, self.merged_version_of(move.version))
                if m := self._move(self.merged, mirrored):
                    done.append(m)
        return done

    def _service_error(self, doing: str, exc: BaseException) -> RegistryServiceError:
        """`exc` told as what could not be done, against the MLflow URL really used."""
        url = getattr(self.client, "_registry_uri", None) or getattr(self.client, "tracking_uri", "?")
        detail = str(exc) if str(url) in str(exc) else f"MLflow at {url}: {exc}"
        return RegistryServiceError(f"{doing}: {detail}")

    @property
    def lock_name(self) -> str:
        return f"{self.name}.promotion-lock"

    def _tickets(self) -> list[Ticket]:
        try:
            found = self.client.search_model_versions(f"name = '{self.lock_name}'")
        except self.errors as exc:
            raise self._service_error(f"cannot read the registry lock {self.lock_name}", exc) from exc
        return [Ticket(int(v.version), v.tags.get(TOKEN_TAG, ""), _seen(v.tags)) for v in found]

    def acquire(self) -> Ticket:
        """Queue for the lock and wait until this ticket is the lowest live one, breaking stale tickets ahead.

        Only "held by a live holder" makes it wait; any other error (the server does not answer) is raised at
        once. On giving up (`lock_timeout_s`) its own ticket is withdrawn."""
        name, deadline = self.lock_name, time.monotonic() + self.lock_timeout_s
        token = secrets.token_hex(16)
        try:
            self.client.create_registered_model(
                name,
                description=f"the promotion lock of {self.name}: each "
                "model version is a ticket; the lowest holds the lock",
            )
        except self.errors as exc:
            if error_code(exc) != "RESOURCE_ALREADY_EXISTS":
                raise self._service_error(f"cannot take the registry lock {name}", exc) from exc
        try:
            mine = self.client.create_model_version(name, LOCK_SOURCE, tags=_ticket_tags(token))
        except self.errors as exc:
            raise self._service_error(f"cannot take the registry lock {name}", exc) from exc
        ticket, beat = Ticket(int(mine.version), token, time.time()), time.monotonic()
        try:
            while True:
                tickets = self._tickets()
                if ticket.version not in {t.version for t in tickets}:  # broken as stale while it waited
                    raise self._lost(ticket)
                ahead, stale = queue_ahead(tickets, ticket, time.time(), self.stale_lock_s)
                for old in stale:  # its holder died mid-promotion (or while waiting)
                    self._delete_ticket(old.version)
                if not ahead:
                    self._renew(ticket)  # held from now: its age counts from here, not from its wait
                    return ticket
                if time.monotonic() > deadline:
                    raise RegistryError(
                        f"the registry lock {name} is held (ticket {ahead[0].version}); if no promotion "
                        f"is running, delete version {ahead[0].version} of {name}, or wait "
                        f"{self.stale_lock_s:g} s for it to count as stale"
                    )
                if time.monotonic() - beat > self.heartbeat_s:  # a live waiter is never taken for a dead one
                    self._renew(ticket)
                    beat = time.monotonic()
                time.sleep(0.2)
        except BaseException:
            self._delete_ticket(ticket.version)
            raise

    def _owns(self, ticket: Ticket) -> bool:
        """Whether `ticket` is still there with its token (not broken as stale, not replaced)."""
        try:
            current = self.client.get_model_version(self.lock_name, str(ticket.version))
        except self.errors as exc:
            if error_code(exc) not in MISSING:
                raise self._service_error(f"cannot read the registry lock {self.lock_name}", exc) from exc
            return False
        return current.tags.get(TOKEN_TAG) == ticket.token

    def _lost(self, ticket: Ticket) -> LockLost:
        return LockLost(
            f"the registry lock {self.lock_name} was taken from ticket {ticket.version} (counted as stale "
            f"after {self.stale_lock_s:g} s without a sign of life); nothing more was moved: check the "
            "aliases and re-run"
        )

    def check_holder(self, ticket: Ticket) -> None:
        """This ticket still holds the lock (its number is there with its token), or `LockLost`; renews it."""
        if not self._owns(ticket):
            raise self._lost(ticket)
        self._renew(ticket)

    def release(self, ticket: Ticket) -> None:
        """Delete this holder's own ticket, after checking it is its own: never anyone else's."""
        if self._owns(ticket):
            self._delete_ticket(ticket.version)

    def _renew(self, ticket: Ticket) -> None:
        try:
            self.client.set_model_version_tag(self.lock_name, str(ticket.version), SEEN_TAG, str(time.time()))
        except self.errors as exc:
            if error_code(exc) in MISSING:
                raise self._lost(ticket) from None
            raise self._service_error(f"cannot update the registry lock {self.lock_name}", exc) from exc

    def _delete_ticket(self, version: int) -> None:
        try:
            self.client.delete_model_version(self.lock_name, str(version))
        except self.errors as exc:
            if error_code(exc) not in MISSING:  # else deleted meanwhile: released, or broken by another waiter
                raise self._service_error(f"cannot update the registry lock {self.lock_name}", exc) from exc

    @contextmanager
    def lock(self) -> Iterator[Ticket]:
        """Exclusive access to the aliases until the block ends; `self.check_holder` runs before each move."""
        ticket = self.acquire()
        self._held = ticket
        try:
            yield ticket
        finally:
            self._held = None
            self.release(ticket)

    def settle(
        self, candidate: str, decided_against: str | None, promote: bool, tags: dict[str, str], mode: str = "offline"
    ) -> list[AliasMove]:
        """Move the aliases for a decision (`plan_settle` for `promote.mode`), unless the champion moved since
        the decision was made. In canary mode a challenger it replaces is tagged with what replaced it."""
        planned = plan_settle(decided_against, candidate, promote, mode)
        with self.lock():
            champion, challenger = self.version_of(CHAMPION), self.version_of(CHALLENGER)
            given = [m.alias for m in planned if m.version == candidate]  # the alias the candidate gets, if any
            if given and self.version_of(given[0]) == candidate:
                return []  # settled by an earlier attempt of this run, which failed after it
            if champion != decided_against:
                raise ChampionMoved(
                    f"the champion is now version {champion}, but the decision was made against "
                    f"{decided_against or 'the base model'}; re-run to decide against the new champion"
                )
            self.tag(candidate, tags)
            if mode == "canary" and challenger not in (None, candidate) and AliasMove(CHALLENGER, candidate) in planned:
                self.tag(
                    challenger,
                    {
                        "ab_decision": "replaced",
                        "ab_reason": (
                            f"replaced as challenger by version {candidate}, which passed the offline gate; the online "
                            "test restarted on it, undecided for this version"
                        ),
                    },
                )
            return self.apply(planned)

    def rollback(self, reason: str) -> list[AliasMove]:
        with self.lock():
            aliases = self.aliases()
            champion = aliases[CHAMPION]
            if champion is None:  # the alias removed by hand: moving previous-champion up would tag no version
                raise RegistryError("there is no champion to roll back")
            moves = self.apply(plan_rollback(champion, aliases[PREVIOUS]))
            self.tag(champion, {"rolled_back_by": operator(), "rolled_back_reason": reason})
        return moves

    def force(self, version: str, reason: str) -> list[AliasMove]:
        """An operator's promotion, with no A/B decision; recorded with who and why beside the version's
        own `decision` tag, which keeps what the pipeline decided."""
        try:
            self.client.get_model_version(self.name, version)
        except self.errors as exc:
            if error_code(exc) not in MISSING:
                raise self._service_error(f"cannot read version {version} of {self.name}", exc) from exc
            raise RegistryError(f"{self.name} has no version {version}: {exc}") from None
        with self.lock():
            aliases = self.aliases()
            moves = self.apply(plan_force(aliases[CHAMPION], aliases[CHALLENGER], version))
            self.tag(
                version,
                {
                    "forced_by": operator(),
                    "forced_reason": reason,
                    "forced_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
            )
        return moves
