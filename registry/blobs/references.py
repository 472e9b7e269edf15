"""Who holds a blob, and who may read it: each domain whose rows reference blobs answers for them here, so
that garbage collection (`registry.blobs.gc`) asks them without importing them; and the release, whose status
decides what is served, answers whether a caller may read a blob by its digest.

`registry.app` hands collection every domain's answer (`BLOB_REFERENCES`, on `app.state.blob_references`
and `Storage.blob_references` for `kiln gc`): artifact files and attestations hold their blobs; model-car
layers go with the blobs they are made of. It hands the blob routes the releases' readability check
(`registry.releases.contents.check_blob_readable`, on `app.state.blob_readable`).
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import ColumnElement
from sqlalchemy.orm import InstrumentedAttribute, Session

from kiln.registry.auth.principal import Principal


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


class BlobReadable(Protocol):
    """Whether a caller may read a blob by its digest."""

    def __call__(self, session: Session, principal: Principal, sha256: str) -> None:
        """BlobNotFound unless `principal` may read the blob `sha256`: the same 404 as for a blob that does
        not exist, so a digest tells nothing about others."""
        ...
