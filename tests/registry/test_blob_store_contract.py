"""The BlobStore contract, run against every backend (local disk now; S3 joins the `store` params later)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.errors import DigestMismatch, InvalidInput, UnknownName
from registry.blobs.store import BlobNotFound, BlobStore, LocalBlobStore, open_blob_store


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chunks_of(data: bytes, size: int = 1000) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def stored_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.fixture(params=["local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        # A small chunk size, so reads of a few KiB already span several chunks.
        return LocalBlobStore(tmp_path / "blobs", chunk_size=4096)
    raise AssertionError(request.param)


def test_is_a_blob_store(store: BlobStore) -> None:
    assert isinstance(store, BlobStore)


def test_put_then_read_back(store: BlobStore) -> None:
    data = os.urandom(50_000)
    digest = sha(data)
    assert not store.exists(digest)
    assert store.put_stream(digest, chunks_of(data)) == len(data)
    assert store.exists(digest)
    assert store.size(digest) == len(data)
    parts = list(store.open_range(digest))
    assert b"".join(parts) == data
    assert len(parts) > 1 and max(len(p) for p in parts) <= 4096  # streamed in chunks


def test_ranges(store: BlobStore) -> None:
    data = bytes(range(256)) * 100
    digest = sha(data)
    store.put_stream(digest, [data])
    assert b"".join(store.open_range(digest, 10, 20)) == data[10:20]
    assert b"".join(store.open_range(digest, 25_000)) == data[25_000:]
    assert b"".join(store.open_range(digest, 5, 10**9)) == data[5:]
    assert b"".join(store.open_range(digest, 7, 7)) == b""


def test_empty_blob(store: BlobStore) -> None:
    digest = sha(b"")
    assert store.put_stream(digest, []) == 0
    assert store.size(digest) == 0
    assert b"".join(store.open_range(digest)) == b""


def test_put_is_idempotent(store: BlobStore) -> None:
    data = b"same bytes"
    digest = sha(data)
    store.put_stream(digest, [data])
    store.put_stream(digest, [data])
    assert b"".join(store.open_range(digest)) == data


def test_digest_mismatch_leaves_nothing(store: BlobStore, tmp_path: Path) -> None:
    claimed = sha(b"what the client said")
    with pytest.raises(DigestMismatch) as info:
        store.put_stream(claimed, chunks_of(b"what it sent" * 1000))
    assert info.value.code == "DIGEST_MISMATCH"
    assert info.value.details["actual"] == sha(b"what it sent" * 1000)
    assert not store.exists(claimed)
    assert stored_files(tmp_path) == []


def test_failing_stream_leaves_nothing(store: BlobStore, tmp_path: Path) -> None:
    def broken() -> Iterator[bytes]:
        yield b"x" * 10_000
        raise ConnectionResetError("client went away")

    digest = sha(b"x" * 20_000)
    with pytest.raises(ConnectionResetError):
        store.put_stream(digest, broken())
    assert not store.exists(digest)
    assert stored_files(tmp_path) == []


def test_missing_blob_is_blob_not_found(store: BlobStore) -> None:
    digest = sha(b"never stored")
    with pytest.raises(BlobNotFound) as info:
        store.size(digest)
    assert info.value.code == "BLOB_NOT_FOUND"
    with pytest.raises(BlobNotFound):
        store.open_range(digest)  # before any iteration


def test_delete(store: BlobStore) -> None:
    digest = sha(b"to delete")
    store.put_stream(digest, [b"to delete"])
    store.delete(digest)
    assert not store.exists(digest)
    store.delete(digest)  # deleting again is not an error


@pytest.mark.parametrize("bad", ["", "ABC", "../" + "a" * 61, "g" * 64, "A" * 64])
def test_invalid_digest_is_rejected(store: BlobStore, bad: str) -> None:
    with pytest.raises(InvalidInput):
        store.exists(bad)
    with pytest.raises(InvalidInput):
        store.put_stream(bad, [b"x"])


def test_local_layout_is_content_addressed(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    data = b"layout"
    digest = sha(data)
    store.put_stream(digest, [data])
    assert (tmp_path / digest[:2] / digest[2:4] / digest).read_bytes() == data


def test_store_chosen_by_url_scheme(tmp_path: Path) -> None:
    store = open_blob_store((tmp_path / "b").as_uri())
    assert isinstance(store, LocalBlobStore) and store.root == tmp_path / "b"
    with pytest.raises(UnknownName, match="supported: file"):
        open_blob_store("s3://bucket/prefix")
    with pytest.raises(InvalidInput, match="absolute path"):
        open_blob_store("file://relative/dir")
