"""Content digests and canonical JSON: the basis of cache keys and content addresses."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

CHUNK = 8 * 1024 * 1024


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8. Never hash string concatenations."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def same_json(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are one JSON value: their canonical JSON is equal. Python's `==` is not that: it
    finds `True == 1` and `1.0 == 1`. A value JSON cannot hold is the same as nothing."""
    try:
        return canonical_json(a) == canonical_json(b)
    except (TypeError, ValueError, RecursionError):
        return False


def sha256_json(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_stamp(path: str | Path) -> list[int]:
    """(device, inode, size, mtime_ns) of `path`, links followed: what a rewrite or a replacement of the file
    changes. Unlike ctime, a hard link to the file leaves it alone."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


class HashCache:
    """sha256 of local files, remembered by (device, inode, size, mtime, ctime).

    Planning a build hashes every source file to compute cache keys; for a 140 GB release that is
    minutes of reading on every `kiln build`. Any write to a file changes its ctime, which the
    user cannot set, so a stale entry is never served. The cache is a JSON file, rewritten whole
    (temp file + rename) after new entries; losing it only costs re-hashing.
    """

    def __init__(self, path: Path):
        self.path = path
        self._entries: dict[str, dict[str, Any]] = {}
        self._dirty = False
        if path.is_file():
            try:
                self._entries = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                self._entries = {}

    def sha256(self, file: str | Path) -> str:
        p = Path(file).resolve()
        hit = self.recorded(p)
        if hit is not None:
            return hit
        st = p.stat()
        stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        digest = sha256_file(p)
        self._entries[str(p)] = {"stat": stamp, "sha256": digest}
        self._dirty = True
        return digest

    def recorded(self, file: str | Path) -> str | None:
        """The sha256 recorded for `file` as it is now, or None (never hashed, or changed since): reads nothing
        but its stat."""
        p = Path(file).resolve()
        st = p.stat()
        hit = self._entries.get(str(p))
        if hit and hit.get("stat") == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]:
            return str(hit["sha256"])
        return None

    def remember_linked(self, file: str | Path, digest: str, stamp: list[int]) -> bool:
        """After a hard link to `file` (which moves its ctime), record `digest` again as its sha256 if the file is
        still `stamp` (`file_stamp`: device, inode, size, mtime); False, recording nothing, if it is not."""
        if file_stamp(file) != stamp:
            return False
        self.remember(file, digest)
        return True

    def remember(self, file: str | Path, digest: str) -> None:
        """Record `digest` as the sha256 of `file` as it is now (its content was hashed as it was written)."""
        p = Path(file).resolve()
        st = p.stat()
        stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        self._entries[str(p)] = {"stat": stamp, "sha256": digest}
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._entries))
        os.replace(tmp, self.path)
        self._dirty = False
