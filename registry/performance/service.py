"""Measured performance records: posted per artifact and SKU, read by resolve in place of its estimates."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.core.error_codes import Codes
from kiln.core.errors import Conflict, InvalidInput
from kiln.core.performance import PerformanceCreate
from kiln.registry.hardware.service import effective_catalog
from kiln.registry.paging import Page, keyset_page
from kiln.registry.performance.models import PerformanceRecord
from kiln.registry.releases.contents import get_artifact
from kiln.registry.releases.service import lock_release
from kiln.registry.resolve.service import bump_routing_revision


def post_record(
    session: Session, model: str, version: str, artifact: str, spec: PerformanceCreate, actor: str
) -> PerformanceRecord:
    """Record one measurement; the SKU must be in the catalog and run the artifact (as resolve judges it:
    built for it, or of the same architecture as an SKU it was built for), and the release must not be
    yanked (RELEASE_YANKED: it is never served, so nothing routes by what it measured)."""
    # Shared, as publishers hold it: a yank (exclusive) lands before this or after it is recorded.
    release = lock_release(session, model, version, shared=True)
    if release.yanked_at is not None:
        raise Conflict(
            f"release {model}@{version} is yanked ({release.yank_reason}): it is never served, so it takes no "
            "performance records",
            code=Codes.RELEASE_YANKED,
            details={"model": model, "version": version},
        )
    row = get_artifact(session, model, version, artifact)
    catalog = effective_catalog(session)
    profile = catalog.get(spec.hardware)
    if spec.itl_p99_ms < spec.itl_p50_ms:
        raise InvalidInput(
            f"itl_p99_ms {spec.itl_p99_ms} is below itl_p50_ms {spec.itl_p50_ms}", code=Codes.PERFORMANCE_INVALID
        )
    if spec.tp > profile.devices_per_node:
        raise InvalidInput(
            f"tp {spec.tp} is more than the {profile.devices_per_node} devices of a {profile.name} node",
            code=Codes.PERFORMANCE_INVALID,
            details={"hardware": profile.name, "devices_per_node": profile.devices_per_node},
        )
    runs = spec.hardware in row.hardware or (
        spec.hardware not in row.unsupported and catalog.twin(profile, row.hardware) is not None
    )
    if not runs:
        raise InvalidInput(
            f"{model}@{version}/{artifact} does not run on {spec.hardware}; it runs on {', '.join(row.hardware)}"
            " (and SKUs of their architectures)",
            code=Codes.PERFORMANCE_INVALID,
            details={"hardware": spec.hardware, "artifact_hardware": list(row.hardware)},
        )
    record = PerformanceRecord(artifact_id=row.id, recorded_by=actor, **spec.model_dump())
    session.add(record)
    bump_routing_revision(session)
    session.flush()
    return record


def records_page(
    session: Session, model: str, version: str, artifact: str, after: int | None, limit: int
) -> Page[PerformanceRecord, int]:
    """Up to `limit` of the artifact's records, newest first, older than the record `after`."""
    row = get_artifact(session, model, version, artifact)

    def fetch(past: int | None, n: int) -> list[PerformanceRecord]:
        query = select(PerformanceRecord).where(PerformanceRecord.artifact_id == row.id)
        query = query if past is None else query.where(PerformanceRecord.id < past)
        return list(session.scalars(query.order_by(PerformanceRecord.id.desc()).limit(n)))

    return keyset_page(fetch, lambda r: r.id, after, limit)


def records_of_artifacts(session: Session, artifact_ids: list[int]) -> list[PerformanceRecord]:
    """The performance records of the artifacts, newest first."""
    query = select(PerformanceRecord).where(PerformanceRecord.artifact_id.in_(artifact_ids))
    return list(session.scalars(query.order_by(PerformanceRecord.id.desc())))
