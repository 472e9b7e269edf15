"""Resolve: rank what a channel serves for one or more hardware pools, by a policy, with fit, speed and cost.

The database work is a snapshot of the channel (`channel_snapshot`: the release or weighted split it
points at, and the routing revision) and of each release (`load_release_view`); the ranking
(`rank_candidates`) is a pure function of a release view, the hardware catalog and the query.

For each pool and each artifact built for its hardware, `registry.resolve.fit.plan_replica` sizes a
replica (tensor-parallel degree, memory per device) and bounds its decode speed, time to first
token and cost per million tokens; a measured performance record of that artifact on that SKU at
the same TP, concurrency and at least the context replaces the estimate. The policy then ranks:
`latency` the fastest per sequence, `cost` the cheapest per token, `quality` the lowest KL, each
among candidates that fit, have room in their pool and meet the caller's SLO.

Resolve is the hot path (routers ask it on every failover), so snapshots are cached per process.
Each request still asks the database one indexed question (`_FINGERPRINT`: which release(s) the
channel points at, the newest eval result it was promoted with, and the routing revision, which
grows with every catalog or performance change), so a promotion, a weight change or a new record is
seen at once, by every worker.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from sqlalchemy import Engine, bindparam, func, literal_column, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, selectinload

from core.errors import InvalidInput, NotFound, Unavailable
from core.hardware import HARDWARE_NAME_PATTERN, HardwareCatalog, HardwareProfile
from registry.api.params import ITL_MS, TOKENS_PER_S, TTFT_MS
from registry.artifacts.models import Artifact, EvalStatus, eval_status
from registry.channels.buckets import BASIS_POINTS, bucket_of, merged, owner, reassign
from registry.channels.models import Channel
from registry.models.models import Model
from registry.models.service import get_model
from registry.performance.models import PerformanceRecord
from registry.releases.models import Release
from registry.resolve.fit import ModelShape, ReplicaPlan, kv_dtype_of, model_shape, plan_replica
from registry.resolve.models import RoutingState

K = TypeVar("K")
V = TypeVar("V")

GIB = 1024**3
Policy = Literal["latency", "cost", "quality"]
POLICIES: tuple[Policy, ...] = ("latency", "cost", "quality")
MAX_POOLS = 16


@dataclass(frozen=True)
class FileView:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Measurement:
    """A performance record as resolve reads it."""

    id: int
    hardware: str
    runtime: str
    runtime_version: str
    tp: int
    context: int
    concurrency: int
    tokens_per_s: float
    ttft_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    recorded_at: str


@dataclass(frozen=True)
class ArtifactView:
    name: str
    target: str
    format: str
    quant: str
    manifest_digest: str
    hardware: tuple[str, ...]
    unsupported: Mapping[str, str]  # hardware it does not run on -> why
    total_size: int
    eval_status: EvalStatus
    kl: float | None  # best (lowest) metrics.kl over its evals
    failed_reasons: tuple[str, ...]
    files: tuple[FileView, ...]
    measurements: tuple[Measurement, ...] = ()


@dataclass(frozen=True)
class ReleaseView:
    model: str
    version: str
    model_config: dict[str, Any]
    artifacts: tuple[ArtifactView, ...]


@dataclass(frozen=True)
class Pool:
    """A pool of one SKU a router can place a replica in; `free_devices` None: not limited."""

    hardware: str
    free_devices: int | None = None


@dataclass(frozen=True)
class ResolveQuery:
    """What the caller asks: pools (in its order of preference), policy, workload and SLO."""

    pools: tuple[Pool, ...]
    policy: Policy = "latency"
    context: int = 4096
    concurrency: int = 1
    kv_dtype: str = "bf16"
    min_tokens_per_s: float | None = None  # per sequence
    max_ttft_ms: float | None = None


@dataclass(frozen=True)
class Speed:
    """The speed a candidate is ranked by: measured where a record applies, else the plan's bounds."""

    source: Literal["measured", "estimate"]
    tokens_per_s: float  # whole replica
    tokens_per_s_per_sequence: float
    ttft_ms: float | None
    cost_per_mtok: float | None
    measurement: Measurement | None
    note: str


@dataclass(frozen=True)
class Candidate:
    artifact: ArtifactView
    pool: Pool
    pool_index: int
    plan: ReplicaPlan
    speed: Speed
    fits: bool  # the replica fits in memory and in the pool's free devices
    meets_slo: bool
    slo_misses: tuple[str, ...]
    explanation: str

    @property
    def hardware(self) -> str:
        return self.pool.hardware


def parse_pools(text: str) -> tuple[Pool, ...]:
    """`h100,mi300x:16,tpu-v5e`: pools by SKU name, each optionally with its free devices."""
    pools: list[Pool] = []
    for item in text.split(","):
        name, sep, free = item.strip().partition(":")
        if not _HARDWARE_NAME.fullmatch(name):
            raise InvalidInput(
                f"hardware {item.strip()[:40]!r}: expected an SKU name, optionally with its free devices "
                "(h100 or h100:4), comma-separated",
                code="RESOLVE_POOLS_INVALID",
            )
        free_devices: int | None = None
        if sep:
            if not (free.isascii() and free.isdigit() and len(free) <= 7):
                raise InvalidInput(
                    f"hardware {item.strip()[:40]!r}: free devices must be a whole number (0 to 9999999)",
                    code="RESOLVE_POOLS_INVALID",
                )
            free_devices = int(free)
        if any(p.hardware == name for p in pools):
            raise InvalidInput(f"hardware {name!r} is listed twice", code="RESOLVE_POOLS_INVALID")
        pools.append(Pool(name, free_devices))
    if len(pools) > MAX_POOLS:
        raise InvalidInput(f"at most {MAX_POOLS} hardware pools per query", code="RESOLVE_POOLS_INVALID")
    return tuple(pools)


_HARDWARE_NAME = re.compile(HARDWARE_NAME_PATTERN)


def _human(n: int | float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


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


_MAX_FINGERPRINTS = 4096
FingerprintRow = tuple[int, str, int, Any, Any, int]


class ChannelFingerprints:
    """`_FINGERPRINT` on a connection of its own, outside the ORM: resolve's one query per request.

    A Session, a pooled checkout and SQLAlchemy's execution machinery cost several times what the
    indexed query does; this keeps one DBAPI connection (autocommit: every read sees the latest
    promotion) and the statement compiled once for the dialect. Used from the event loop only (the
    resolve route is `async`), so one connection per process serves it. A database error drops the
    connection (the next request opens another) and is reported as Unavailable.

    On SQLite the rows are kept, and `PRAGMA data_version` (which changes whenever another
    connection, in any process, commits; this one never writes) says when to drop them: a cheaper
    statement than the query, and exact.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        compiled = _FINGERPRINT.compile(dialect=engine.dialect)
        self._sql = str(compiled)
        self._positional = compiled.positiontup  # None for named parameter styles
        self._connection: Any = None
        self._cursor: Any = None  # one per connection, reused
        self._versioned = engine.dialect.name == "sqlite"
        self._data_version: int | None = None
        self._rows: dict[tuple[str, str], Any] = {}
        self.snapshots: dict[tuple[object, ...], ChannelSnapshot] = {}  # built once per fingerprint row

    def lookup(self, model: str, channel: str) -> FingerprintRow | None:
        """(release id, version, evals_through, yanked_at, split, routing revision) of `model`'s `channel`, or None."""
        try:
            if self._connection is None:
                self._connection = self._engine.raw_connection()
                if not self._versioned:  # SQLite's connections are set up in autocommit
                    self._connection.driver_connection.autocommit = True
                self._cursor = self._connection.cursor()
            if not self._versioned:
                return self._query(model, channel)
            version = self._fetchone("PRAGMA data_version", ())[0]
            if version != self._data_version or len(self._rows) >= _MAX_FINGERPRINTS:
                self._rows.clear()
                self._data_version = version
            key = (model, channel)
            if key not in self._rows:
                self._rows[key] = self._query(model, channel)
            row: FingerprintRow | None = self._rows[key]
            return row
        except DBAPIError as exc:
            self.close()
            raise Unavailable(f"database unavailable ({type(exc).__name__})") from None
        except self._engine.dialect.loaded_dbapi.Error as exc:
            self.close()
            raise Unavailable(f"database unavailable ({type(exc).__name__})") from None

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
        if self._connection is not None:
            connection, self._connection = self._connection, None
            with contextlib.suppress(Exception):
                connection.invalidate()


class ResolveCache:
    """Per-process caches for resolve: release views, catalogs, and answers keyed by all they depend on."""

    def __init__(self, fingerprints: ChannelFingerprints, max_views: int = 1024, max_answers: int = 8192):
        self.fingerprints = fingerprints
        self.views: LRUCache[tuple[SnapshotKey, int], ReleaseView] = LRUCache(max_views)
        self.catalogs: LRUCache[int, HardwareCatalog] = LRUCache(4)
        self.answers: LRUCache[tuple[object, ...], tuple[bytes, str]] = LRUCache(max_answers)


def _channel_not_found(session: Session, model: str, channel: str) -> NotFound:
    model_row = get_model(session, model)  # raises "model not found" first
    query = select(Channel.name).where(Channel.model_id == model_row.id).order_by(Channel.name)
    names = list(session.scalars(query))
    known = f"its channels: {', '.join(names)}" if names else "it has no channels yet"
    return NotFound(
        f"model {model!r} has no channel {channel!r}; {known}",
        details={"model": model, "channel": channel, "channels": names},
    )


def channel_snapshot(
    fingerprints: ChannelFingerprints, session_factory: Callable[[], Session], model: str, channel: str
) -> ChannelSnapshot:
    """One indexed query: the release(s) `model`'s `channel` points at, with weights, and the routing revision.

    Only a miss opens a session, to say precisely what is missing (the model, or its channel)."""
    row = fingerprints.lookup(model, channel)
    if row is None:
        with session_factory() as session:
            raise _channel_not_found(session, model, channel)
    release_id, version, evals_through, yanked_at, split, revision = row
    if yanked_at is not None:
        raise NotFound(
            f"channel {channel!r} of {model!r} points at release {version}, which is yanked; "
            "resolve never returns a yanked release: promote another one",
            code="CHANNEL_RELEASE_YANKED",
            details={"model": model, "channel": channel, "version": version},
        )
    # SQLite hands JSON back as text, PostgreSQL parsed: the text (or its dump) keys the built snapshot.
    split_text = split if isinstance(split, str) or split is None else json.dumps(split, sort_keys=True)
    fingerprint = (release_id, version, evals_through, split_text, revision)
    snapshot = fingerprints.snapshots.get(fingerprint)
    if snapshot is None:
        snapshot = _build_snapshot(fingerprint)
        if len(fingerprints.snapshots) >= _MAX_FINGERPRINTS:
            fingerprints.snapshots.clear()
        fingerprints.snapshots[fingerprint] = snapshot
    return snapshot


def _build_snapshot(fingerprint: tuple[int, str, int, str | None, int]) -> ChannelSnapshot:
    release_id, version, evals_through, split_text, revision = fingerprint
    primary = SnapshotKey(release_id, version, evals_through)
    split = json.loads(split_text) if split_text else None
    if not split:
        return ChannelSnapshot(((primary, BASIS_POINTS),), primary, revision, fingerprint=fingerprint)
    keys = [SnapshotKey(m["release_id"], m["version"], m["evals_through"]) for m in split]
    members = tuple((k, m["weight"]) for k, m in zip(keys, split, strict=True))
    if all("buckets" in m for m in split):
        assigned = {k: merged(m["buckets"]) for k, m in zip(keys, split, strict=True)}
    else:  # laid out in the members' order
        assigned = {
            k: r
            for k, r in zip(keys, reassign({}, {str(i): w for i, (_, w) in enumerate(members)}).values(), strict=True)
        }
    return ChannelSnapshot(
        members, primary, revision, tuple((k, tuple(r)) for k, r in assigned.items()), fingerprint=fingerprint
    )


def load_catalog(session_factory: Callable[[], Session], revision: int, cache: ResolveCache) -> HardwareCatalog:
    """The registry's hardware catalog at `revision` (built-in entries and the registry's own)."""
    catalog = cache.catalogs.get(revision)
    if catalog is None:
        from registry.hardware.service import effective_catalog

        with session_factory() as session:
            catalog = effective_catalog(session)
        cache.catalogs.put(revision, catalog)
    return catalog


def load_release_view(
    session: Session, model: str, snapshot: SnapshotKey, revision: int = 0, cache: ResolveCache | None = None
) -> ReleaseView:
    """The release of `snapshot` with its artifacts, files, evals and measurements (four queries, or none if cached)."""
    view = cache.views.get((snapshot, revision)) if cache is not None else None
    if view is not None:
        return view
    release = session.get_one(Release, snapshot.release_id)
    artifacts = list(
        session.scalars(
            select(Artifact)
            .where(Artifact.release_id == snapshot.release_id)
            .order_by(Artifact.name)
            .options(selectinload(Artifact.files), selectinload(Artifact.evals))
        )
    )
    measured: dict[int, list[Measurement]] = {}
    records = session.scalars(
        select(PerformanceRecord)
        .where(PerformanceRecord.artifact_id.in_([a.id for a in artifacts]))
        .order_by(PerformanceRecord.id.desc())
    )
    for r in records:
        measured.setdefault(r.artifact_id, []).append(
            Measurement(
                r.id,
                r.hardware,
                r.runtime,
                r.runtime_version,
                r.tp,
                r.context,
                r.concurrency,
                r.tokens_per_s,
                r.ttft_ms,
                r.itl_p50_ms,
                r.itl_p99_ms,
                r.recorded_at.isoformat(),
            )
        )
    view = ReleaseView(
        model,
        release.version,
        release.model_config,
        tuple(_artifact_view(a, snapshot.evals_through, measured.get(a.id, [])) for a in artifacts),
    )
    if cache is not None:
        cache.views.put((snapshot, revision), view)
    return view


def _artifact_view(a: Artifact, evals_through: int, measurements: list[Measurement]) -> ArtifactView:
    """The artifact as the channel judges it: by the eval results it was promoted with."""
    evals = [e for e in a.evals if e.id <= evals_through]
    kls = [
        float(e.metrics["kl"])
        for e in evals
        if isinstance(e.metrics.get("kl"), int | float) and not isinstance(e.metrics.get("kl"), bool)
    ]
    return ArtifactView(
        name=a.name,
        target=a.target,
        format=a.format,
        quant=a.quant,
        manifest_digest=a.manifest_digest,
        hardware=tuple(a.hardware),
        unsupported=dict(a.unsupported),
        total_size=a.total_size,
        eval_status=eval_status(evals),
        kl=min(kls) if kls and all(math.isfinite(k) for k in kls) else None,
        failed_reasons=tuple(f"{e.runtime}: {e.reason or 'failed'}" for e in evals if e.status == "failed"),
        files=tuple(FileView(f.path, f.sha256, f.size) for f in a.files),
        measurements=tuple(measurements),
    )


def runs_on(artifact: ArtifactView, profile: HardwareProfile, catalog: HardwareCatalog) -> tuple[bool, str]:
    """Whether the artifact runs on `profile`, and why not. An SKU the artifact was built before (not in
    its hardware, nor its unsupported list) runs it when a listed SKU has the same architecture."""
    if profile.name in artifact.hardware:
        return True, ""
    if profile.name in artifact.unsupported:
        return False, artifact.unsupported[profile.name]
    twin = catalog.twin(profile, artifact.hardware)
    if twin is not None:
        return True, f"as {twin} (same architecture, {profile.arch})"
    return False, "not built for it"


def _measurement(artifact: ArtifactView, plan: ReplicaPlan) -> Measurement | None:
    """The record that speaks for this replica: same SKU, TP and concurrency, at the requested context or
    longer (the nearest, then the newest)."""
    matching = [
        m
        for m in artifact.measurements
        if m.hardware == plan.hardware
        and m.tp == plan.tp
        and m.concurrency == plan.concurrency
        and m.context >= plan.context
        and _in_bounds(m)
    ]
    return min(matching, key=lambda m: (m.context, -m.id)) if matching else None


def _in_bounds(m: Measurement) -> bool:
    """A record inside the ranges PerformanceCreate accepts: resolve divides by its speeds. (Records stored
    by an older kiln, which took any positive number, are not used.)"""
    return (
        TOKENS_PER_S[0] <= m.tokens_per_s <= TOKENS_PER_S[1]
        and TTFT_MS[0] <= m.ttft_ms <= TTFT_MS[1]
        and ITL_MS[0] <= m.itl_p50_ms <= ITL_MS[1]
    )


def _speed(artifact: ArtifactView, plan: ReplicaPlan, profile: HardwareProfile) -> Speed:
    m = _measurement(artifact, plan)
    if m is None:
        others = [x for x in artifact.measurements if x.hardware == plan.hardware]
        note = "estimated (bounds from the catalog)"
        if others:
            at = ", ".join(f"TP {x.tp}, {x.context} × {x.concurrency}" for x in others[:3])
            note += f"; measured on {plan.hardware} only at {at}"
        return Speed(
            "estimate",
            plan.decode_tokens_per_s,
            plan.decode_tokens_per_s_per_sequence,
            plan.ttft_s * 1000 if plan.ttft_s is not None else None,
            plan.cost_per_mtok,
            None,
            note,
        )
    price = profile.price_per_device_hour
    cost = price * plan.tp / (m.tokens_per_s * 3600) * 1e6 if price is not None else None
    note = (
        f"measured by {m.runtime_version} on {m.hardware} (TP {m.tp}, context {m.context} × {m.concurrency}): "
        f"{m.tokens_per_s:g} tokens/s, TTFT {m.ttft_ms:g} ms, ITL p50 {m.itl_p50_ms:g} ms / p99 {m.itl_p99_ms:g} ms"
    )
    return Speed("measured", m.tokens_per_s, 1000 / m.itl_p50_ms, m.ttft_ms, cost, m, note)


def _slo_misses(speed: Speed, query: ResolveQuery) -> tuple[str, ...]:
    misses = []
    if query.min_tokens_per_s is not None and speed.tokens_per_s_per_sequence < query.min_tokens_per_s:
        misses.append(f"{speed.tokens_per_s_per_sequence:.1f} < {query.min_tokens_per_s:g} tokens/s per sequence")
    if query.max_ttft_ms is not None:
        if speed.ttft_ms is None:
            misses.append("TTFT unknown (the model_config lacks its parameter count)")
        elif speed.ttft_ms > query.max_ttft_ms:
            misses.append(f"TTFT {speed.ttft_ms:.0f} > {query.max_ttft_ms:g} ms")
    return tuple(misses)


def _candidate(
    artifact: ArtifactView,
    pool: Pool,
    index: int,
    profile: HardwareProfile,
    shape: ModelShape | str,
    query: ResolveQuery,
    how: str,
) -> Candidate:
    plan = plan_replica(
        profile,
        shape,
        artifact.total_size,
        artifact.quant,
        query.context,
        query.concurrency,
        kv_dtype_of(artifact.quant, query.kv_dtype, profile),
        max_devices=pool.free_devices or None,
    )
    speed = _speed(artifact, plan, profile)
    room = pool.free_devices is None or plan.tp <= pool.free_devices
    fits = plan.fits and room
    misses = _slo_misses(speed, query)
    cost = f"${speed.cost_per_mtok:.3g}/Mtok" if speed.cost_per_mtok is not None else "no price"
    ttft = f"TTFT {speed.ttft_ms:.0f} ms" if speed.ttft_ms is not None else "TTFT unknown"
    parts = [
        f"{artifact.name} on {pool.hardware}{f' {how}' if how else ''}: {plan.explanation}",
        f"{speed.tokens_per_s:.1f} tokens/s per replica, {speed.tokens_per_s_per_sequence:.1f} per sequence, "
        f"{ttft}, {cost} ({speed.note})",
        f"eval {artifact.eval_status}" + (f", kl {artifact.kl:g}" if artifact.kl is not None else ""),
    ]
    if not room:
        parts.append(f"the pool has {pool.free_devices} free devices, the replica needs {plan.tp}")
    if misses:
        parts.append("misses the SLO: " + "; ".join(misses))
    return Candidate(artifact, pool, index, plan, speed, fits, not misses, misses, "; ".join(parts))


def _policy_key(c: Candidate, policy: Policy) -> tuple[float, ...]:
    speed = -c.speed.tokens_per_s_per_sequence
    kl = c.artifact.kl if c.artifact.kl is not None else math.inf
    cost = c.speed.cost_per_mtok if c.speed.cost_per_mtok is not None else math.inf
    if policy == "cost":
        return (cost, speed, kl)
    if policy == "quality":
        return (kl, speed, cost)
    return (speed, kl, cost)


def _rank_key(c: Candidate, policy: Policy) -> tuple[object, ...]:
    return (
        not c.fits,
        not c.meets_slo,
        0 if c.artifact.eval_status == "passed" else 1,
        *_policy_key(c, policy),
        c.pool_index,
        c.artifact.name,
    )


def rank_candidates(view: ReleaseView, catalog: HardwareCatalog, query: ResolveQuery, channel: str) -> list[Candidate]:
    """Every (artifact, pool) candidate, best first by the query's policy; the first fits and meets the SLO.

    NO_COMPATIBLE_ARTIFACT says why nothing runs or fits; SLO_UNMET what the best achieves."""
    where = f"{view.model}@{view.version} (channel {channel})"
    profiles = [catalog.get(p.hardware) for p in query.pools]
    names = [p.name for p in profiles]
    details: dict[str, Any] = {"model": view.model, "version": view.version, "hardware": names}
    shape = model_shape(view.model_config)
    candidates: list[Candidate] = []
    why: dict[str, list[str]] = {}  # reason -> "artifact (hardware)"
    failed: list[str] = []
    for index, (pool, profile) in enumerate(zip(query.pools, profiles, strict=True)):
        for a in view.artifacts:
            runs, how = runs_on(a, profile, catalog)
            if not runs:
                why.setdefault(how, []).append(f"{a.name} ({profile.name})" if len(profiles) > 1 else a.name)
            elif a.eval_status == "failed":
                failed.append(f"{a.name} on {profile.name} ({', '.join(a.failed_reasons)})")
            else:
                candidates.append(_candidate(a, pool, index, profile, shape, query, how))
    if not candidates:
        if failed:
            raise NotFound(
                f"every artifact of {where} for {', '.join(names)} failed its eval: {'; '.join(failed)}",
                code="NO_COMPATIBLE_ARTIFACT",
                details={**details, "failed": failed},
            )
        supported = sorted({h for a in view.artifacts for h in a.hardware})
        reasons = "; ".join(f"{reason} ({', '.join(items)})" for reason, items in why.items())
        what = f"{reasons}. Its artifacts run on: {', '.join(supported)}" if supported else "it has no artifacts"
        raise NotFound(
            f"release {where} has no artifact for hardware {', '.join(map(repr, names))}: {what}",
            code="NO_COMPATIBLE_ARTIFACT",
            details={**details, "supported_hardware": supported, "reasons": why},
        )
    ranked = sorted(candidates, key=lambda c: _rank_key(c, query.policy))
    best = ranked[0]
    if not best.fits:
        needs = "; ".join(
            f"{c.artifact.name} on {c.hardware} needs TP {c.plan.tp} × {_human(c.plan.required_per_device_bytes)} "
            f"(weights {_human(c.plan.weights_per_device_bytes)} + KV cache {_human(c.plan.kv_per_device_bytes)}"
            f" per device) of {_human(c.plan.usable_per_device_bytes)} usable"
            + (f", {c.pool.free_devices} free" if c.pool.free_devices is not None else "")
            for c in ranked
        )
        raise NotFound(
            f"no artifact of {where} fits on {', '.join(names)} with context {query.context} × concurrency "
            f"{query.concurrency}: {needs}",
            code="NO_COMPATIBLE_ARTIFACT",
            details={
                **details,
                "memory_bytes": best.plan.memory_per_device_bytes,
                "candidates": [
                    {
                        "artifact": c.artifact.name,
                        "hardware": c.hardware,
                        "tp": c.plan.tp,
                        "required_bytes": c.plan.required_per_device_bytes,
                    }
                    for c in ranked
                ],
            },
        )
    if not best.meets_slo:
        raise NotFound(
            f"no artifact of {where} on {', '.join(names)} meets the SLO; the best, {best.artifact.name} on "
            f"{best.hardware}: {'; '.join(best.slo_misses)}",
            code="SLO_UNMET",
            details={
                **details,
                "best": {
                    "artifact": best.artifact.name,
                    "hardware": best.hardware,
                    "tokens_per_s_per_sequence": best.speed.tokens_per_s_per_sequence,
                    "ttft_ms": best.speed.ttft_ms,
                },
            },
        )
    return ranked


_POLICY_WORDS = {
    "latency": "the fastest per sequence",
    "cost": "the cheapest per million tokens",
    "quality": "the lowest KL divergence from the reference",
}


def explain_choice(ranked: list[Candidate], query: ResolveQuery) -> str:
    """One sentence on why the first candidate won under the policy."""
    best = ranked[0]
    eligible = sum(c.fits and c.meets_slo for c in ranked)
    slo = []
    if query.min_tokens_per_s is not None:
        slo.append(f"≥ {query.min_tokens_per_s:g} tokens/s per sequence")
    if query.max_ttft_ms is not None:
        slo.append(f"TTFT ≤ {query.max_ttft_ms:g} ms")
    meets = f" meeting {' and '.join(slo)}" if slo else ""
    return (
        f"policy {query.policy}: {best.artifact.name} on {best.hardware} (TP {best.plan.tp}) is "
        f"{_POLICY_WORDS[query.policy]} of {eligible} candidate{'s' if eligible != 1 else ''} that fit"
        f"{meets} across {', '.join(p.hardware for p in query.pools)}"
    )
