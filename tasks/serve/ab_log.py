"""The live A/B's durable record: one row per answered request, one feedback score per request, in any database
SQLAlchemy speaks (SQLite by default; PostgreSQL when the stack runs, shared by every server replica).

- `RequestLog.open(url)` connects and creates the tables; an unreachable store raises `LogStoreError` naming
  it (credentials masked), so a server refuses to start rather than serve unlogged traffic.
- `record(row)` inserts a request before its response is returned. The request id is the primary key, so a
  retried write of the same request is a no-op (`False`), never a second row: each request is there once.
- `feedback(id, score)` joins a score to its request: an unknown id raises `UnknownRequest` (HTTP 404) and
  stores nothing, a NaN or infinite score raises `ValueError` (HTTP 400). A later score for the same request
  replaces the earlier one (a label that arrives after the thumbs): the test sees one outcome per request.
- The completion's text is kept (`completion`, the first choice's; None for an error or when
  `ab.serve.log_completions` is off) so that feedback with a `reference` can be scored later by the
  pipeline's own rewards (`completion(id)`). The prompt is never stored, the user's key only as a hash.
- `engine_restarted(reason)` records a router's restart of its engine; `restarts()` counts them for `ab status`.
- A database whose tables of these names lack the log's columns is refused at `open`, naming it, before anything
  is written there.
- `samples(champion_version, challenger_version)` reads what `grpo_pipeline.tasks.serve.ab.decide` takes, and `counts()` what
  `grpo-pipeline ab status` shows.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import (
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    func,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from grpo_pipeline.tasks.serve.ab import ArmSample

metadata = MetaData()

requests_table = Table(
    "ab_requests",
    metadata,
    Column("id", String(64), primary_key=True),  # the response's `id`, the key /v1/feedback takes
    Column("created_at", DateTime(timezone=True), nullable=False, index=True),
    Column("arm", String(32), nullable=False),  # champion | challenger
    Column("version", String(32), nullable=False),  # the registry version that answered
    Column("latency_s", Float, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("error", Boolean, nullable=False),
    Column("assignment", String(16)),  # hash of the user's key (never the key): one arm per user is checkable
    Column("completion", Text),  # the answer's text, for feedback scored against a reference (None: not kept)
)

feedback_table = Table(
    "ab_feedback",
    metadata,
    Column("request_id", String(64), ForeignKey("ab_requests.id"), primary_key=True),
    Column("score", Float, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)


restarts_table = Table(
    "ab_engine_restarts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("replica", String(128), nullable=False),  # host:pid of the router that restarted its engine
    Column("reason", Text, nullable=False),
)


class LogStoreError(RuntimeError):
    """The store cannot be reached or written."""


class UnknownRequest(LookupError):
    """Feedback for an id the log does not hold."""


@dataclass(frozen=True)
class RequestRow:
    id: str
    arm: str
    version: str
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    error: bool
    assignment: str | None = None
    completion: str | None = None
    created_at: datetime | None = None  # now, when None


def masked(url: str) -> str:
    """The URL with its password hidden, for messages and logs.

    >>> masked("postgresql://ab:secret@127.0.0.1:5432/ab")
    'postgresql://ab:***@127.0.0.1:5432/ab'
    """
    return make_url(url).render_as_string(hide_password=True)


def _sqlite_pragmas(dbapi_connection, _record):
    # WAL: readers (ab status, the decision) never block the server's writes; a commit survives a killed process.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


class RequestLog:
    def __init__(self, engine: Engine, url: str):
        self.engine = engine
        self.url = url

    @classmethod
    def open(cls, url: str) -> RequestLog:
        """Connect, create the tables if absent, and prove the store answers; `LogStoreError` names it if not."""
        try:
            if url.startswith("sqlite:///"):  # the default file's folder, made on first use
                Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(url, pool_pre_ping=True)
            if engine.dialect.name == "sqlite":
                event.listen(engine, "connect", _sqlite_pragmas)
            _check_schema(engine, url)  # before anything is created: a foreign database is left as it was
            metadata.create_all(engine)
            _add_completion_column(engine)
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        except (SQLAlchemyError, OSError, ValueError) as e:
            raise LogStoreError(
                f"the A/B request log at {masked(url)} is unreachable ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}); fix: start the database, or set ab.log_url "
                "(or GRPO_AB_LOG_URL) to one that answers"
            ) from e
        return cls(engine, url)

    def record(self, row: RequestRow) -> bool:
        """Insert the request; True when written now, False when this id was already there (a retry)."""
        values = {**row.__dict__, "created_at": row.created_at or datetime.now(UTC)}
        try:
            with self.engine.begin() as connection:
                connection.execute(requests_table.insert().values(**values))
        except IntegrityError:
            return False
        except SQLAlchemyError as e:
            raise LogStoreError(f"writing request {row.id} to {masked(self.url)} failed: {type(e).__name__}") from e
        return True

    def completion(self, request_id: str) -> tuple[str | None, int]:
        """(the logged completion text, its completion tokens) of a request; `UnknownRequest` if absent."""
        with self.engine.connect() as connection:
            row = connection.execute(
                select(requests_table.c.completion, requests_table.c.completion_tokens).where(
                    requests_table.c.id == request_id
                )
            ).first()
        if row is None:
            raise UnknownRequest(f"no request with id {request_id!r} in the A/B log")
        return row[0], int(row[1])

    def feedback(self, request_id: str, score: float) -> None:
        """Store `score` for the request (replacing an earlier one); refuse non-finite scores and unknown ids."""
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ValueError(f"feedback score must be a finite number, got {score!r}")
        now = datetime.now(UTC)
        with self.engine.begin() as connection:
            known = connection.execute(select(requests_table.c.id).where(requests_table.c.id == request_id)).first()
            if known is None:
                raise UnknownRequest(f"no request with id {request_id!r} in the A/B log")
            updated = connection.execute(
                feedback_table.update()
                .where(feedback_table.c.request_id == request_id)
                .values(score=float(score), created_at=now)
            ).rowcount
            if not updated:
                connection.execute(
                    feedback_table.insert().values(request_id=request_id, score=float(score), created_at=now)
                )

    def samples(self, champion_version: str | None, challenger_version: str) -> tuple[ArmSample, ArmSample, float]:
        """(champion, challenger, hours since the challenger's first request): the requests each arm's current
        version answered, and their scores. Hours are 0 before the challenger has answered. A champion of None
        (no champion alias) matches no request: `version` is never NULL in the log."""
        out = []
        started = None
        with self.engine.connect() as connection:
            for arm, version in (("champion", champion_version), ("challenger", challenger_version)):
                where = (requests_table.c.arm == arm) & (requests_table.c.version == version)
                rows = connection.execute(
                    select(
                        requests_table.c.latency_s,
                        requests_table.c.completion_tokens,
                        requests_table.c.error,
                        requests_table.c.created_at,
                    ).where(where)
                ).all()
                scores = (
                    connection.execute(
                        select(feedback_table.c.score).select_from(feedback_table.join(requests_table)).where(where)
                    )
                    .scalars()
                    .all()
                )
                out.append(
                    ArmSample.of(
                        latency_s=[r[0] for r in rows],
                        completion_tokens=[r[1] for r in rows],
                        error=[r[2] for r in rows],
                        scores=scores,
                    )
                )
                if arm == "challenger" and rows:
                    started = min(_utc(r[3]) for r in rows)
        elapsed_h = (datetime.now(UTC) - started).total_seconds() / 3600 if started else 0.0
        return out[0], out[1], elapsed_h

    def counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """{arm: {version: {"requests", "errors", "feedback"}}} over the whole log."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        with self.engine.connect() as connection:
            requests = connection.execute(
                select(
                    requests_table.c.arm,
                    requests_table.c.version,
                    func.count(),
                    func.sum(requests_table.c.error.cast(Integer)),
                ).group_by(requests_table.c.arm, requests_table.c.version)
            ).all()
            scored = connection.execute(
                select(requests_table.c.arm, requests_table.c.version, func.count())
                .select_from(feedback_table.join(requests_table))
                .group_by(requests_table.c.arm, requests_table.c.version)
            ).all()
        for arm, version, n, errors in requests:
            out.setdefault(arm, {})[version] = {"requests": int(n), "errors": int(errors or 0), "feedback": 0}
        for arm, version, n in scored:
            out[arm][version]["feedback"] = int(n)
        return out

    def engine_restarted(self, reason: str) -> None:
        """Record that this router restarted its engine, and why (`ab status` counts them over all replicas)."""
        try:
            with self.engine.begin() as connection:
                connection.execute(
                    restarts_table.insert().values(
                        created_at=datetime.now(UTC), replica=f"{socket.gethostname()}:{os.getpid()}", reason=reason
                    )
                )
        except SQLAlchemyError as e:
            raise LogStoreError(f"recording an engine restart in {masked(self.url)} failed: {type(e).__name__}") from e

    def restarts(self) -> dict[str, object]:
        """{"count": engine restarts over all replicas, "last": the latest's time, replica and reason, or None}."""
        with self.engine.connect() as connection:
            count = connection.execute(select(func.count()).select_from(restarts_table)).scalar_one()
            last = connection.execute(
                select(restarts_table.c.created_at, restarts_table.c.replica, restarts_table.c.reason)
                .order_by(restarts_table.c.id.desc())
                .limit(1)
            ).first()
        latest = None if last is None else {"at": _utc(last[0]).isoformat(), "replica": last[1], "reason": last[2]}
        return {"count": int(count), "last": latest}

    def close(self) -> None:
        self.engine.dispose()


def _check_schema(engine: Engine, url: str) -> None:
    """Refuse a database whose tables of the same names are not the A/B log's (another application's, or a
    mistyped URL): `LogStoreError` naming it and the columns it lacks. A log from before completions were kept
    passes (the column is added)."""
    inspector = inspect(engine)
    for table in metadata.sorted_tables:
        if not inspector.has_table(table.name):
            continue
        have = {c["name"] for c in inspector.get_columns(table.name)}
        missing = [c.name for c in table.columns if c.name not in have and c.name != "completion"]
        if missing:
            raise LogStoreError(
                f"the database at {masked(url)} has a table {table.name} that is not the A/B log's (no column "
                f"{', '.join(missing)}); fix: set ab.log_url (or GRPO_AB_LOG_URL) to the A/B log's own database"
            )


def _add_completion_column(engine: Engine) -> None:
    """A log created before completions were kept gets the column (NULL for its old rows); idempotent."""

    def present() -> bool:
        return "completion" in {c["name"] for c in inspect(engine).get_columns("ab_requests")}

    if present():
        return
    try:
        with engine.begin() as connection:
            connection.execute(text("ALTER TABLE ab_requests ADD COLUMN completion TEXT"))
    except SQLAlchemyError:
        if not present():  # not a replica that added it at the same moment
            raise


def _utc(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes for what was written in UTC; PostgreSQL aware ones.
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


LOG_URL_ENV = "GRPO_AB_LOG_URL"


def log_url(data_dir: Path, environ: Mapping[str, str] | None = None) -> str:
    """Where the request log lives: `$GRPO_AB_LOG_URL` (a SQLAlchemy URL; PostgreSQL with its credentials comes
    from the environment, never the config, which is logged), else a SQLite file under `data_dir`.

    >>> log_url(Path(".grpo"), {})
    'sqlite:///.grpo/ab/requests.sqlite'
    """
    environ = os.environ if environ is None else environ
    if environ.get(LOG_URL_ENV):
        return environ[LOG_URL_ENV]
    return f"sqlite:///{Path(data_dir) / 'ab' / 'requests.sqlite'}"
