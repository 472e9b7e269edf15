"""API shapes for attestations and trusted publisher keys."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from registry.api.params import SHA256_PATTERN
from registry.attestations.models import Attestation, TrustedKey

AttestationKind = Literal["signature", "provenance"]


class AttestationCreate(BaseModel):
    """An uploaded blob to attach to an artifact as its signature or provenance."""

    model_config = ConfigDict(extra="forbid")

    kind: AttestationKind
    media_type: Literal["application/vnd.dev.sigstore.bundle.v0.3+json"] = Field(
        default="application/vnd.dev.sigstore.bundle.v0.3+json",
        description="a Sigstore bundle (DSSE envelope over an in-toto statement)",
    )
    sha256: str = Field(pattern=SHA256_PATTERN, description="the blob, uploaded first with PUT /v1/blobs/{sha256}")
    size: int = Field(strict=True, ge=1, le=16 * 1024**2)


class AttestationOut(BaseModel):
    kind: AttestationKind
    media_type: str
    sha256: str
    size: int
    signer: str = Field(description="id of the trusted key it verified with")
    created_at: datetime
    url: str = Field(description="where to download it")

    @classmethod
    def from_row(cls, row: Attestation, url: str) -> AttestationOut:
        return cls(
            kind=row.kind,  # type: ignore[arg-type]
            media_type=row.media_type,
            sha256=row.sha256,
            size=row.size,
            signer=row.signer,
            created_at=row.created_at,
            url=url,
        )


class TrustedKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_pattern: str = Field(
        pattern=r"^[a-z0-9*?\[\]][a-z0-9._*?\[\]!-]{0,63}$",
        description="model names it signs for (fnmatch), e.g. llama-*",
    )
    public_key_pem: str = Field(max_length=4096, description="PEM public key, EC P-256, P-384 or P-521")


class TrustedKeyOut(BaseModel):
    key_id: str = Field(description="sha256 of the public key's DER")
    model_pattern: str
    public_key_pem: str
    created_by: str
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def from_row(cls, row: TrustedKey) -> TrustedKeyOut:
        return cls(
            key_id=row.key_id,
            model_pattern=row.model_pattern,
            public_key_pem=row.public_key_pem,
            created_by=row.created_by,
            created_at=row.created_at,
            revoked_at=row.revoked_at,
        )


class KeyRevoke(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=1000)
