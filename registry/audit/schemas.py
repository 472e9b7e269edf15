"""API shapes for audit events."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from registry.api.rows import FromRow


class AuditEventOut(FromRow):
    id: int
    actor: str
    action: str = Field(examples=["channel.promote", "channel.promote.forced"])
    model: str | None
    target: str = Field(examples=["tiny-llama/prod"])
    details: dict[str, Any] = Field(description="what changed, as {before, after, ...}")
    reason: str | None
    at: datetime
