"""ORM row for a stored blob."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, String
from sqlalchemy.orm import Mapped, mapped_column

from registry.db import Base, utcnow


class Blob(Base):
    """A blob whose bytes the store holds and verified; written only after the store accepted it."""

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The latest upload of these bytes (or confirmation that they are already stored): garbage
    # collection spares an unreferenced blob for a grace period after it, so the publish it was
    # uploaded for can still reference it.
    uploaded_at: Mapped[datetime] = mapped_column(default=utcnow)
