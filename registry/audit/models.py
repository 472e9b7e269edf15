"""ORM row for an audit event."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import String, Text
from sqlalchemy.orm import Mapped, mapped_column

from kiln.registry.db import Base, utcnow


class AuditEvent(Base):
    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    # The model name, not a foreign key: the record outlives what it describes.
    model: Mapped[str | None] = mapped_column(String(64), index=True)
    target: Mapped[str] = mapped_column(String(255))
    details: Mapped[dict[str, Any]]
    reason: Mapped[str | None] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(default=utcnow)
