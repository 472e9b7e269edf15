"""What a release holds, addressed by model and version: its artifacts, their files and evals, their
attestations, and the blobs all of those hold.

The release decides (it exists, it is open to changes, it is served) and locks; the artifact and
attestation services below record and read what it holds. Releases call down into them, never the
reverse.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.core.errors import NotFound
from kiln.core.manifest import ArtifactManifest
from kiln.registry.artifacts import service as artifacts
from kiln.registry.artifacts.schemas import EvalCreate
from kiln.registry.artifacts.service import Artifact, ArtifactFile, EvalResult
from kiln.registry.attestations import service as attestations
from kiln.registry.attestations.schemas import AttestationCreate
from kiln.registry.attestations.service import Attestation
from kiln.registry.auth.principal import Principal
from kiln.registry.blobs.service import uploaded_by
from kiln.registry.paging import Page
from kiln.registry.releases.models import Release
from kiln.registry.releases.service import (
    get_release,
    lock_release,
    release_id_of,
    releases_with_models,
    served_release_ids,
)
from kiln.storage.store import BlobNotFound, BlobStore


def get_artifact(session: Session, model: str, version: str, name: str) -> Artifact:
    """The artifact with its files and evals loaded; NotFound names what is missing (the release, or its artifact)."""
    artifact = artifacts.find_artifact(session, release_id_of(model, version), name)
    if artifact is None:
        get_release(session, model, version)
        raise artifacts.artifact_not_found(model, version, name)
    return artifact


def list_artifacts(session: Session, model: str, version: str) -> list[Artifact]:
    """The release's artifacts, by name, evals loaded."""
    release = get_release(session, model, version)
    return artifacts.release_artifacts(session, release.id, *artifacts.WITH_EVALS)


def artifacts_page(session: Session, model: str, version: str, after: str | None, limit: int) -> Page[Artifact, str]:
    """Up to `limit` of the release's artifacts, by name past `after`, each with its evals."""
    return artifacts.artifacts_page(session, get_release(session, model, version).id, after, limit)


def publish_artifact(session: Session, model: str, version: str, manifest: ArtifactManifest) -> tuple[Artifact, bool]:
    """Record an artifact of the open release (`registry.artifacts.service.publish_artifact`)."""
    # Shared: publishers add artifacts side by side; sealing waits for them, and they for it.
    release = lock_release(session, model, version, shared=True)
    return artifacts.publish_artifact(session, release, model, manifest)


def post_eval(session: Session, model: str, version: str, name: str, spec: EvalCreate) -> tuple[EvalResult, bool]:
    """Record one runtime's eval of an artifact of the release (`registry.artifacts.service.post_eval`)."""
    # Shared with other publishers; a promotion (exclusive) reads the newest eval id only after
    # every eval insert that started before it has committed.
    release = lock_release(session, model, version, shared=True)
    return artifacts.post_eval(session, release, model, name, spec)


def served_artifacts(
    session: Session,
    model_id: int,
    *options: Any,
    artifact_id: int | None = None,
    digest_prefix: str | None = None,
) -> list[tuple[str, Artifact]]:
    """The artifacts of the model's served (sealed, not yanked) releases, by id, each with its release's
    version (`registry.artifacts.service.served_artifacts`: loader `options`, one `artifact_id`, a
    `digest_prefix`)."""
    rows = artifacts.served_artifacts(
        session, served_release_ids(model_id), *options, artifact_id=artifact_id, digest_prefix=digest_prefix
    )
    ids = {a.release_id for a in rows}
    versions: dict[int, str] = {
        release_id: version
        for release_id, version in session.execute(select(Release.id, Release.version).where(Release.id.in_(ids)))
    }
    return [(versions[a.release_id], a) for a in rows]


def get_artifact_file(session: Session, model: str, version: str, name: str, path: str) -> ArtifactFile:
    """The file `path` of an artifact of a served (sealed, not yanked) release.

    A path that could escape the artifact is InvalidInput; an open, abandoned or yanked release
    serves no file (RELEASE_NOT_SEALED, RELEASE_NOT_SERVED).
    """
    artifacts.check_file_path(path)
    row = artifacts.find_artifact_file(session, release_id_of(model, version), name, path)
    get_release(session, model, version).check_served(model)
    if row is None:
        get_artifact(session, model, version, name)
        raise NotFound(
            f"artifact {model}@{version}/{name} has no file {path!r}",
            details={"model": model, "version": version, "artifact": name, "path": path},
        )
    return row


def attach_attestation(
    session: Session, store: BlobStore, model: str, version: str, name: str, spec: AttestationCreate
) -> tuple[Attestation, bool]:
    """Verify an uploaded attestation and attach it to the artifact (`registry.attestations.service.attach`)."""
    release = lock_release(session, model, version, shared=True)
    artifact = get_artifact(session, model, version, name)
    return attestations.attach(session, store, release, model, artifact, spec)


def list_attestations(session: Session, model: str, version: str, name: str) -> list[Attestation]:
    """The artifact's attestations, by kind."""
    return attestations.list_attestations(session, get_artifact(session, model, version, name).id)


def get_attestation(session: Session, model: str, version: str, name: str, kind: str) -> Attestation:
    """One attestation of an artifact of a served (sealed, not yanked) release."""
    get_release(session, model, version).check_served(model)
    return attestations.get_attestation(session, model, version, get_artifact(session, model, version, name), kind)


def check_blob_readable(session: Session, principal: Principal, sha256: str) -> None:
    """BlobNotFound unless `principal` may read the blob by its digest.

    A blob is read through what holds it: a file or an attestation (signature, provenance) of an
    artifact of a served (sealed, not yanked) release of a model the caller may read, or, for
    publishers of the model, of its open release; or the caller's own upload (a token that uploaded the
    bytes reads them back, attached or not). An unlimited admin reads any. Anonymous callers (where
    anonymous read is on) read only what served releases hold. The answer for a blob the caller may
    not read is the same 404 as for one that does not exist, so a digest tells nothing about others.
    """
    if principal.unlimited_admin:
        return
    if principal.token_id is not None and uploaded_by(session, sha256, principal.token_id):
        return
    holders = releases_with_models(
        session,
        artifacts.release_ids_of(artifacts.artifact_ids_with_blob(sha256)),
        artifacts.release_ids_of(attestations.artifact_ids_attested_by(sha256)),
    )
    for release in holders:
        if not principal.allows_model(release.model.name):
            continue
        if release.status == "sealed" and release.yanked_at is None and principal.has("read"):
            return
        if release.status == "open" and principal.has("publish"):
            return
    raise BlobNotFound(f"blob {sha256} not found", details={"sha256": sha256})
