"""API shapes for attestations and trusted publisher keys."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.access import AttestationKind
from kiln.registry.api.params import SHA256_PATTERN


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


class TrustedKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_pattern: str = Field(
        pattern=r"^[a-z0-9*?\[\]][a-z0-9._*?\[\]!-]{0,63}$",
        description="model names it signs for (fnmatch), e.g. llama-*",
    )
    public_key_pem: str = Field(max_length=4096, description="PEM public key, EC P-256, P-384 or P-521")


class KeyRevoke(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=1000)
