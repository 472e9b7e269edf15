"""Artifact and eval-result operations over a Session."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel
from sqlalchemy import ColumnElement, Select, exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import InstrumentedAttribute, Session, selectinload

from kiln.core.error_codes import Codes
from kiln.core.errors import Conflict, InvalidInput, NotFound
from kiln.core.manifest import ArtifactIdentity, ArtifactManifest, FileEntry, check_relative_path

# The rows this service returns, which other domains read (and name in their annotations).
from kiln.registry.artifacts.models import Artifact, ArtifactFile, EvalResult
from kiln.registry.artifacts.schemas import EvalCreate
from kiln.registry.blobs.service import stored_sizes
from kiln.registry.db import insert_once
from kiln.registry.paging import Page, keyset_page

# An artifact's release, by id or as a subquery (`registry.releases.service.release_id_of`).
ReleaseId = int | ColumnElement[int]


class ReleaseRef(Protocol):
    """The release an artifact operation works in: a `registry.releases.models.Release` the caller looked up
    (and locked, for a change). Releases call down into artifacts, never the reverse
    (`registry.releases.contents` addresses artifacts by model and version)."""

    @property
    def id(self) -> int: ...
    @property
    def version(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def planned_artifacts(self) -> list[str]: ...

    def check_open(self, model: str, doing: str) -> None:
        """Conflict unless artifacts may still be added to the release."""
        ...


# Loader options for the functions below that take them (and `releases.service.with_artifacts`).
WITH_EVALS = (selectinload(Artifact.evals),)
WITH_FILES = (selectinload(Artifact.files),)
WITH_FILES_AND_EVALS = (*WITH_FILES, *WITH_EVALS)


def manifest_of(artifact: Artifact) -> ArtifactManifest:
    """The manifest as published (needs `files` loaded)."""
    return ArtifactManifest.of(
        artifact, files=[FileEntry(path=f.path, sha256=f.sha256, size=f.size) for f in artifact.files]
    )


def _artifact_query(release_id: ReleaseId, name: str) -> Any:
    return select(Artifact).where(Artifact.release_id == release_id, Artifact.name == name)


def find_artifact(session: Session, release_id: ReleaseId, name: str) -> Artifact | None:
    """The release's artifact `name`, with its files and evals loaded."""
    query = _artifact_query(release_id, name).options(*WITH_FILES_AND_EVALS)
    return session.scalars(query).one_or_none()


def artifact_not_found(model: str, version: str, name: str) -> NotFound:
    """The release `model@version` is there, its artifact `name` is not."""
    return NotFound(
        f"artifact {name!r} not found in release {model}@{version}",
        details={"model": model, "version": version, "artifact": name},
    )


def get_artifact(session: Session, release: ReleaseRef, model: str, name: str) -> Artifact:
    """The release's artifact `name`, files and evals loaded; NotFound when it has none of that name."""
    artifact = find_artifact(session, release.id, name)
    if artifact is None:
        raise artifact_not_found(model, release.version, name)
    return artifact


def artifacts_page(session: Session, release_id: int, after: str | None, limit: int) -> Page[Artifact, str]:
    """Up to `limit` of the release's artifacts, by name past `after`, each with its evals."""

    def fetch(past: str | None, n: int) -> list[Artifact]:
        query = select(Artifact).where(Artifact.release_id == release_id)
        query = query if past is None else query.where(Artifact.name > past)
        return list(session.scalars(query.order_by(Artifact.name).limit(n).options(*WITH_EVALS)))

    return keyset_page(fetch, lambda a: a.name, after, limit)


def release_artifacts(session: Session, release_id: int, *options: Any) -> list[Artifact]:
    """The artifacts of a release, by name (loader `options` applied: `WITH_EVALS`, ...)."""
    query = select(Artifact).where(Artifact.release_id == release_id).order_by(Artifact.name).options(*options)
    return list(session.scalars(query))


def release_artifact_ids(release_id: int) -> Select[int]:
    """The ids of the release's artifacts, as a subquery."""
    return select(Artifact.id).where(Artifact.release_id == release_id)


def artifact_files(session: Session, artifact_id: int) -> list[ArtifactFile]:
    """The files of an artifact, by path."""
    query = select(ArtifactFile).where(ArtifactFile.artifact_id == artifact_id).order_by(ArtifactFile.path)
    return list(session.scalars(query))


def drop_release_artifacts(session: Session, release_id: int) -> list[str]:
    """Delete the release's artifacts with their files and evals (attestations go first, by their service);
    returns the names dropped, sorted. For abandoning a release."""
    artifact_ids = release_artifact_ids(release_id)
    dropped = sorted(session.scalars(select(Artifact.name).where(Artifact.release_id == release_id)))
    for table in (EvalResult, ArtifactFile):
        session.query(table).filter(table.artifact_id.in_(artifact_ids)).delete(synchronize_session=False)
    session.query(Artifact).filter(Artifact.release_id == release_id).delete(synchronize_session=False)
    return dropped


def served_artifacts(
    session: Session,
    served_release_ids: Select[int],
    *options: Any,
    artifact_id: int | None = None,
    digest_prefix: str | None = None,
) -> list[Artifact]:
    """The artifacts of the served (sealed, not yanked) releases in the `served_release_ids` subquery
    (`registry.releases.contents.served_artifacts` names their versions), by id, with loader `options`; only
    the one with `artifact_id`, or those whose manifest digest starts with `digest_prefix`, when given."""
    query = select(Artifact).where(Artifact.release_id.in_(served_release_ids)).options(*options).order_by(Artifact.id)
    if artifact_id is not None:
        query = query.where(Artifact.id == artifact_id)
    if digest_prefix is not None:
        query = query.where(Artifact.manifest_digest.startswith(digest_prefix, autoescape=True))
    return list(session.scalars(query))


def artifact_ids_with_blob(sha256: str, path: str | None = None) -> Select[int]:
    """The ids of the artifacts with a file whose bytes are the blob (at `path`, when given), as a subquery."""
    query = select(ArtifactFile.artifact_id).where(ArtifactFile.sha256 == sha256)
    return query if path is None else query.where(ArtifactFile.path == path)


def release_ids_of(artifact_ids: Select[int]) -> Select[int]:
    """The ids of the releases of the artifacts in the `artifact_ids` subquery, as a subquery."""
    return select(Artifact.release_id).where(Artifact.id.in_(artifact_ids))


def served_among(session: Session, served_release_ids: Select[int], artifact_ids: Select[int]) -> list[int]:
    """The artifacts in the `artifact_ids` subquery that are artifacts of a release in the `served_release_ids`
    subquery (`registry.releases.service.served_release_ids`: a model's served releases)."""
    query = select(Artifact.id).where(Artifact.id.in_(artifact_ids), Artifact.release_id.in_(served_release_ids))
    return list(session.scalars(query))


class ArtifactFileBlobs:
    """Artifact files hold their blobs (`registry.blobs.references.BlobReferences`)."""

    def holds(self, sha256: InstrumentedAttribute[str]) -> ColumnElement[bool]:
        return exists().where(ArtifactFile.sha256 == sha256)

    def drop_with(self, session: Session, sha256: str) -> None:
        """Nothing: a blob an artifact file holds is never collected."""


def _check_blobs(session: Session, manifest: ArtifactManifest) -> None:
    stored = stored_sizes(session, {f.sha256 for f in manifest.files})
    problems: list[dict[str, Any]] = []
    described: list[str] = []
    for f in manifest.files:
        size = stored.get(f.sha256)
        if size != f.size:
            problems.append({"path": f.path, "sha256": f.sha256, "size": f.size, "stored_size": size})
            state = "not uploaded" if size is None else f"has {size} bytes, not {f.size}"
            described.append(f"{f.path} (blob {f.sha256[:12]}… {state})")
    if problems:
        raise InvalidInput(
            "upload these files' blobs first: " + ", ".join(described),
            code=Codes.BLOB_MISSING,
            details={"missing": problems},
        )


def publish_artifact(
    session: Session, release: ReleaseRef, model: str, manifest: ArtifactManifest
) -> tuple[Artifact, bool]:
    """Record an artifact of an open release whose blobs are all stored (`release` locked, shared, by the caller).

    Same content again: no-op (also once sealed, so a re-run of a publish is harmless); different
    content: Conflict; a new artifact for a sealed, abandoned or yanked release, or one the release
    did not plan: Conflict.
    """
    version = release.version
    digest = manifest.content_digest()

    def same(existing: Artifact) -> Artifact:
        if existing.manifest_digest != digest:
            raise Conflict(
                f"artifact {manifest.name!r} of {model}@{version} already exists with different content "
                f"(stored digest {existing.manifest_digest[:12]}…, sent {digest[:12]}…)",
                details={
                    "artifact": manifest.name,
                    "stored_digest": existing.manifest_digest,
                    "sent_digest": digest,
                },
            )
        return existing

    existing = find_artifact(session, release.id, manifest.name)
    if existing is not None:
        return same(existing), False
    release.check_open(model, f"publish artifact {manifest.name!r}")
    if manifest.name not in release.planned_artifacts:
        raise Conflict(
            f"release {model}@{version} did not plan an artifact {manifest.name!r}; "
            f"planned: {', '.join(release.planned_artifacts)}",
            code=Codes.ARTIFACT_NOT_PLANNED,
            details={"artifact": manifest.name, "planned": release.planned_artifacts},
        )
    _check_blobs(session, manifest)
    artifact = Artifact(
        release_id=release.id,
        **ArtifactIdentity.of(manifest).model_dump(),
        unsupported=dict(manifest.unsupported),
        provenance=manifest.provenance,
        manifest_digest=digest,
        total_size=manifest.total_size,
        files=[ArtifactFile(path=f.path, sha256=f.sha256, size=f.size) for f in manifest.files],
        evals=[],
    )
    try:
        row, created = insert_once(session, artifact, lambda: find_artifact(session, release.id, manifest.name))
    except IntegrityError:
        # A blob checked above was garbage-collected before our insert (its foreign key failed):
        # the same BLOB_MISSING as if the check had seen it, so the client uploads it again.
        _check_blobs(session, manifest)
        raise
    return (row, True) if created else (same(row), False)


def check_file_path(path: str) -> None:
    """InvalidInput for a file path that could escape the artifact."""
    try:
        check_relative_path(path)
    except ValueError as exc:
        raise InvalidInput(str(exc), details={"path": path}) from None


def find_artifact_file(session: Session, release_id: ReleaseId, name: str, path: str) -> ArtifactFile | None:
    """The file `path` of the release's artifact `name`."""
    query = (
        select(ArtifactFile)
        .join(ArtifactFile.artifact)
        .where(Artifact.release_id == release_id, Artifact.name == name, ArtifactFile.path == path)
    )
    return session.scalars(query).one_or_none()


def _find_eval(session: Session, artifact_id: int, runtime: str) -> EvalResult | None:
    query = select(EvalResult).where(EvalResult.artifact_id == artifact_id, EvalResult.runtime == runtime)
    return session.scalars(query).one_or_none()


def _evidence(result: EvalResult | EvalCreate) -> tuple[object, ...]:
    """What makes two results of one runtime the same: compared as JSON, where a NaN equals a NaN."""

    def dumped(record: BaseModel | None) -> str | None:
        return None if record is None else record.model_dump_json()

    return (result.status, result.runtime_version, dumped(result.metrics), dumped(result.gates), result.reason)


def post_eval(
    session: Session, release: ReleaseRef, model: str, name: str, spec: EvalCreate
) -> tuple[EvalResult, bool]:
    """Record one runtime's eval of an artifact of `release` (locked, shared, by the caller). Same result
    again: no-op; a different one: Conflict.

    Evals may arrive after sealing (a GPU runner's, later); a channel serving the release judges
    it by the evals it was promoted with until it is promoted again.
    """

    version = release.version

    def same(existing: EvalResult) -> EvalResult:
        # The runtime version is part of the evidence: the same numbers from another version are
        # another result, not this one again.
        if _evidence(existing) != _evidence(spec):
            raise Conflict(
                f"artifact {name!r} of {model}@{version} already has a different {spec.runtime!r} eval "
                f"(status {existing.status}); eval results are immutable",
                details={"artifact": name, "runtime": spec.runtime, "stored_status": existing.status},
            )
        return existing

    if release.status == "abandoned":
        release.check_open(model, f"evaluate {name!r}")
    artifact_id = session.scalars(_artifact_query(release.id, name).with_only_columns(Artifact.id)).first()
    if artifact_id is None:
        raise artifact_not_found(model, version, name)
    existing = _find_eval(session, artifact_id, spec.runtime)
    if existing is not None:
        return same(existing), False
    row = EvalResult(
        artifact_id=artifact_id,
        runtime=spec.runtime,
        runtime_version=spec.runtime_version,
        status=spec.status,
        metrics=spec.metrics,
        gates=spec.gates,
        reason=spec.reason,
    )
    row, created = insert_once(session, row, lambda: _find_eval(session, artifact_id, spec.runtime))
    return (row, True) if created else (same(row), False)
