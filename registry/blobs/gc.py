"""Garbage collection of blobs that no artifact references, safe while publishes run.

A blob is collected when nothing references it (no artifact file, no attestation: the domains that
hold blobs answer through `registry.blobs.references`) and it was last uploaded before a grace period
(`uploaded_at < now - grace`). Each blob goes in its own transaction:

1. `DELETE FROM blobs WHERE sha256 = :x AND uploaded_at < :cutoff AND NOT EXISTS (reference)`,
   which takes the row's lock (PostgreSQL) or the database's write lock (SQLite);
2. the bytes are deleted from the store while that lock is held;
3. commit.

Why this is safe against a concurrent publish or upload:
- A publish that already inserted its artifact_files row holds a key-share lock on the blob row
  (the foreign key check); the DELETE waits for it, and once the publish commits the foreign key
  makes the DELETE fail (PostgreSQL) or NOT EXISTS sees the reference (SQLite, whose writers are
  serialised). The bytes are never touched: they are deleted only after the row was.
- A publish that checks the blob while the DELETE is pending waits at its own insert (foreign key
  lock, or SQLite's write lock) and then fails its foreign key: it answers BLOB_MISSING and the
  client uploads again; no artifact ever references a collected blob.
- An upload first bumps `uploaded_at` on the row (`blobs.service.touch_blob`) before writing any
  bytes: either that commits first and the DELETE's condition no longer holds, or it waits for
  the collection to commit, finds no row, and stores the bytes afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, select, true
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kiln.registry.blobs.models import Blob
from kiln.registry.blobs.references import BlobReferences
from kiln.registry.db import utcnow
from kiln.storage.store import BlobStore


@dataclass(frozen=True)
class CollectableBlob:
    sha256: str
    size: int
    uploaded_at: datetime


@dataclass
class GcReport:
    """What one collection deleted (or, dry run, would delete) and what it spared."""

    dry_run: bool
    grace_hours: float
    cutoff: datetime
    deleted: list[CollectableBlob] = field(default_factory=list)
    spared_recent: int = 0  # unreferenced, but uploaded within the grace period
    spared_raced: int = 0  # referenced or re-uploaded while this collection ran

    @property
    def deleted_bytes(self) -> int:
        return sum(b.size for b in self.deleted)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "grace_hours": self.grace_hours,
            "cutoff": self.cutoff.isoformat(),
            "deleted": [
                {"sha256": b.sha256, "size": b.size, "uploaded_at": b.uploaded_at.isoformat()} for b in self.deleted
            ],
            "deleted_count": len(self.deleted),
            "deleted_bytes": self.deleted_bytes,
            "spared_recent": self.spared_recent,
            "spared_raced": self.spared_raced,
        }


def _unreferenced(references: Sequence[BlobReferences]) -> ColumnElement[bool]:
    """No domain holds the blob (artifact files, attestations: signatures and provenance)."""
    return and_(true(), *(~r.holds(Blob.sha256) for r in references))


def collectable_blobs(
    session: Session, references: Sequence[BlobReferences], cutoff: datetime
) -> tuple[list[CollectableBlob], int]:
    """Unreferenced blobs uploaded before `cutoff` (oldest first), and how many unreferenced ones are newer."""
    rows = session.execute(
        select(Blob.sha256, Blob.size, Blob.uploaded_at)
        .where(_unreferenced(references))
        .order_by(Blob.uploaded_at, Blob.sha256)
    ).all()
    old = [CollectableBlob(sha, size, at) for sha, size, at in rows if at < cutoff]
    return old, len(rows) - len(old)


def collect_blob(
    session: Session, store: BlobStore, references: Sequence[BlobReferences], sha256: str, cutoff: datetime
) -> bool:
    """Delete one blob, row and bytes (and what goes with it: the model-car layers made of it), if it is
    still unreferenced and was uploaded before `cutoff`.

    One transaction: the row is deleted (and locked) first, the bytes next, then it commits. False
    when the blob was referenced or re-uploaded meanwhile; nothing is changed then. A store error
    rolls the row back and propagates (the bytes may or may not be gone; the row says "stored", and
    an upload repairs it: `stored_blob` checks the bytes).
    """
    statement = (
        delete(Blob)
        .where(Blob.sha256 == sha256, Blob.uploaded_at < cutoff, _unreferenced(references))
        .execution_options(synchronize_session=False)
    )
    # What goes with the blob (model-car layers) goes first, rolled back with the rest if it stays:
    # deleting the blob's row takes the layers' link rows with it.
    try:
        for held in references:
            held.drop_with(session, sha256)
        result = session.execute(statement)
    except IntegrityError:  # a publish committed a reference while we waited for its lock
        session.rollback()
        return False
    assert isinstance(result, CursorResult)
    if result.rowcount != 1:
        session.rollback()
        return False
    try:
        store.delete(sha256)
    except BaseException:
        session.rollback()
        raise
    session.commit()
    return True


def collect_garbage(
    session_factory: Callable[[], Session],
    store: BlobStore,
    references: Sequence[BlobReferences],
    grace: timedelta,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
) -> GcReport:
    """Collect every blob none of `references` holds that was uploaded more than `grace` ago; `dry_run`
    only lists them."""
    cutoff = (now or utcnow()) - grace
    report = GcReport(dry_run=dry_run, grace_hours=grace.total_seconds() / 3600, cutoff=cutoff)
    with session_factory() as session:
        candidates, report.spared_recent = collectable_blobs(session, references, cutoff)
        session.commit()  # end the read: each deletion below re-checks in a transaction of its own
        if dry_run:
            report.deleted = candidates
            return report
        for blob in candidates:
            if collect_blob(session, store, references, blob.sha256, cutoff):
                report.deleted.append(blob)
            else:
                report.spared_raced += 1
    return report
