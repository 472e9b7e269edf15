"""Resolve's per-process caches and its one query per request (`_FINGERPRINT`, on a connection of its own).

Each request asks the database one indexed question: which release(s) the channel points at, the newest eval
result it was promoted with, and the routing revision, which grows with every catalog or performance change;
so a promotion, a weight change or a new record is seen at once, by every worker, and everything built from
an unchanged answer is reused.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy import Engine, bindparam, func, literal_column, select
from sqlalchemy.exc import DBAPIError
from starlette.responses import Response

from kiln.core.error_codes import Codes
from kiln.core.errors import NotFound, Unavailable
from kiln.core.hardware import HardwareCatalog
from kiln.registry.channels.buckets import BASIS_POINTS, bucket_of, owner
from kiln.registry.channels.models import Channel
from kiln.registry.models.models import Model
from kiln.registry.releases.models import Release
from kiln.registry.resolve.models import RoutingState
from kiln.registry.resolve.views import ReleaseView

K = TypeVar("K")
V = TypeVar("V")


# Built once with bound parameters, so SQLAlchemy's compiled-statement cache hit is cheap. The
# routing revision rides along (an outer join to its one row, 0 where it is missing).
_FINGERPRINT = (
    select(
        Release.id,
        Release.version,
        Channel.evals_through,
        Release.yanked_at,
        Channel.split,
        func.coalesce(RoutingState.revision, literal_column("0")),
    )
    .join(Channel, Channel.release_id == Release.id)
    .join(Model, Model.id == Channel.model_id)
    .outerjoin(RoutingState, RoutingState.id == literal_column("1"))
    .where(Model.name == bindparam("model"), Channel.name == bindparam("channel"))
)


@dataclass(frozen=True)
class SnapshotKey:
    """One release as a channel judges it: by the eval results up to `evals_through`.

    A channel points only at sealed releases, whose artifacts never change, and judges them by
    the eval results up to `evals_through` (which never change either); performance records are
    added, which the routing revision in `ChannelSnapshot` tracks."""

    release_id: int
    version: str
    evals_through: int


@dataclass(frozen=True)
class ChannelSnapshot:
    """What `_FINGERPRINT` reads: it changes whenever the answer for a channel could."""

    members: tuple[tuple[SnapshotKey, int], ...]  # (release, weight in basis points)
    primary: SnapshotKey  # the largest member (all of the traffic without a split)
    revision: int
    # (release, the key buckets it serves), registry.channels.buckets; empty without a split
    buckets: tuple[tuple[SnapshotKey, tuple[tuple[int, int], ...]], ...] = ()
    # The fingerprint row it was built from, as plain values: what answers are cached by (cheap to hash).
    fingerprint: tuple[object, ...] = field(default=(), compare=False)

    @property
    def is_split(self) -> bool:
        return len(self.members) > 1

    def choose(self, model: str, channel: str, key: str | None) -> SnapshotKey:
        """The member a caller key lands on (it keeps it while its share is unchanged); the primary without a key."""
        if key is None or not self.is_split:
            return self.primary
        member = owner(self.buckets, bucket_of(model, channel, key))
        assert isinstance(member, SnapshotKey)
        return member

    def member(self, model: str, channel: str, version: str) -> SnapshotKey:
        """The member that is release `version`: of the split, or the one release the channel points at.

        VERSION_NOT_IN_CHANNEL (404) names the channel's releases when `version` is none of them."""
        for member, _ in self.members:
            if member.version == version:
                return member
        versions = [m.version for m, _ in self.members]
        raise NotFound(
            f"release {version!r} of {model!r} is not on channel {channel!r}; it points at "
            + ", ".join(f"{m.version} ({w * 100 / BASIS_POINTS:g} %)" for m, w in self.members),
            code=Codes.VERSION_NOT_IN_CHANNEL,
            details={"model": model, "channel": channel, "version": version, "versions": versions},
        )


class LRUCache(Generic[K, V]):
    """A small thread-safe least-recently-used map."""

    def __init__(self, max_entries: int):
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)


MAX_FINGERPRINTS = 4096
FingerprintRow = tuple[int, str, int, Any, Any, int]


class ChannelFingerprints:
    """`_FINGERPRINT` on a connection of its own, outside the ORM: resolve's one query per request.

    A Session, a pooled checkout and SQLAlchemy's execution machinery cost several times what the
    indexed query does; this keeps one DBAPI connection (autocommit: every read sees the latest
    promotion) and the statement compiled once for the dialect. `lookup` blocks (it may ask the
    database) and runs in the thread pool, one thread at a time on the one connection; `cached`, for
    the event loop, answers from memory or not at all. A database error drops the connection (the next
    request opens another) and is reported as Unavailable.

    On SQLite the rows are kept until another connection, in any process, commits (this one never
    writes): `WalIndexHeader` says so from shared memory, with no statement and no system call; where it
    cannot (a header being rewritten), `PRAGMA data_version` does, a statement cheaper than the query.
    Both are exact.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        compiled = _FINGERPRINT.compile(dialect=engine.dialect)
        self._sql = str(compiled)
        self._positional = compiled.positiontup  # None for named parameter styles
        self._connection: Any = None
        self._cursor: Any = None  # one per connection, reused
        self._versioned = engine.dialect.name == "sqlite"
        self._wal_index: WalIndexHeader | None = None
        self._wal_index_looked = False  # once per connection: a database not in WAL mode has none
        # (the commit marker the rows were read at: the WAL-index header's bytes or ("pragma", data_version),
        # the rows), replaced whole, so `cached` never pairs a marker with rows older than it
        self._rows: tuple[object, dict[tuple[str, str], FingerprintRow | None]] = (None, {})
        self._lock = threading.Lock()
        self.snapshots: dict[tuple[object, ...], ChannelSnapshot] = {}  # built once per fingerprint row

    def cached(self, model: str, channel: str) -> FingerprintRow | None:
        """`lookup`'s row when it is known to be current without asking the database (SQLite: nothing was
        committed since it was read, as the WAL-index header says), else None: ask `lookup`, in a thread."""
        wal_index, (marker, rows) = self._wal_index, self._rows
        if wal_index is None:
            return None
        try:
            header = wal_index.read()
        except ValueError:  # closed by a thread that dropped the connection
            return None
        return rows.get((model, channel)) if header is not None and header == marker else None

    def lookup(self, model: str, channel: str) -> FingerprintRow | None:
        """(release id, version, evals_through, yanked_at, split, routing revision) of `model`'s `channel`, or None.

        Blocking: for a thread (one at a time uses the connection)."""
        with self._lock:
            return self._lookup(model, channel)

    def _lookup(self, model: str, channel: str) -> FingerprintRow | None:
        try:
            if self._connection is None:
                self._connection = self._engine.raw_connection()
                if not self._versioned:  # SQLite's connections are set up in autocommit
                    self._connection.driver_connection.autocommit = True
                self._cursor = self._connection.cursor()
            if not self._versioned:
                return self._query(model, channel)
            version = self._version()
            if version != self._rows[0] or len(self._rows[1]) >= MAX_FINGERPRINTS:
                self._rows = (version, {})
            rows, key = self._rows[1], (model, channel)
            if key not in rows:
                rows[key] = self._query(model, channel)  # read after the marker: never older than it
            return rows[key]
        except DBAPIError as exc:
            self.close()
            raise Unavailable(f"database unavailable ({type(exc).__name__})") from None
        except self._engine.dialect.loaded_dbapi.Error as exc:
            self.close()
            raise Unavailable(f"database unavailable ({type(exc).__name__})") from None

    def _version(self) -> object:
        """What changes with every commit to the database: the WAL-index header when it can be read
        whole, else SQLite's data_version (which opens the WAL file's shared memory on first use)."""
        if self._wal_index is not None:
            header = self._wal_index.read()
            if header is not None:
                return header
        version = ("pragma", self._fetchone("PRAGMA data_version", ())[0])
        if not self._wal_index_looked:
            self._wal_index_looked = True
            self._wal_index = WalIndexHeader.open(self._connection.driver_connection)
        return version

    def _query(self, model: str, channel: str) -> FingerprintRow | None:
        params = {"model": model, "channel": channel}
        args: Any = [params[name] for name in self._positional] if self._positional is not None else params
        row = self._fetchone(self._sql, args)
        return None if row is None else (row[0], row[1], row[2], row[3], row[4], row[5])

    def _fetchone(self, sql: str, args: Any) -> Any:
        # fetchall: the statement runs to its end, so no read transaction stays open between requests.
        self._cursor.execute(sql, args)
        rows = self._cursor.fetchall()
        return rows[0] if rows else None

    def close(self) -> None:
        self._cursor = None
        wal_index, self._wal_index, self._wal_index_looked = self._wal_index, None, False
        if wal_index is not None:
            wal_index.close()
        self._rows = (None, {})
        if self._connection is not None:
            connection, self._connection = self._connection, None
            with contextlib.suppress(Exception):
                connection.invalidate()


class WalIndexHeader:
    """A SQLite database's WAL-index header, read from its shared memory (`<db>-shm`) as SQLite's own
    readers read it before they take a lock (`walIndexTryHdr` in wal.c; the layout is in SQLite's
    "WAL-mode File Format", section 2.2.1): two 48-byte copies of the header, written one after the
    other by each committing writer. When the copies agree the header is current, and it changes with
    every commit (`iChange` and `mxFrame` count them, the salts change when the log restarts); when
    they differ a writer is between the two copies, and `read` says None: ask SQLite.

    Exact where `PRAGMA data_version` is, for the connections it watches: every connection of the
    database writes through the same shared memory in WAL mode, which `registry.db` sets on each."""

    COPY = 48  # bytes of one WalIndexHdr: iVersion, unused, iChange, isInit, ...
    IS_INIT = 12  # byte offset of isInit: 0 until a connection has built the index

    def __init__(self, file: Any, view: mmap.mmap) -> None:
        self._file = file
        self._view = view

    @classmethod
    def open(cls, connection: Any) -> WalIndexHeader | None:
        """The header of `connection`'s main database, or None where it has none to share (not in WAL
        mode, an in-memory database, a shared memory file not there yet or too small to be one)."""
        mode = connection.execute("PRAGMA journal_mode").fetchone()
        path = next((row[2] for row in connection.execute("PRAGMA database_list") if row[1] == "main"), "")
        if mode is None or str(mode[0]).lower() != "wal" or not path:
            return None
        try:
            file = open(f"{path}-shm", "rb")  # noqa: SIM115 - held open for the mapping's life
        except OSError:
            return None
        try:
            view = mmap.mmap(file.fileno(), 2 * cls.COPY, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            file.close()
            return None
        return cls(file, view)

    def read(self) -> bytes | None:
        """The current header's bytes, or None when a writer is rewriting it (or none was built yet)."""
        view, n = self._view, self.COPY
        first = view[:n]
        if first != view[n : 2 * n] or not first[self.IS_INIT]:
            return None
        return first

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._view.close()
        self._file.close()


class Answer(Response):
    """A rendered resolve answer, its ETag and its response headers, made once when the answer is cached and
    sent as is to every caller it serves (each response gets its own copy of the header list: the
    middleware adds the request's id to it)."""

    def __init__(self, body: bytes, etag: str) -> None:
        super().__init__(body, media_type="application/json", headers={"ETag": etag, "Cache-Control": "no-cache"})
        self.etag = etag
        self._prepared = tuple(self.raw_headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": list(self._prepared)})
        await send({"type": "http.response.body", "body": self.body})


class ResolveCache:
    """Per-process caches for resolve: release views, catalogs, and answers keyed by all they depend on."""

    def __init__(self, fingerprints: ChannelFingerprints, max_views: int = 1024, max_answers: int = 8192):
        self.fingerprints = fingerprints
        self.views: LRUCache[tuple[SnapshotKey, int], ReleaseView] = LRUCache(max_views)
        self.catalogs: LRUCache[int, HardwareCatalog] = LRUCache(4)
        self.answers: LRUCache[tuple[object, ...], Answer] = LRUCache(max_answers)
