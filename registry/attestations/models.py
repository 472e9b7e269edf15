"""ORM rows for artifact attestations and the publisher keys trusted to sign them."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from kiln.registry.db import Base, utcnow


class Attestation(Base):
    """A signed statement about one artifact, stored as a content-addressed blob beside its files.

    kind: `signature` (a Sigstore bundle over the artifact's per-file digest manifest, the OpenSSF
    model signing format) or `provenance` (a signed in-toto statement with a SLSA provenance
    predicate). One of each per artifact."""

    __tablename__ = "attestations"
    __table_args__ = (UniqueConstraint("artifact_id", "kind"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    media_type: Mapped[str] = mapped_column(String(255))
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    signer: Mapped[str] = mapped_column(String(255))  # the trusted key's id (or a keyless identity) it verified with
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TrustedKey(Base):
    """A publisher public key trusted to sign the artifacts of models matching `model_pattern` (fnmatch)."""

    __tablename__ = "trusted_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    key_id: Mapped[str] = mapped_column(String(128), unique=True)  # sha256 of the public key's DER
    model_pattern: Mapped[str] = mapped_column(String(64))
    public_key_pem: Mapped[str] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
