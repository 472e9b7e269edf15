"""API shapes for audit events."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from kiln.core.rows import FromRow
from kiln.registry.api.rows import StoredJSON


class AuditEventOut(FromRow):
    id: int
    actor: str
    action: str = Field(examples=["channel.promote", "channel.promote.forced"])
    model: str | None
    target: str = Field(examples=["tiny-llama/prod"])
    details: StoredJSON = Field(description="what changed, as {before, after, ...}")
    reason: str | None
    at: datetime
