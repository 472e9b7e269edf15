"""Release operations over a Session: create (open), seal, abandon, yank.

A release is `open` while its artifacts and evals arrive, possibly from many machines. `seal`
checks, in one transaction, that every planned artifact arrived with an eval (or the reason it
was not evaluated) and makes the release `sealed`: complete, immutable, and from then on visible
to resolve, promotion and downloads. An open release that will never be sealed is `abandoned`:
its artifacts are dropped, so `kiln gc` collects their blobs. Services flush; the request commits.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ScalarSelect, Select, case, func, or_, select
from sqlalchemy.orm import Session, joinedload, selectinload

from kiln.core.digest import same_json
from kiln.core.error_codes import Codes
from kiln.core.errors import Conflict, InvalidInput, NotFound
from kiln.registry.artifacts.service import WITH_EVALS, drop_release_artifacts, release_artifact_ids, release_artifacts
from kiln.registry.attestations.policy import unsigned_artifacts
from kiln.registry.attestations.service import drop_attestations
from kiln.registry.audit import service as audit
from kiln.registry.db import insert_once, lock_row, utcnow
from kiln.registry.models.service import get_model, model_id_of
from kiln.registry.paging import Page, keyset_page
from kiln.registry.releases.models import Release
from kiln.registry.releases.schemas import ReleaseCreate


def find_release(session: Session, model: str, version: str, *options: Any) -> Release | None:
    query = select(Release).where(Release.model_id == model_id_of(model), Release.version == version)
    return session.scalars(query.options(*options)).one_or_none()


def get_release_by_id(session: Session, release_id: int) -> Release:
    """The release with this id (one a channel or an artifact names, so it exists)."""
    return session.get_one(Release, release_id)


def release_id_of(model: str, version: str) -> ScalarSelect[int]:
    """The id of `model@version` as a subquery, for another domain's query to filter by in one round trip."""
    return (
        select(Release.id).where(Release.model_id == model_id_of(model), Release.version == version).scalar_subquery()
    )


def served_release_ids(model_id: int) -> Select[int]:
    """The ids of the model's served (sealed, not yanked) releases, as a subquery: all that is served by any name."""
    return select(Release.id).where(
        Release.model_id == model_id, Release.status == "sealed", Release.yanked_at.is_(None)
    )


def model_id_of_release(release_id: int) -> ScalarSelect[int]:
    """The id of the release's model as a subquery."""
    return select(Release.model_id).where(Release.id == release_id).scalar_subquery()


def with_artifacts(*options: Any) -> Any:
    """A loader option for `get_release`: the release's artifacts, each loaded with `options`
    (`registry.artifacts.service.WITH_EVALS`, ...)."""
    return selectinload(Release.artifacts).options(*options)


def releases_with_models(session: Session, *release_ids: Select[int]) -> list[Release]:
    """The releases whose id is in any of the `release_ids` subqueries, each with its model loaded."""
    query = select(Release).where(or_(*(Release.id.in_(ids) for ids in release_ids)))
    return list(session.scalars(query.options(joinedload(Release.model, innerjoin=True))))


def get_release(session: Session, model: str, version: str, *options: Any) -> Release:
    """The release `model@version` (loader `options` applied); NotFound names what is missing."""
    release = find_release(session, model, version, *options)
    if release is None:
        get_model(session, model)  # says "model not found" when that is the problem
        raise NotFound(f"release {model}@{version} not found", details={"model": model, "version": version})
    return release


def lock_release(session: Session, model: str, version: str, *, shared: bool) -> Release:
    """The release, locked for the rest of the transaction (shared: adding to it; exclusive: changing it)."""
    release = get_release(session, model, version)
    lock_row(session, Release.id, release.id, shared=shared)
    session.refresh(release)  # what it is now that we hold the lock
    return release


def releases_page(session: Session, model: str, after: str | None, limit: int) -> Page[Release, Release]:
    """Up to `limit` of the model's releases, newest first, past the version `after` (PAGE_CURSOR_UNKNOWN when
    the model has no such release)."""
    row = get_model(session, model)
    mark = None
    if after is not None:
        mark = session.scalars(
            select(Release).where(Release.model_id == row.id, Release.version == after)
        ).one_or_none()
        if mark is None:
            raise InvalidInput(
                f"model {model!r} has no release {after!r} to list releases after",
                code=Codes.PAGE_CURSOR_UNKNOWN,
                details={"model": model, "after": after},
            )

    def fetch(past: Release | None, n: int) -> list[Release]:
        query = select(Release).where(Release.model_id == row.id)
        if past is not None:
            older = (Release.created_at < past.created_at) | (
                (Release.created_at == past.created_at) & (Release.id < past.id)
            )
            query = query.where(older)
        return list(session.scalars(query.order_by(Release.created_at.desc(), Release.id.desc()).limit(n)))

    return keyset_page(fetch, lambda r: r, mark, limit)


def release_summaries(session: Session, model_ids: list[int]) -> dict[int, tuple[Release, int]]:
    """Per model of `model_ids` that has releases: its newest sealed release (else its newest), and how many
    it has. One query, whatever the number of models."""
    sealed_first = case((Release.status == "sealed", 0), else_=1)
    newest = Release.created_at.desc(), Release.id.desc()
    ranked = (
        select(
            Release.id,
            func.row_number().over(partition_by=Release.model_id, order_by=(sealed_first, *newest)).label("rank"),
            func.count().over(partition_by=Release.model_id).label("releases"),
        )
        .where(Release.model_id.in_(model_ids))
        .subquery()
    )
    query = select(Release, ranked.c.releases).join(ranked, ranked.c.id == Release.id).where(ranked.c.rank == 1)
    return {release.model_id: (release, count) for release, count in session.execute(query)}


def _differences(release: Release, spec: ReleaseCreate) -> list[str]:
    stored = {
        "source_digest": release.source_digest,
        "planned_artifacts": sorted(release.planned_artifacts),
        "lineage": release.lineage,
        "model_config": release.model_config,
    }
    sent = {
        "source_digest": spec.source_digest,
        "planned_artifacts": spec.planned_artifacts,
        "lineage": spec.lineage,
        "model_config": spec.architecture,
    }
    return [key for key in stored if not same_json(stored[key], sent[key])]


def create_release(session: Session, model: str, spec: ReleaseCreate) -> tuple[Release, bool]:
    """Open `model@version`. The same content again is a no-op (a publish re-run after a crash
    continues the same open release); different content is a Conflict."""

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
        planned_artifacts=spec.planned_artifacts,
        status="open",
        lineage=spec.lineage,
        model_config=spec.architecture,
    )
    row, created = insert_once(session, row, lambda: find_release(session, model, spec.version))
    return (row, True) if created else (same(row), False)


def missing_artifacts(release: Release) -> list[str]:
    """Planned artifacts not published yet (needs `artifacts` loaded)."""
    present = {a.name for a in release.artifacts}
    return [name for name in release.planned_artifacts if name not in present]


def seal_release(session: Session, model: str, version: str, actor: str) -> tuple[Release, bool]:
    """Seal an open release once every planned artifact is published with at least one eval result.

    Idempotent: sealing a sealed release returns it (False). RELEASE_INCOMPLETE names what is missing.
    """
    release = lock_release(session, model, version, shared=False)
    if release.status == "sealed":
        return release, False
    release.check_open(model, "publish")
    artifacts = release_artifacts(session, release.id, *WITH_EVALS)
    present = {a.name for a in artifacts}
    missing = [n for n in release.planned_artifacts if n not in present]
    unevaluated = sorted(a.name for a in artifacts if not a.evals)
    if missing or unevaluated:
        parts = []
        if missing:
            parts.append(f"artifacts not published: {', '.join(missing)}")
        if unevaluated:
            parts.append(f"artifacts without an eval result or a reason it was not run: {', '.join(unevaluated)}")
        raise Conflict(
            f"release {model}@{version} is not complete: " + "; ".join(parts),
            code=Codes.RELEASE_INCOMPLETE,
            details={"model": model, "version": version, "missing": missing, "unevaluated": unevaluated},
        )
    unsigned = unsigned_artifacts(session, model, [(a.id, a.name) for a in artifacts])
    if unsigned:
        raise Conflict(
            f"release {model}@{version} has artifacts without a signature by a key trusted for {model!r}: "
            f"{', '.join(unsigned)}; publish them with a signing key (`kiln publish --signing-key`)",
            code=Codes.ARTIFACT_UNSIGNED,
            details={"model": model, "version": version, "unsigned": unsigned},
        )
    release.status = "sealed"
    release.sealed_at = utcnow()
    audit.record(
        session,
        action="release.seal",
        target=f"{model}@{version}",
        model=model,
        actor=actor,
        details={"before": {"status": "open"}, "after": {"status": "sealed"}, "artifacts": sorted(present)},
    )
    session.flush()
    return release, True


def abandon_release(session: Session, model: str, version: str, reason: str, actor: str) -> Release:
    """Abandon an open release: its artifacts and evals are dropped (their blobs become collectable)."""
    release = lock_release(session, model, version, shared=False)
    if release.status == "abandoned":
        return release
    if release.status == "sealed":
        raise Conflict(
            f"release {model}@{version} is sealed; a sealed release is yanked, not abandoned",
            code=Codes.RELEASE_SEALED,
            details={"model": model, "version": version, "status": release.status},
        )
    drop_attestations(session, release_artifact_ids(release.id))
    dropped = drop_release_artifacts(session, release.id)
    release.status = "abandoned"
    release.abandoned_at = utcnow()
    release.abandon_reason = reason
    audit.record(
        session,
        action="release.abandon",
        target=f"{model}@{version}",
        model=model,
        actor=actor,
        reason=reason,
        details={"before": {"status": "open"}, "after": {"status": "abandoned"}, "dropped_artifacts": dropped},
    )
    session.flush()
    return release


def yank_release(session: Session, model: str, version: str, reason: str, actor: str, channels: list[str]) -> Release:
    """Mark a sealed release yanked (idempotent), audited with who, why and the channels still naming it."""
    release = lock_release(session, model, version, shared=False)
    if release.status != "sealed":
        raise Conflict(
            f"release {model}@{version} is {release.status}, not sealed: an open release is abandoned, not yanked",
            code=Codes.RELEASE_NOT_SEALED,
            details={"model": model, "version": version, "status": release.status},
        )
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
            details={"before": {"yanked": False}, "after": {"yanked": True}, "channels": channels},
        )
        session.flush()
    return release
