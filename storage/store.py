"""Where blob bytes live: the small `BlobStore` Protocol every backend implements.

Every backend streams (nothing is read whole into memory), verifies content against its sha256
before it becomes visible, and reports a missing blob as `BlobNotFound`, whatever its own error
(and a backend it cannot reach as `Unavailable`). Backends: `storage.local` (disk) and
`storage.s3`; `registry.blobs.stores.open_blob_store` picks one by URL scheme.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kiln.core.digest import is_sha256
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, NotFound

if TYPE_CHECKING:
    pass

DEFAULT_CHUNK = 8 * 1024 * 1024


class BlobNotFound(NotFound):
    code = Codes.BLOB_NOT_FOUND


@runtime_checkable
class BlobStore(Protocol):
    """Content-addressed bytes, keyed by lowercase hex sha256."""

    def exists(self, sha256: str) -> bool:
        """True when the complete, verified blob is stored."""
        ...

    def size(self, sha256: str) -> int:
        """Size in bytes; raises BlobNotFound."""
        ...

    def put_stream(self, sha256: str, chunks: Iterable[bytes]) -> int:
        """Store `chunks` under `sha256` and return the size.

        The content is hashed while it streams and becomes visible only if its digest is
        `sha256`; otherwise DigestMismatch is raised. On any error nothing is left behind.
        """
        ...

    def open_range(self, sha256: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Bytes `[start, end)` (end None: to the end) as an iterator of large chunks.

        Raises BlobNotFound before iteration when the blob is missing.
        """
        ...

    def delete(self, sha256: str) -> None:
        """Remove the blob; deleting a missing blob is not an error."""
        ...

    def download_url(self, sha256: str) -> str | None:
        """A URL clients may fetch the bytes from directly (time-limited), or None: stream them through us."""
        ...


def check_sha256(sha256: str) -> str:
    """`sha256` itself when it is 64 lowercase hex digits; InvalidInput otherwise."""
    if not is_sha256(sha256):
        raise InvalidInput(f"invalid sha256 {sha256!r}: expected 64 lowercase hex digits")
    return sha256
