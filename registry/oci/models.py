"""ORM rows for a model car's file layers: tar streams derived from stored blobs, never stored themselves."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Integer, LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from kiln.registry.db import Base, utcnow


class TarLayer(Base):
    """A tar layer that puts artifact files at `models/<path>`: for each member, its header, the blob's
    bytes and zeros to a whole block; then the two end-of-archive blocks. Its digest needs one read of
    its files, so it is recorded once; the headers are kept as written, so the bytes served are always
    the ones hashed. Deleted when any of its blobs is collected (`registry.blobs.gc`)."""

    __tablename__ = "oci_tar_layers"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)  # the layer's digest (and diff id)
    members_key: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of its members, canonical JSON
    member_count: Mapped[int] = mapped_column(Integer)
    members: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # [{path, sha256, size, header}]: header's bytes
    size: Mapped[int] = mapped_column(BigInteger)  # the whole layer's
    headers: Mapped[bytes] = mapped_column(LargeBinary)  # each member's header, in order
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TarLayerBlob(Base):
    """A blob a tar layer holds: what garbage collection follows to delete the layer with the blob."""

    __tablename__ = "oci_tar_layer_blobs"

    layer_sha256: Mapped[str] = mapped_column(
        String(64), ForeignKey("oci_tar_layers.sha256", ondelete="CASCADE"), primary_key=True
    )
    blob_sha256: Mapped[str] = mapped_column(
        String(64), ForeignKey("blobs.sha256", ondelete="CASCADE"), primary_key=True, index=True
    )


class LayerHashing(Base):
    """A replica hashing a tar layer now: others wait for its record instead of reading the files again.
    A lease: renewed while the hashing goes on, taken over once it has expired (the replica died)."""

    __tablename__ = "oci_layer_hashing"

    members_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    expires_at: Mapped[datetime] = mapped_column()
