"""Which artifacts must be signed, and which are: the checks sealing and promotion make.

Apart from the attestation service so that the release and channel services can ask it without
importing the services it builds on. A model must have signed artifacts once any key has been trusted
for it (revoking its only key does not turn the requirement off); an artifact is signed when it has a
signature verified with a key trusted for the model and not revoked.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.registry.attestations.models import Attestation, TrustedKey


def keys_for(session: Session, model: str, *, include_revoked: bool = False) -> list[TrustedKey]:
    """The keys trusted for `model` (by pattern), oldest first."""
    query = select(TrustedKey).order_by(TrustedKey.id)
    if not include_revoked:
        query = query.where(TrustedKey.revoked_at.is_(None))
    return [k for k in session.scalars(query) if fnmatch.fnmatchcase(model, k.model_pattern)]


def unsigned_artifacts(
    session: Session, model: str, artifacts: Iterable[tuple[int, str]], *, required: bool = False
) -> list[str]:
    """Names of `artifacts` ((id, name) pairs) of `model` without a signature verified by an active key
    trusted for it; empty when no key was ever trusted for the model (signing is not required of it)
    unless `required` (a channel that serves only signed artifacts: then every one is unsigned)."""
    keys = keys_for(session, model, include_revoked=True)
    if not keys:
        return sorted(name for _, name in artifacts) if required else []
    active = {k.key_id for k in keys if k.revoked_at is None}
    by_id = dict(artifacts)
    signed = set(
        session.scalars(
            select(Attestation.artifact_id).where(
                Attestation.artifact_id.in_(by_id), Attestation.kind == "signature", Attestation.signer.in_(active)
            )
        )
    )
    return sorted(name for artifact_id, name in by_id.items() if artifact_id not in signed)
