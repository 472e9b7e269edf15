"""Artifact and eval-result operations over a Session."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from core.errors import Conflict, InvalidInput, NotFound
from core.manifest import ArtifactManifest, FileEntry, check_relative_path
from registry.artifacts.models import Artifact, ArtifactFile, EvalResult
from registry.artifacts.schemas import EvalCreate
from registry.blobs.models import Blob
from registry.db import insert_once
from registry.models.models import Model
from registry.releases.models import Release
from registry.releases.service import check_open, check_served, get_release, lock_release

WITH_FILES_AND_EVALS = (selectinload(Artifact.files), selectinload(Artifact.evals))


def manifest_of(artifact: Artifact) -> ArtifactManifest:
    """The manifest as published (needs `files` loaded)."""
    return ArtifactManifest(
        name=artifact.name,
        target=artifact.target,
        format=artifact.format,
        quant=artifact.quant,
        hardware=artifact.hardware,
        unsupported=artifact.unsupported,
        runtime=artifact.runtime,
        files=[FileEntry(path=f.path, sha256=f.sha256, size=f.size) for f in artifact.files],
        provenance=artifact.provenance,
    )


def _artifact_query(model: str, version: str, name: str) -> Any:
    return (
        select(Artifact)
        .join(Artifact.release)
        .join(Release.model)
        .where(Model.name == model, Release.version == version, Artifact.name == name)
    )


def find_artifact(session: Session, model: str, version: str, name: str) -> Artifact | None:
    query = _artifact_query(model, version, name).options(*WITH_FILES_AND_EVALS)
    return session.scalars(query).one_or_none()


def get_artifact(session: Session, model: str, version: str, name: str) -> Artifact:
    """The artifact with its files and evals loaded; NotFound names what is missing."""
    artifact = find_artifact(session, model, version, name)
    if artifact is None:
        get_release(session, model, version)
        raise NotFound(
            f"artifact {name!r} not found in release {model}@{version}",
            details={"model": model, "version": version, "artifact": name},
        )
    return artifact


def list_artifacts(session: Session, model: str, version: str) -> list[Artifact]:
    release = get_release(session, model, version)
    query = (
        select(Artifact)
        .where(Artifact.release_id == release.id)
        .order_by(Artifact.name)
        .options(selectinload(Artifact.evals))
    )
    return list(session.scalars(query))


def _check_blobs(session: Session, manifest: ArtifactManifest) -> None:
    wanted = {f.sha256 for f in manifest.files}
    query = select(Blob.sha256, Blob.size).where(Blob.sha256.in_(wanted))
    stored = {digest: size for digest, size in session.execute(query)}
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
            code="BLOB_MISSING",
            details={"missing": problems},
        )


def publish_artifact(session: Session, model: str, version: str, manifest: ArtifactManifest) -> tuple[Artifact, bool]:
    """Record an artifact of an open release whose blobs are all stored.

    Same content again: no-op (also once sealed, so a re-run of a publish is harmless); different
    content: Conflict; a new artifact for a sealed, abandoned or yanked release, or one the release
    did not plan: Conflict.
    """
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

    # Shared: publishers add artifacts side by side; sealing waits for them, and they for it.
    release = lock_release(session, model, version, shared=True)
    existing = find_artifact(session, model, version, manifest.name)
    if existing is not None:
        return same(existing), False
    check_open(release, model, f"publish artifact {manifest.name!r}")
    if manifest.name not in release.planned_artifacts:
        raise Conflict(
            f"release {model}@{version} did not plan an artifact {manifest.name!r}; "
            f"planned: {', '.join(release.planned_artifacts)}",
            code="ARTIFACT_NOT_PLANNED",
            details={"artifact": manifest.name, "planned": release.planned_artifacts},
        )
    _check_blobs(session, manifest)
    artifact = Artifact(
        release_id=release.id,
        name=manifest.name,
        target=manifest.target,
        format=manifest.format,
        quant=manifest.quant,
        hardware=list(manifest.hardware),
        unsupported=dict(manifest.unsupported),
        runtime=manifest.runtime,
        provenance=manifest.provenance,
        manifest_digest=digest,
        total_size=manifest.total_size,
        files=[ArtifactFile(path=f.path, sha256=f.sha256, size=f.size) for f in manifest.files],
        evals=[],
    )
    try:
        row, created = insert_once(session, artifact, lambda: find_artifact(session, model, version, manifest.name))
    except IntegrityError:
        # A blob checked above was garbage-collected before our insert (its foreign key failed):
        # the same BLOB_MISSING as if the check had seen it, so the client uploads it again.
        _check_blobs(session, manifest)
        raise
    return (row, True) if created else (same(row), False)


def get_artifact_file(session: Session, model: str, version: str, name: str, path: str) -> ArtifactFile:
    """The file `path` of an artifact of a served (sealed, not yanked) release.

    A path that could escape the artifact is InvalidInput; an open, abandoned or yanked release
    serves no file (RELEASE_NOT_SEALED, RELEASE_NOT_SERVED).
    """
    try:
        check_relative_path(path)
    except ValueError as exc:
        raise InvalidInput(str(exc), details={"path": path}) from None
    query = (
        select(ArtifactFile)
        .join(ArtifactFile.artifact)
        .join(Artifact.release)
        .join(Release.model)
        .where(Model.name == model, Release.version == version, Artifact.name == name, ArtifactFile.path == path)
    )
    row = session.scalars(query).one_or_none()
    check_served(get_release(session, model, version), model)
    if row is None:
        get_artifact(session, model, version, name)
        raise NotFound(
            f"artifact {model}@{version}/{name} has no file {path!r}",
            details={"model": model, "version": version, "artifact": name, "path": path},
        )
    return row


def _find_eval(session: Session, artifact_id: int, runtime: str) -> EvalResult | None:
    query = select(EvalResult).where(EvalResult.artifact_id == artifact_id, EvalResult.runtime == runtime)
    return session.scalars(query).one_or_none()


def _evidence(result: EvalResult | EvalCreate) -> tuple[object, ...]:
    """What makes two results of one runtime the same: compared as JSON, where a NaN equals a NaN."""

    def dumped(record: BaseModel | None) -> str | None:
        return None if record is None else record.model_dump_json()

    return (result.status, result.runtime_version, dumped(result.metrics), dumped(result.gates), result.reason)


def post_eval(session: Session, model: str, version: str, name: str, spec: EvalCreate) -> tuple[EvalResult, bool]:
    """Record one runtime's eval of an artifact. Same result again: no-op; a different one: Conflict.

    Evals may arrive after sealing (a GPU runner's, later); a channel serving the release judges
    it by the evals it was promoted with until it is promoted again.
    """

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

    # Shared with other publishers; a promotion (exclusive) reads the newest eval id only after
    # every eval insert that started before it has committed.
    release = lock_release(session, model, version, shared=True)
    if release.status == "abandoned":
        check_open(release, model, f"evaluate {name!r}")
    artifact_id = session.scalars(_artifact_query(model, version, name).with_only_columns(Artifact.id)).first()
    if artifact_id is None:
        get_artifact(session, model, version, name)  # raises the precise NotFound
        raise AssertionError("unreachable")
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
