"""ORM row for a hardware catalog entry added or overridden through the API."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from kiln.registry.db import Base, utcnow


class HardwareEntry(Base):
    """One SKU as an admin gave it: a whole `core.hardware.HardwareProfile`, over the built-in entry of its name."""

    __tablename__ = "hardware_entries"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(32), unique=True)
    profile: Mapped[dict[str, Any]]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(128))
