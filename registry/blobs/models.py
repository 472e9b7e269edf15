"""ORM row for a stored blob."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from kiln.registry.db import Base, utcnow


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


class BlobUpload(Base):
    """Who uploaded a blob: a blob no artifact holds yet is readable by the tokens that uploaded it
    (each proved it has the bytes), besides unlimited admins. Deleted with the blob."""

    __tablename__ = "blob_uploads"

    sha256: Mapped[str] = mapped_column(String(64), ForeignKey("blobs.sha256", ondelete="CASCADE"), primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"), primary_key=True, index=True)
    uploaded_at: Mapped[datetime] = mapped_column(default=utcnow)
