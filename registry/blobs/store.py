"""Where blob bytes live: a small Protocol, its local-disk implementation, and the URI-scheme switch.

Every backend streams (nothing is read whole into memory), verifies content against its sha256
before it becomes visible, and reports a missing blob as `BlobNotFound`, whatever its own error
(and a backend it cannot reach as `Unavailable`). The S3 backend lives in `registry.blobs.s3`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from kiln.digest import is_sha256
from kiln.errors import DigestMismatch, InvalidInput, NotFound, UnknownName

if TYPE_CHECKING:
    from registry.settings import RegistrySettings

DEFAULT_CHUNK = 8 * 1024 * 1024


class BlobNotFound(NotFound):
    code = "BLOB_NOT_FOUND"


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


class LocalBlobStore:
    """Blobs as files under `root`, at `ab/cd/abcd...`; uploads go through `root/tmp` and a rename."""

    def __init__(self, root: str | Path, chunk_size: int = DEFAULT_CHUNK):
        self.root = Path(root)
        self.chunk_size = chunk_size
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def path(self, sha256: str) -> Path:
        check_sha256(sha256)
        return self.root / sha256[:2] / sha256[2:4] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int:
        try:
            return self.path(sha256).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(f"blob {sha256} not found", details={"sha256": sha256}) from None

    def put_stream(self, sha256: str, chunks: Iterable[bytes]) -> int:
        final = self.path(sha256)
        fd, tmp_name = tempfile.mkstemp(dir=self._tmp, prefix=sha256[:16] + ".", suffix=".part")
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    f.write(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            actual = digest.hexdigest()
            if actual != sha256:
                raise DigestMismatch(
                    f"content has sha256 {actual}, not the claimed {sha256}",
                    details={"expected": sha256, "actual": actual, "size": size},
                )
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            return size
        finally:
            # Only a completed, verified upload was renamed away; anything else is removed.
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def open_range(self, sha256: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        path = self.path(sha256)
        total = self.size(sha256)  # raises BlobNotFound now, not mid-iteration
        stop = total if end is None else min(end, total)
        if start < 0 or start > stop:
            raise InvalidInput(f"invalid range [{start}, {stop}) of a {total}-byte blob")
        return self._read(path, start, stop)

    def _read(self, path: Path, start: int, stop: int) -> Iterator[bytes]:
        # The file is opened on first iteration, so an unconsumed iterator holds no handle.
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            raise BlobNotFound(f"blob {path.name} was deleted before it was read") from None
        with f:
            f.seek(start)
            remaining = stop - start
            while remaining > 0:
                chunk = f.read(min(self.chunk_size, remaining))
                if not chunk:
                    raise BlobNotFound(f"blob {path.name} was truncated while reading")
                remaining -= len(chunk)
                yield chunk

    def delete(self, sha256: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(sha256).unlink()

    def download_url(self, sha256: str) -> str | None:
        return None  # local files are always streamed by the registry


SUPPORTED_SCHEMES = ("file", "s3")


def open_blob_store(url: str, settings: RegistrySettings | None = None) -> BlobStore:
    """The blob store for a URI, chosen by scheme: `file:///abs/dir` or `s3://bucket/prefix`.

    S3 takes its endpoint, part size and download mode from `settings` (KILN_REGISTRY_S3_*), and
    region and credentials from the standard AWS environment. The bucket is checked now, so a
    misconfigured store fails at startup (Unavailable) rather than on the first upload.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise InvalidInput(f"blob store URL {url!r}: file URLs need an absolute path (file:///dir)")
        return LocalBlobStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        from registry.blobs.s3 import S3BlobStore, make_s3_client, parse_s3_url
        from registry.settings import RegistrySettings

        bucket, prefix = parse_s3_url(url)
        settings = settings or RegistrySettings()
        store = S3BlobStore(
            bucket,
            prefix,
            client=make_s3_client(settings.s3_endpoint_url),
            part_size=settings.s3_part_size,
            downloads=settings.s3_downloads,
            presign_expiry_s=settings.s3_presign_expiry_s,
        )
        store.check_bucket()
        return store
    raise UnknownName(
        f"unsupported blob store URL scheme {parsed.scheme!r} in {url!r}; supported: " + ", ".join(SUPPORTED_SCHEMES),
        details={"known": list(SUPPORTED_SCHEMES)},
    )
