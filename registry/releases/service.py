"""Release operations over a Session. Releases are immutable once created."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.errors import Conflict, NotFound
from registry.db import insert_once, utcnow
from registry.models.models import Model
from registry.models.service import get_model
from registry.releases.models import Release
from registry.releases.schemas import ReleaseCreate


def find_release(session: Session, model: str, version: str, *options: Any) -> Release | None:
    query = select(Release).join(Release.model).where(Model.name == model, Release.version == version)
    return session.scalars(query.options(*options)).one_or_none()


def get_release(session: Session, model: str, version: str, *options: Any) -> Release:
    """The release `model@version` (loader `options` applied); NotFound names what is missing."""
    release = find_release(session, model, version, *options)
    if release is None:
        get_model(session, model)  # says "model not found" when that is the problem
        raise NotFound(f"release {model}@{version} not found", details={"model": model, "version": version})
    return release


def list_releases(session: Session, model: str) -> list[Release]:
    row = get_model(session, model)
    query = select(Release).where(Release.model_id == row.id).order_by(Release.created_at.desc(), Release.id.desc())
    return list(session.scalars(query))


def _differences(release: Release, spec: ReleaseCreate) -> list[str]:
    stored = {"source_digest": release.source_digest, "lineage": release.lineage, "model_config": release.model_config}
    sent = {"source_digest": spec.source_digest, "lineage": spec.lineage, "model_config": spec.architecture}
    return [key for key in stored if stored[key] != sent[key]]


def create_release(session: Session, model: str, spec: ReleaseCreate) -> tuple[Release, bool]:
    """Create `model@version`. The same content again is a no-op; different content is a Conflict."""

    def same(existing: Release) -> Release:
        differing = _differences(existing, spec)
        if differing:
            raise Conflict(
                f"release {model}@{spec.version} already exists with different {', '.join(differing)}; "
                "releases are immutable: publish a new version",
                details={"model": model, "version": spec.version, "differing": differing},
            )
        return existing

    model_row = get_model(session, model)
    existing = find_release(session, model, spec.version)
    if existing is not None:
        return same(existing), False
    row = Release(
        model_id=model_row.id,
        version=spec.version,
        source_digest=spec.source_digest,
        lineage=spec.lineage,
        model_config=spec.architecture,
    )
    row, created = insert_once(session, row, lambda: find_release(session, model, spec.version))
    return (row, True) if created else (same(row), False)


def yank_release(session: Session, model: str, version: str, reason: str, actor: str) -> Release:
    """Mark a release yanked (idempotent), audited with who, why and the channels still naming it."""
    from registry.audit import service as audit
    from registry.channels.service import channels_of_release

    release = get_release(session, model, version)
    if release.yanked_at is None:
        release.yanked_at = utcnow()
        release.yank_reason = reason
        audit.record(
            session,
            action="release.yank",
            target=f"{model}@{version}",
            model=model,
            actor=actor,
            reason=reason,
            details={
                "before": {"yanked": False},
                "after": {"yanked": True},
                "channels": channels_of_release(session, release.id),
            },
        )
        session.commit()
    return release
