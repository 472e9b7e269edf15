"""ORM row for a model car's file layer: a tar stream derived from a stored blob, never stored itself."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from registry.db import Base, utcnow


class TarLayer(Base):
    """The tar layer that puts one artifact file at `models/<path>`: `header`, then the blob's bytes, then
    zeros (padding to a 512-byte block and the two end-of-archive blocks). Its digest needs one read of the
    blob, so it is recorded once; the header is kept as written, so the bytes served are always the ones
    hashed. Deleted with its blob (garbage collection)."""

    __tablename__ = "oci_tar_layers"
    __table_args__ = (UniqueConstraint("blob_sha256", "path"),)

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)  # the layer's digest (and diff id)
    blob_sha256: Mapped[str] = mapped_column(String(64), ForeignKey("blobs.sha256", ondelete="CASCADE"), index=True)
    path: Mapped[str] = mapped_column(String(512))
    size: Mapped[int] = mapped_column(BigInteger)  # the whole layer's
    file_size: Mapped[int] = mapped_column(BigInteger)  # the blob's, inside it
    header: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
