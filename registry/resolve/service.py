"""Resolve: rank a channel's artifacts for one hardware profile by fit, eval status and speed.

The database work is a snapshot of the release (`load_release_view`); the ranking
(`rank_candidates`) is a pure function of that snapshot and the hardware profile.

Resolve is the hot path (routers ask it on every failover), so snapshots are cached per process.
Each request still asks the database one indexed question (`_FINGERPRINT`: which release the
channel points at, and the newest eval result it was promoted with), so a promotion is seen at
once, by every worker. A channel points only at sealed releases, whose artifacts never change, and
an eval posted after the promotion is not read until the channel is promoted again.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import Engine, bindparam, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, selectinload

from core.errors import NotFound, Unavailable
from core.hardware import HardwareProfile
from registry.artifacts.models import Artifact, EvalStatus, eval_status
from registry.channels.models import Channel
from registry.models.models import Model
from registry.models.service import get_model
from registry.releases.models import Release

K = TypeVar("K")
V = TypeVar("V")

KV_BYTES_PER_ELEMENT = 2  # fp16/bf16 KV cache
OVERHEAD = 1.10  # activations, allocator slack, runtime buffers
GIB = 1024**3

# Keys read from a release's model_config, Hugging Face names first.
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "layers")
_HEADS = ("num_attention_heads", "n_head", "heads")
_KV_HEADS = ("num_key_value_heads", "kv_heads", "num_kv_heads")
_HEAD_DIM = ("head_dim",)
_HIDDEN = ("hidden_size", "n_embd", "hidden")


@dataclass(frozen=True)
class FileView:
    path: str
    sha256: str
    size: int


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


@dataclass(frozen=True)
class ReleaseView:
    model: str
    version: str
    model_config: dict[str, Any]
    artifacts: tuple[ArtifactView, ...]


@dataclass(frozen=True)
class Candidate:
    artifact: ArtifactView
    fits: bool
    weights_bytes: int
    kv_cache_bytes: int
    memory_bytes: int
    required_bytes: int
    decode_tokens_per_s_bound: float
    explanation: str


# Larger values are not an architecture (the largest models have ~10^2 layers, 10^5 hidden): a
# release's model_config is publisher input, so anything past this is treated as missing.
MAX_DIMENSION = 2**24


def _first_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_DIMENSION:
            return value
    return None


def kv_cache_shape(config: dict[str, Any]) -> tuple[int, int, int] | str:
    """(layers, kv_heads, head_dim) from a model config, or a sentence saying what is missing."""
    layers = _first_int(config, _LAYERS)
    heads = _first_int(config, _HEADS)
    kv_heads = _first_int(config, _KV_HEADS) or heads
    head_dim = _first_int(config, _HEAD_DIM)
    hidden = _first_int(config, _HIDDEN)
    if head_dim is None and hidden is not None and heads:
        head_dim = hidden // heads
    missing = [
        name
        for name, value in (("num_hidden_layers", layers), ("num_key_value_heads", kv_heads), ("head_dim", head_dim))
        if value is None
    ]
    if missing or layers is None or kv_heads is None or head_dim is None:
        return "the release's model_config lacks " + ", ".join(missing) + ", so the KV cache is not counted"
    return layers, kv_heads, head_dim


def kv_cache_bytes(shape: tuple[int, int, int], context: int, concurrency: int) -> int:
    layers, kv_heads, head_dim = shape
    return 2 * layers * kv_heads * head_dim * context * concurrency * KV_BYTES_PER_ELEMENT


def _human(n: int | float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# Built once with bound parameters, so SQLAlchemy's compiled-statement cache hit is cheap.
_FINGERPRINT = (
    select(Release.id, Release.version, Channel.evals_through, Release.yanked_at)
    .join(Channel, Channel.release_id == Release.id)
    .join(Model, Model.id == Channel.model_id)
    .where(Model.name == bindparam("model"), Channel.name == bindparam("channel"))
)


@dataclass(frozen=True)
class SnapshotKey:
    """What `_FINGERPRINT` reads: it changes whenever the release view of a channel would.

    A channel points only at sealed releases, whose artifacts never change, and judges them by
    the eval results up to `evals_through` (which never change either): so the release and that
    eval id name the view exactly.
    """

    release_id: int
    version: str
    evals_through: int


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

    def lookup(self, model: str, channel: str) -> tuple[int, str, int, Any] | None:
        """(release id, version, evals_through, yanked_at) of `model`'s `channel`, or None."""
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
            row: tuple[int, str, int, Any] | None = self._rows[key]
            return row
        except DBAPIError as exc:
            self.close()
            raise Unavailable(f"database unavailable ({type(exc).__name__})") from None
        except self._engine.dialect.loaded_dbapi.Error as exc:
            self.close()
            raise Unavailable(f"database unavailable ({type(exc).__name__})") from None

    def _query(self, model: str, channel: str) -> tuple[int, str, int, Any] | None:
        params = {"model": model, "channel": channel}
        args: Any = [params[name] for name in self._positional] if self._positional is not None else params
        row = self._fetchone(self._sql, args)
        return None if row is None else (row[0], row[1], row[2], row[3])

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
    """Per-process caches for resolve: release views, and rendered answers keyed by everything they depend on."""

    def __init__(self, fingerprints: ChannelFingerprints, max_views: int = 1024, max_answers: int = 8192):
        self.fingerprints = fingerprints
        self.views: LRUCache[SnapshotKey, ReleaseView] = LRUCache(max_views)
        self.answers: LRUCache[tuple[object, ...], bytes] = LRUCache(max_answers)


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
) -> SnapshotKey:
    """One indexed query: the release `model`'s `channel` points at, and the newest eval it was promoted with.

    Only a miss opens a session, to say precisely what is missing (the model, or its channel)."""
    row = fingerprints.lookup(model, channel)
    if row is None:
        with session_factory() as session:
            raise _channel_not_found(session, model, channel)
    release_id, version, evals_through, yanked_at = row
    if yanked_at is not None:
        raise NotFound(
            f"channel {channel!r} of {model!r} points at release {version}, which is yanked; "
            "resolve never returns a yanked release: promote another one",
            code="CHANNEL_RELEASE_YANKED",
            details={"model": model, "channel": channel, "version": version},
        )
    return SnapshotKey(release_id, version, evals_through)


def load_release_view(
    session: Session, model: str, snapshot: SnapshotKey, cache: ResolveCache | None = None
) -> ReleaseView:
    """The release of `snapshot` with its artifacts, files and evals (three queries, or none if cached)."""
    view = cache.views.get(snapshot) if cache is not None else None
    if view is not None:
        return view
    release = session.get_one(Release, snapshot.release_id)
    artifacts = session.scalars(
        select(Artifact)
        .where(Artifact.release_id == snapshot.release_id)
        .order_by(Artifact.name)
        .options(selectinload(Artifact.files), selectinload(Artifact.evals))
    )
    view = ReleaseView(
        model,
        release.version,
        release.model_config,
        tuple(_artifact_view(a, snapshot.evals_through) for a in artifacts),
    )
    if cache is not None:
        cache.views.put(snapshot, view)
    return view


def _artifact_view(a: Artifact, evals_through: int) -> ArtifactView:
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
    )


def _candidate(
    artifact: ArtifactView, profile: HardwareProfile, shape: tuple[int, int, int] | str, context: int, concurrency: int
) -> Candidate:
    weights = artifact.total_size
    kv = kv_cache_bytes(shape, context, concurrency) if isinstance(shape, tuple) else 0
    memory = int(profile.memory_gib * GIB)
    required = math.ceil((weights + kv) * OVERHEAD)
    fits = required <= memory
    tps = profile.bandwidth_gbs * 1e9 / max(weights, 1)
    parts = [
        f"{artifact.name}: weights {_human(weights)} + KV cache {_human(kv)} "
        f"(context {context} × concurrency {concurrency}) + 10% = {_human(required)}, "
        + ("fits in" if fits else "does not fit in")
        + f" {_human(memory)} on {profile.name}",
        f"decode bound {tps:.1f} tokens/s ({profile.bandwidth_gbs:g} GB/s ÷ weight bytes)",
        f"eval {artifact.eval_status}",
    ]
    if isinstance(shape, str):
        parts.append(shape)
    if artifact.kl is not None:
        parts.append(f"kl {artifact.kl:g}")
    return Candidate(artifact, fits, weights, kv, memory, required, tps, "; ".join(parts))


def _rank_key(c: Candidate) -> tuple[bool, int, float, float, str]:
    kl = c.artifact.kl if c.artifact.kl is not None else math.inf
    return (
        not c.fits,
        0 if c.artifact.eval_status == "passed" else 1,
        -c.decode_tokens_per_s_bound,
        kl,
        c.artifact.name,
    )


def rank_candidates(
    view: ReleaseView, profile: HardwareProfile, context: int, concurrency: int, channel: str
) -> list[Candidate]:
    """Candidates for `profile`, best first; the first one fits. NO_COMPATIBLE_ARTIFACT says why none does."""
    where = f"{view.model}@{view.version} (channel {channel})"
    details: dict[str, Any] = {"model": view.model, "version": view.version, "hardware": profile.name}
    for_hw = [a for a in view.artifacts if profile.name in a.hardware]
    if not for_hw:
        supported = sorted({h for a in view.artifacts for h in a.hardware})
        # Why not, per reason (the capability the hardware lacks), with the artifacts it rules out.
        why: dict[str, list[str]] = {}
        for a in view.artifacts:
            why.setdefault(a.unsupported.get(profile.name, "not built for it"), []).append(a.name)
        reasons = "; ".join(f"{reason} ({', '.join(names)})" for reason, names in why.items())
        what = f"{reasons}. Its artifacts run on: {', '.join(supported)}" if supported else "it has no artifacts"
        raise NotFound(
            f"release {where} has no artifact for hardware {profile.name!r}: {what}",
            code="NO_COMPATIBLE_ARTIFACT",
            details={**details, "supported_hardware": supported, "reasons": why},
        )
    usable = [a for a in for_hw if a.eval_status != "failed"]
    if not usable:
        failures = "; ".join(f"{a.name} ({', '.join(a.failed_reasons)})" for a in for_hw)
        raise NotFound(
            f"every artifact of {where} for {profile.name!r} failed its eval: {failures}",
            code="NO_COMPATIBLE_ARTIFACT",
            details={**details, "failed": [a.name for a in for_hw]},
        )
    shape = kv_cache_shape(view.model_config)
    ranked = sorted((_candidate(a, profile, shape, context, concurrency) for a in usable), key=_rank_key)
    if not ranked[0].fits:
        needs = "; ".join(
            f"{c.artifact.name} needs {_human(c.required_bytes)} "
            f"(weights {_human(c.weights_bytes)} + KV cache {_human(c.kv_cache_bytes)} + 10%)"
            for c in ranked
        )
        raise NotFound(
            f"no artifact of {where} for {profile.name!r} fits in its {_human(ranked[0].memory_bytes)} "
            f"with context {context} × concurrency {concurrency}: {needs}",
            code="NO_COMPATIBLE_ARTIFACT",
            details={
                **details,
                "memory_bytes": ranked[0].memory_bytes,
                "candidates": [{"artifact": c.artifact.name, "required_bytes": c.required_bytes} for c in ranked],
            },
        )
    return ranked
