"""The database reads of resolve: a channel's snapshot (the release or weighted split it points at, the routing
revision), a release asked for by version, the hardware catalog at a revision, and a release's view with its
artifacts, evals and measurements."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from sqlalchemy.orm import Session

from kiln.core.error_codes import Codes
from kiln.core.errors import NotFound
from kiln.core.evals import eval_status
from kiln.core.hardware import HardwareCatalog
from kiln.core.manifest import ArtifactIdentity
from kiln.core.resolve import MeasurementOut
from kiln.core.shape import ShapeRecord
from kiln.registry.artifacts.service import WITH_EVALS, WITH_FILES_AND_EVALS, Artifact, release_artifacts
from kiln.registry.channels.buckets import BASIS_POINTS, merged, reassign
from kiln.registry.channels.service import channel_names
from kiln.registry.models.service import get_model
from kiln.registry.performance.service import records_of_artifacts
from kiln.registry.releases.service import get_release, get_release_by_id, with_artifacts
from kiln.registry.resolve.cache import (
    MAX_FINGERPRINTS,
    ChannelFingerprints,
    ChannelSnapshot,
    FingerprintRow,
    ResolveCache,
    SnapshotKey,
)
from kiln.registry.resolve.views import ArtifactView, FileView, ReleaseView


def _channel_not_found(session: Session, model: str, channel: str) -> NotFound:
    model_row = get_model(session, model)  # raises "model not found" first
    names = channel_names(session, model_row.id)
    known = f"its channels: {', '.join(names)}" if names else "it has no channels yet"
    return NotFound(
        f"model {model!r} has no channel {channel!r}; {known}",
        details={"model": model, "channel": channel, "channels": names},
    )


def channel_snapshot(
    fingerprints: ChannelFingerprints, session_factory: Callable[[], Session], model: str, channel: str
) -> ChannelSnapshot:
    """One indexed query: the release(s) `model`'s `channel` points at, with weights, and the routing revision.

    Only a miss opens a session, to say precisely what is missing (the model, or its channel). Blocking."""
    row = fingerprints.lookup(model, channel)
    if row is None:
        with session_factory() as session:
            raise _channel_not_found(session, model, channel)
    return snapshot_of(fingerprints, model, channel, row)


def snapshot_of(fingerprints: ChannelFingerprints, model: str, channel: str, row: FingerprintRow) -> ChannelSnapshot:
    """The snapshot a fingerprint row describes (built once per row); CHANNEL_RELEASE_YANKED. No I/O."""
    release_id, version, evals_through, yanked_at, split, revision = row
    if yanked_at is not None:
        raise NotFound(
            f"channel {channel!r} of {model!r} points at release {version}, which is yanked; "
            "resolve never returns a yanked release: promote another one",
            code=Codes.CHANNEL_RELEASE_YANKED,
            details={"model": model, "channel": channel, "version": version},
        )
    # SQLite hands JSON back as text, PostgreSQL parsed: the text (or its dump) keys the built snapshot.
    split_text = split if isinstance(split, str) or split is None else json.dumps(split, sort_keys=True)
    fingerprint = (release_id, version, evals_through, split_text, revision)
    snapshot = fingerprints.snapshots.get(fingerprint)
    if snapshot is None:
        snapshot = _build_snapshot(fingerprint)
        if len(fingerprints.snapshots) >= MAX_FINGERPRINTS:
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


def release_snapshot(session: Session, model: str, version: str) -> SnapshotKey:
    """`model@version` asked for by version rather than through a channel: judged by every eval result it has
    (a channel judges its release by those it was promoted with). NotFound names the model or release missing."""
    release = get_release(session, model, version, with_artifacts(*WITH_EVALS))
    evals_through = max((e.id for a in release.artifacts for e in a.evals), default=0)
    return SnapshotKey(release.id, release.version, evals_through)


def load_catalog(session_factory: Callable[[], Session], revision: int, cache: ResolveCache) -> HardwareCatalog:
    """The registry's hardware catalog at `revision` (built-in entries and the registry's own)."""
    catalog = cache.catalogs.get(revision)
    if catalog is None:
        from kiln.registry.hardware.service import effective_catalog

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
    release = get_release_by_id(session, snapshot.release_id)
    artifacts = release_artifacts(session, snapshot.release_id, *WITH_FILES_AND_EVALS)
    measured: dict[int, list[MeasurementOut]] = {}
    for r in records_of_artifacts(session, [a.id for a in artifacts]):
        measured.setdefault(r.artifact_id, []).append(
            MeasurementOut(
                id=r.id,
                hardware=r.hardware,
                runtime=r.runtime,
                runtime_version=r.runtime_version,
                tp=r.tp,
                context=r.context,
                concurrency=r.concurrency,
                tokens_per_s=r.tokens_per_s,
                ttft_ms=r.ttft_ms,
                itl_p50_ms=r.itl_p50_ms,
                itl_p99_ms=r.itl_p99_ms,
                recorded_at=r.recorded_at.isoformat(),
            )
        )
    view = ReleaseView(
        model,
        release.version,
        ShapeRecord.from_untrusted(release.model_config),
        tuple(_artifact_view(a, snapshot.evals_through, measured.get(a.id, [])) for a in artifacts),
    )
    if cache is not None:
        cache.views.put((snapshot, revision), view)
    return view


def _artifact_view(a: Artifact, evals_through: int, measurements: list[MeasurementOut]) -> ArtifactView:
    """The artifact as the channel judges it: by the eval results it was promoted with."""
    evals = [e for e in a.evals if e.id <= evals_through]
    kls = [e.metrics.kl for e in evals if e.metrics is not None]
    return ArtifactView(
        identity=ArtifactIdentity.of(a),
        manifest_digest=a.manifest_digest,
        unsupported=dict(a.unsupported),
        total_size=a.total_size,
        eval_status=eval_status(evals),
        kl=min(kls) if kls and all(math.isfinite(k) for k in kls) else None,
        failed_reasons=tuple(f"{e.runtime}: {e.reason or 'failed'}" for e in evals if e.status == "failed"),
        files=tuple(FileView(f.path, f.sha256, f.size) for f in a.files),
        measurements=tuple(measurements),
    )
