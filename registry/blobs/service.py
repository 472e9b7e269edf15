"""Blob bookkeeping: bytes go to the BlobStore, a Blob row records them once they are verified."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.orm import Session

from registry.blobs.models import Blob
from registry.blobs.store import BlobNotFound, BlobStore
from registry.db import insert_once


def stored_blob(session: Session, store: BlobStore, sha256: str) -> Blob | None:
    """The blob's row when the database records it and the store still holds its bytes."""
    row = session.get(Blob, sha256)
    if row is None or not store.exists(sha256):
        return None
    return row


def get_blob(session: Session, store: BlobStore, sha256: str) -> Blob:
    row = stored_blob(session, store, sha256)
    if row is None:
        raise BlobNotFound(f"blob {sha256} not found", details={"sha256": sha256})
    return row


def put_blob(session: Session, store: BlobStore, sha256: str, chunks: Iterable[bytes]) -> tuple[Blob, bool]:
    """Stream `chunks` into the store (verified against `sha256`), then record it. True if it was new."""
    size = store.put_stream(sha256, chunks)
    existing = session.get(Blob, sha256)
    if existing is not None:  # the row survived but the bytes had gone: they are back now
        return existing, True
    row, created = insert_once(session, Blob(sha256=sha256, size=size), lambda: session.get(Blob, sha256))
    return row, created
