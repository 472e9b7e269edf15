"""Database plumbing: the declarative base with one MetaData, engine and session factories.

Nothing here connects at import time; `create_app` calls `create_db_engine` with its settings.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import JSON, Connection, DateTime, Engine, MetaData, create_engine, event, select
from sqlalchemy.engine import URL, Dialect, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.sql.elements import SQLColumnExpression
from sqlalchemy.types import TypeDecorator

from kiln.core.errors import Unavailable

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)

# Deterministic constraint names, so migrations can name (and later drop) every constraint.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend (SQLite stores naive text, so we add UTC back)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: registry timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class RecordJSON(TypeDecorator[R]):
    """A frozen record (`core.evals.EvalMetrics`, ...) in a JSON column, validated once as it is read.

    None is stored as `{}`, the column's spelling of "none" from when it held free-form JSON; a record
    is stored as its JSON form (`model_dump_json`: non-finite floats as strings).
    """

    impl = JSON()
    cache_ok = True

    def __init__(self, record: type[R]):
        super().__init__()
        self.record = record

    def process_bind_param(self, value: R | None, dialect: Dialect) -> dict[str, Any]:
        # Its JSON as written (not model_dump(mode="json"), which leaves NaN a float no JSON column takes).
        stored: dict[str, Any] = {} if value is None else json.loads(value.model_dump_json())
        return stored

    def process_result_value(self, value: dict[str, Any] | None, dialect: Dialect) -> R | None:
        return None if not value else self.record.model_validate(value)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[str]: JSON(),
    }


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; a bare `postgresql://` means psycopg 3, the driver we ship."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


# Sessions of requests that change anything run on an engine with this execution option: on SQLite
# their transactions start with BEGIN IMMEDIATE, taking the write lock before their first read, so a
# read-then-write request (a promotion reading the channel it moves) never works from a stale snapshot.
WRITE_OPTION = "kiln_write"


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # The driver's own transaction handling begins lazily, only before DML, and never IMMEDIATE:
    # switch it off and emit BEGIN ourselves (`_sqlite_transactions`), as SQLAlchemy's docs recommend.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        # WAL: readers (resolve, downloads) never wait for a writer.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=10000")
    finally:
        cursor.close()


class WriteTurns:
    """SQLite's write lock, taken in this process in the order its writers asked for it.

    SQLite's busy handler is not a queue: each waiter sleeps and retries, and one arriving late may take the
    lock before one that has waited seconds; under load (the soak's 64 clients) the unluckiest waited past
    the busy timeout and answered 503. So a write transaction first waits here for its turn, first come first
    served, and only the head of this process's queue meets the other processes' in SQLite's handler. A
    transaction's turn ends with it (COMMIT or ROLLBACK; a connection given back to the pool with its turn
    still held gives it up there). Holding a turn never waits on anything this process's other writers hold:
    a write transaction begins and ends in one thread (registry.deps.ENDING_THREADS).
    """

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._held = False
        self._waiting: deque[threading.Event] = deque()

    def acquire(self) -> None:
        """Wait for this writer's turn; Unavailable (503) after `timeout_s`."""
        with self._lock:
            if not self._held:
                self._held = True
                return
            turn = threading.Event()
            self._waiting.append(turn)
        if turn.wait(self.timeout_s):
            return
        with self._lock:
            if turn.is_set():  # handed over as it timed out: it is this writer's after all
                return
            self._waiting.remove(turn)
        raise Unavailable(f"the database's write lock was not this request's turn within {self.timeout_s:.0f} s")

    def release(self) -> None:
        """End the current turn: the longest-waiting writer's begins (or the lock is free)."""
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()
            else:
                self._held = False


_TURN = "kiln_write_turn"  # in a connection's info while its transaction holds this process's write turn


def _sqlite_transactions(engine: Engine, turns: WriteTurns) -> None:
    """BEGIN IMMEDIATE for write sessions, each in its turn (`WriteTurns`); plain BEGIN for reads."""

    def begin(conn: Connection) -> None:
        if not conn.get_execution_options().get(WRITE_OPTION):
            conn.exec_driver_sql("BEGIN")
            return
        turns.acquire()
        conn.info[_TURN] = True
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            end(conn)
            raise

    def end(conn: Connection) -> None:
        if conn.info.pop(_TURN, False):
            turns.release()

    def checkin(_dbapi_connection: Any, record: Any) -> None:
        if record.info.pop(_TURN, False):
            turns.release()

    event.listen(engine, "begin", begin)
    event.listen(engine, "commit", end)
    event.listen(engine, "rollback", end)
    event.listen(engine.pool, "checkin", checkin)


def create_db_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for the registry database, with SQLite set up for foreign keys, WAL and real transactions
    (its writers taking the write lock in turn)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(parsed, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        _sqlite_transactions(engine, WriteTurns())
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    return create_engine(parsed, **kwargs)


def create_session_factory(engine: Engine, *, write: bool = False) -> sessionmaker[Session]:
    """Sessions on `engine`; `write=True`: for requests that change something (see WRITE_OPTION).

    The request (or CLI command) that opens a session owns its transaction and commits it;
    services only add and flush.
    """
    bind = engine.execution_options(**{WRITE_OPTION: True}) if write else engine
    # expire_on_commit=False: services return rows that routes read after the commit.
    return sessionmaker(bind=bind, expire_on_commit=False)


def lock_row(session: Session, key: Any, value: object, *, shared: bool = False) -> None:
    """Lock the row whose `key` column equals `value` until the transaction ends (PostgreSQL).

    `shared`: FOR SHARE (many holders, e.g. publishers adding to a release); otherwise FOR NO KEY
    UPDATE (one holder, e.g. sealing it), which waits for the shared holders and they for it.
    SQLite needs nothing: a write session already holds the database's write lock.
    """
    session.execute(select(key).where(key == value).with_for_update(read=shared, key_share=not shared))


def bytewise(session: Session, column: SQLColumnExpression[str]) -> SQLColumnExpression[str]:
    """`column` as Python compares str, by code point: PostgreSQL's "C" collation (a database's own may order
    `h100-sxm` after `h1000`), SQLite's default. For a listing that merges rows with a list sorted in Python."""
    return column.collate("C") if session.get_bind().dialect.name == "postgresql" else column


def insert_once(session: Session, row: T, find: Callable[[], T | None]) -> tuple[T, bool]:
    """Add `row` and flush it inside a savepoint, returning `(row, True)`.

    When a concurrent writer committed the same unique key first, the savepoint is rolled back
    (the caller's transaction goes on) and `(their_row, False)` is returned, so the caller can
    compare it as it would have if it had seen that row before inserting.
    """
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        existing = find()
        if existing is None:
            raise
        return existing, False
    return row, True
