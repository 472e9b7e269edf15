"""Blob bookkeeping: bytes go to the BlobStore, a Blob row records them once they are verified.

Every upload first marks the blob's row (if there is one) as uploaded now, and only then writes
bytes. Garbage collection (`registry.blobs.gc`) deletes a row and its bytes in one transaction
that re-checks "unreferenced and not uploaded within the grace period" under the row's lock, so
an upload either lands before that check (and the blob is spared) or waits for the collection to
finish and then stores its bytes afresh.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from kiln.registry.auth.principal import Principal
from kiln.registry.blobs.models import Blob, BlobUpload
from kiln.registry.db import insert_once, utcnow
from kiln.storage.store import BlobNotFound, BlobStore


def stored_blob(session: Session, store: BlobStore, sha256: str) -> Blob | None:
    """The blob's row when the database records it and the store still holds its bytes."""
    row = session.get(Blob, sha256)
    if row is None or not store.exists(sha256):
        return None
    return row


def stored_sizes(session: Session, digests: Iterable[str]) -> dict[str, int]:
    """The size of each blob of `digests` the database records (its bytes are not checked)."""
    query = select(Blob.sha256, Blob.size).where(Blob.sha256.in_(set(digests)))
    return {digest: size for digest, size in session.execute(query)}


def get_blob(session: Session, store: BlobStore, sha256: str) -> Blob:
    """The stored blob's row; BlobNotFound when the row or the bytes are missing."""
    row = stored_blob(session, store, sha256)
    if row is None:
        raise BlobNotFound(f"blob {sha256} not found", details={"sha256": sha256})
    return row


def uploaded_by(session: Session, sha256: str, token_id: int) -> bool:
    """True when the token uploaded the blob (whether or not anything holds it yet)."""
    return session.get(BlobUpload, (sha256, token_id)) is not None


def record_upload(session: Session, principal: Principal, sha256: str) -> None:
    """Record that `principal`'s token uploaded the stored blob `sha256` (it may read it back from now on)."""
    if principal.token_id is None or session.get(BlobUpload, (sha256, principal.token_id)) is not None:
        return
    insert_once(
        session,
        BlobUpload(sha256=sha256, token_id=principal.token_id),
        lambda: session.get(BlobUpload, (sha256, principal.token_id)),
    )


def touch_blob(session: Session, sha256: str) -> bool:
    """Record that `sha256` is being uploaded now; False when there is no row to touch.

    On PostgreSQL this waits for a garbage collection holding the row; on SQLite for the write
    lock. Either way it returns after that collection committed, and then finds no row.
    """
    result = session.execute(update(Blob).where(Blob.sha256 == sha256).values(uploaded_at=utcnow()))
    assert isinstance(result, CursorResult)
    return result.rowcount == 1


def confirm_stored(session: Session, store: BlobStore, sha256: str) -> Blob | None:
    """For an upload of a blob that may already be stored: its row, kept from collection for the grace
    period once the caller commits, or None when it must be uploaded (never stored, bytes gone, or just
    collected)."""
    row = stored_blob(session, store, sha256)
    if row is None or not touch_blob(session, sha256):
        return None
    return row


def put_blob(session: Session, store: BlobStore, sha256: str, chunks: Iterable[bytes]) -> tuple[Blob, bool]:
    """Stream `chunks` into the store (verified against `sha256`), then record it (the caller commits the
    record). True if it was new.

    The one service that commits: the touch must be visible to garbage collection before any byte is
    written (see the module docstring), so it is committed here, in a transaction of its own.
    """
    # Before any byte is written: a row already there is now safe from collection (or was collected).
    touch_blob(session, sha256)
    session.commit()
    size = store.put_stream(sha256, chunks)
    existing = session.get(Blob, sha256)
    if existing is not None:  # the row survived but the bytes had gone: they are back now
        return existing, True
    row, created = insert_once(session, Blob(sha256=sha256, size=size), lambda: session.get(Blob, sha256))
    return row, created
