"""The local-disk blob store: files under a root, written through a temporary file and a rename."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from kiln.core.errors import DigestMismatch, InvalidInput
from kiln.storage.store import DEFAULT_CHUNK, BlobNotFound, check_sha256


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
        return read_file(path, start, stop, self.chunk_size)

    def delete(self, sha256: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(sha256).unlink()

    def download_url(self, sha256: str) -> str | None:
        return None  # local files are always streamed by the registry


def read_file(path: Path, start: int, stop: int, chunk_size: int = DEFAULT_CHUNK) -> Iterator[bytes]:
    """Bytes `[start, stop)` of a file, in chunks; BlobNotFound if it is gone or shorter than that."""
    # The file is opened on first iteration, so an unconsumed iterator holds no handle.
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        raise BlobNotFound(f"blob {path.name} was deleted before it was read") from None
    with f:
        f.seek(start)
        remaining = stop - start
        while remaining > 0:
            chunk = f.read(min(chunk_size, remaining))
            if not chunk:
                raise BlobNotFound(f"blob {path.name} was truncated while reading")
            remaining -= len(chunk)
            yield chunk
