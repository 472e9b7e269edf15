"""Who holds a blob: each domain whose rows reference blobs answers for them here, so that garbage
collection (`registry.blobs.gc`) asks them without importing them.

`registry.app` hands collection every domain's answer (`BLOB_REFERENCES`, on `app.state.blob_references`
and `Storage.blob_references` for `kiln gc`): artifact files and attestations hold their blobs; model-car
layers go with the blobs they are made of.
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import ColumnElement
from sqlalchemy.orm import InstrumentedAttribute, Session


class BlobReferences(Protocol):
    """What one domain knows of the blobs its rows reference."""

    def holds(self, sha256: InstrumentedAttribute[str]) -> ColumnElement[bool]:
        """A condition: some row of the domain holds the blob whose digest is `sha256` (a correlated
        column). A held blob is never collected."""
        ...

    def drop_with(self, session: Session, sha256: str) -> None:
        """Delete the domain's rows that go with the blob when it is collected, in the collection's
        transaction and before the blob's row (rolled back with it when the blob stays)."""
        ...
