"""Who may do what, and what was done, as the registry answers it and the client reads it back: API tokens,
trusted publisher keys, the attestations signed with them, and the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from kiln.core.rows import FromRow, StoredJSON

AttestationKind = Literal["signature", "provenance"]


class TokenOut(FromRow):
    id: int
    name: str
    prefix: str
    scopes: list[str]
    models: list[str]
    created_by: str
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="the secret; shown once, store it now")


class TrustedKeyOut(FromRow):
    key_id: str = Field(description="sha256 of the public key's DER")
    model_pattern: str
    public_key_pem: str
    created_by: str
    created_at: datetime
    revoked_at: datetime | None


class AttestationOut(FromRow):
    kind: AttestationKind
    media_type: str
    sha256: str
    size: int
    signer: str = Field(description="id of the trusted key it verified with")
    created_at: datetime
    url: str = Field(description="where to download it")


class AuditEventOut(FromRow):
    id: int
    actor: str
    action: str = Field(examples=["channel.promote", "channel.promote.forced"])
    model: str | None
    target: str = Field(examples=["tiny-llama/prod"])
    details: StoredJSON = Field(description="what changed, as {before, after, ...}")
    reason: str | None
    at: datetime
