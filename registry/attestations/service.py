"""Attestations (signatures, provenance) of artifacts, verified on upload; the publisher keys trusted for them.

An attestation is a Sigstore bundle uploaded as a blob, then attached to an artifact. It is stored only
if it verifies with a key trusted for the model (`TrustedKey.model_pattern`, not revoked), names
exactly the artifact's files with their digests, and claims exactly the artifact it is attached to
(model, version, name, target, format, quant, hardware, runtime: `core.signing.ArtifactClaims`, inside
the signed payload); otherwise SIGNATURE_INVALID / NO_TRUSTED_KEY / KEY_REVOKED /
ATTESTATION_CLAIMS_MISSING / ATTESTATION_CLAIM_MISMATCH / ATTESTATION_SUBJECT_MISMATCH say why. Keys
are added and revoked by admins, audited. Services flush; the request commits.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import ColumnElement, Select, exists, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from kiln.core.error_codes import Codes
from kiln.core.errors import Conflict, InvalidInput, NotFound
from kiln.core.manifest import ArtifactIdentity
from kiln.core.signing import (
    AttestationKind,
    SignatureInvalid,
    check_attested,
    key_id,
    load_public_key,
    names_key,
    read_bundle,
    verify_envelope,
)
from kiln.registry.artifacts.service import Artifact, ReleaseRef
from kiln.registry.attestations.models import Attestation, TrustedKey
from kiln.registry.attestations.policy import keys_for
from kiln.registry.attestations.schemas import AttestationCreate, TrustedKeyCreate
from kiln.registry.audit import service as audit
from kiln.registry.auth.principal import Principal
from kiln.registry.blobs.service import get_blob
from kiln.registry.db import insert_once, utcnow
from kiln.registry.paging import Page, keyset_page
from kiln.storage.store import BlobNotFound, BlobStore

# -- trusted keys -------------------------------------------------------------------------------


def find_key(session: Session, kid: str) -> TrustedKey | None:
    return session.scalars(select(TrustedKey).where(TrustedKey.key_id == kid)).one_or_none()


def add_key(session: Session, spec: TrustedKeyCreate, actor: str) -> tuple[TrustedKey, bool]:
    """Trust a public key for the models matching a pattern (audited `key.add`). The same key and
    pattern again is a no-op; the key under another pattern, or a revoked key, is a Conflict."""
    public = load_public_key(spec.public_key_pem)
    kid = key_id(public)

    def same(existing: TrustedKey) -> TrustedKey:
        if existing.revoked_at is not None:
            raise Conflict(
                f"key {kid} was revoked at {existing.revoked_at}; a revoked key is never trusted again",
                code=Codes.KEY_REVOKED,
                details={"key_id": kid},
            )
        if existing.model_pattern != spec.model_pattern:
            raise Conflict(
                f"key {kid} is already trusted for {existing.model_pattern!r}; revoke it or use another key",
                details={"key_id": kid, "model_pattern": existing.model_pattern},
            )
        return existing

    existing = find_key(session, kid)
    if existing is not None:
        return same(existing), False
    row = TrustedKey(
        key_id=kid, model_pattern=spec.model_pattern, public_key_pem=public_key_pem_text(spec), created_by=actor
    )
    row, created = insert_once(session, row, lambda: find_key(session, kid))
    if not created:
        return same(row), False
    audit.record(
        session,
        action="key.add",
        target=kid,
        actor=actor,
        details={"before": None, "after": {"key_id": kid, "model_pattern": spec.model_pattern}},
    )
    session.flush()
    return row, True


def public_key_pem_text(spec: TrustedKeyCreate) -> str:
    return spec.public_key_pem.strip() + "\n"


def keys_page(session: Session, reader: Principal, after: str | None, limit: int) -> Page[TrustedKey, TrustedKey]:
    """Up to `limit` of the trusted keys for models `reader` may read, revoked ones included, oldest first, past
    the key `after` (a key_id; PAGE_CURSOR_UNKNOWN when there is no such key). Patterns are applied here, a
    chunk at a time."""
    mark = None
    if after is not None:
        mark = find_key(session, after)
        if mark is None or not reader.sees_pattern(mark.model_pattern):  # one it may not see is unknown to it
            raise InvalidInput(
                f"no trusted key {after} to list keys after", code=Codes.PAGE_CURSOR_UNKNOWN, details={"after": after}
            )

    def fetch(past: TrustedKey | None, n: int) -> list[TrustedKey]:
        query = select(TrustedKey).order_by(TrustedKey.id).limit(n)
        return list(session.scalars(query if past is None else query.where(TrustedKey.id > past.id)))

    visible = (lambda k: reader.sees_pattern(k.model_pattern)) if reader.models else None
    return keyset_page(fetch, lambda k: k, mark, limit, keep=visible)


def revoke_key(session: Session, kid: str, actor: str, reason: str | None) -> TrustedKey:
    """Revoke a trusted key (idempotent, audited `key.revoke`): from now on nothing it signed counts as
    signed, for new uploads, sealing and promotion alike."""
    row = find_key(session, kid)
    if row is None:
        raise NotFound(f"no trusted key {kid}", details={"key_id": kid})
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        audit.record(
            session,
            action="key.revoke",
            target=kid,
            actor=actor,
            reason=reason,
            details={"before": {"revoked": False}, "after": {"revoked": True}, "model_pattern": row.model_pattern},
        )
        session.flush()
    return row


# -- attestations -------------------------------------------------------------------------------


def _read_blob(session: Session, store: BlobStore, spec: AttestationCreate) -> bytes:
    try:
        row = get_blob(session, store, spec.sha256)
    except BlobNotFound:
        raise InvalidInput(
            f"upload the {spec.kind} blob {spec.sha256[:12]}… first",
            code=Codes.BLOB_MISSING,
            details={"sha256": spec.sha256},
        ) from None
    if row.size != spec.size:
        raise InvalidInput(f"blob {spec.sha256[:12]}… has {row.size} bytes, not {spec.size}", code=Codes.BLOB_MISSING)
    data = b"".join(store.open_range(spec.sha256))
    if hashlib.sha256(data).hexdigest() != spec.sha256:  # the store's bytes are what was uploaded
        raise SignatureInvalid(f"blob {spec.sha256[:12]}… in the store no longer matches its digest")
    return data


def claims_of(artifact: Artifact, model: str, version: str) -> dict[str, Any]:
    """The claims an attestation of `artifact` must make (`core.signing.ArtifactClaims.FIELDS`)."""
    return ArtifactIdentity.of(artifact).claims(model=model, version=version)


def verify_attestation(
    session: Session, model: str, version: str, artifact: Artifact, kind: AttestationKind, data: bytes
) -> str:
    """The id of the trusted key that signed `data`, once it is checked to attest exactly the artifact's
    files and claims; raises with the reason otherwise."""
    envelope = read_bundle(data)
    keys = keys_for(session, model, include_revoked=True)
    if not keys:
        raise SignatureInvalid(
            f"no publisher key is trusted for model {model!r}: an admin adds one (`kiln keys add`) before "
            "signed artifacts are accepted",
            code=Codes.NO_TRUSTED_KEY,
            details={"model": model},
        )
    signer = next((k for k in keys if names_key(envelope, load_public_key(k.public_key_pem))), None)
    if signer is None:
        trusted = [k.key_id for k in keys if k.revoked_at is None]
        raise SignatureInvalid(
            f"the {kind} of {artifact.name!r} is not signed by a key trusted for model {model!r}",
            details={"artifact": artifact.name, "kind": kind, "trusted_keys": trusted},
        )
    if signer.revoked_at is not None:
        raise SignatureInvalid(
            f"the {kind} of {artifact.name!r} is signed by key {signer.key_id}, revoked at {signer.revoked_at}",
            code=Codes.KEY_REVOKED,
            details={"artifact": artifact.name, "kind": kind, "key_id": signer.key_id},
        )
    attested = verify_envelope(envelope, load_public_key(signer.public_key_pem), kind)
    check_attested(
        attested,
        claims_of(artifact, model, version),
        {f.path: f.sha256 for f in artifact.files},
        f"{model}@{version}/{artifact.name}",
    )
    return signer.key_id


def _find(session: Session, artifact_id: int, kind: str) -> Attestation | None:
    query = select(Attestation).where(Attestation.artifact_id == artifact_id, Attestation.kind == kind)
    return session.scalars(query).one_or_none()


def attach(
    session: Session, store: BlobStore, release: ReleaseRef, model: str, artifact: Artifact, spec: AttestationCreate
) -> tuple[Attestation, bool]:
    """Verify an uploaded attestation and attach it to the artifact of `release` (locked, shared, by the
    caller) (True if stored now).

    While the release is open a new one replaces the artifact's previous one of that kind (a re-run
    of a publish signs again, and ECDSA signatures differ each time). Once sealed, an attestation by an active
    key never changes (one that verifies just as well is answered with the stored one); one the artifact
    lacks, or whose key was revoked since, may still be attached: it is verified like any other and
    changes no file (a release sealed before its model's key was trusted, or signed by a revoked key,
    can be signed and then promoted).
    """
    version, name = release.version, artifact.name
    signer = verify_attestation(session, model, version, artifact, spec.kind, _read_blob(session, store, spec))
    existing = _find(session, artifact.id, spec.kind)
    if existing is not None and existing.sha256 == spec.sha256:
        return existing, False
    if release.status == "sealed":
        if existing is not None and existing.signer in {k.key_id for k in keys_for(session, model)}:
            return existing, False
    else:
        release.check_open(model, f"attach a {spec.kind} to {name!r}")
    if existing is not None:
        existing.sha256, existing.size, existing.media_type, existing.signer = (
            spec.sha256,
            spec.size,
            spec.media_type,
            signer,
        )
        existing.created_at = utcnow()
        session.flush()
        return existing, True
    row = Attestation(
        artifact_id=artifact.id,
        kind=spec.kind,
        media_type=spec.media_type,
        sha256=spec.sha256,
        size=spec.size,
        signer=signer,
    )
    return insert_once(session, row, lambda: _find(session, artifact.id, spec.kind))


def list_attestations(session: Session, artifact_id: int) -> list[Attestation]:
    """The artifact's attestations, by kind."""
    return list(
        session.scalars(select(Attestation).where(Attestation.artifact_id == artifact_id).order_by(Attestation.kind))
    )


def get_attestation(session: Session, model: str, version: str, artifact: Artifact, kind: str) -> Attestation:
    """The artifact's attestation of `kind`; NotFound when it has none."""
    row = _find(session, artifact.id, kind)
    if row is None:
        raise NotFound(
            f"artifact {model}@{version}/{artifact.name} has no {kind}",
            details={"model": model, "version": version, "artifact": artifact.name, "kind": kind},
        )
    return row


def attestations_by_artifact(session: Session, artifact_ids: list[int]) -> dict[int, list[Attestation]]:
    """The attestations of each of the artifacts, by kind."""
    rows = session.scalars(
        select(Attestation).where(Attestation.artifact_id.in_(artifact_ids)).order_by(Attestation.kind)
    ).all()
    out: dict[int, list[Attestation]] = {}
    for row in rows:
        out.setdefault(row.artifact_id, []).append(row)
    return out


def artifact_ids_attested_by(sha256: str) -> Select[int]:
    """The ids of the artifacts with an attestation whose bytes are the blob, as a subquery."""
    return select(Attestation.artifact_id).where(Attestation.sha256 == sha256)


class AttestationBlobs:
    """Attestations (signatures, provenance) hold their blobs (`registry.blobs.references.BlobReferences`)."""

    def holds(self, sha256: InstrumentedAttribute[str]) -> ColumnElement[bool]:
        return exists().where(Attestation.sha256 == sha256)

    def drop_with(self, session: Session, sha256: str) -> None:
        """Nothing: a blob an attestation holds is never collected."""


def drop_attestations(session: Session, artifact_ids: Select[int]) -> None:
    """Delete the attestations of the artifacts in the `artifact_ids` subquery (an abandoned release's)."""
    session.query(Attestation).filter(Attestation.artifact_id.in_(artifact_ids)).delete(synchronize_session=False)
