"""The BlobStore contract, run against every backend: local disk, and S3 (moto's server over HTTP with boto3)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kiln.core.errors import DigestMismatch, InvalidInput, Unavailable, UnknownName
from kiln.registry.blobs.stores import open_blob_store
from kiln.registry.settings import RegistrySettings
from kiln.storage.local import LocalBlobStore
from kiln.storage.s3 import S3BlobStore, make_s3_client, parse_s3_url
from kiln.storage.store import BlobNotFound, BlobStore
from tests.registry.s3_server import BUCKET, TEST_PART_SIZE, S3Server, free_port

BIG = 12 * 1024 * 1024  # over two S3 parts of 5 MiB: a multipart upload of three parts


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chunks_of(data: bytes, size: int = 1000) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@dataclass
class Backend:
    store: BlobStore
    leftovers: Callable[[], list[str]]  # everything the backend holds: final blobs and unfinished uploads


def _local(tmp_path: Path) -> Backend:
    # A small chunk size, so reads of a few KiB already span several chunks.
    root = tmp_path / "blobs"
    store = LocalBlobStore(root, chunk_size=4096)
    return Backend(store, lambda: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()))


def _s3(server: S3Server) -> Backend:
    url = server.new_url()
    bucket, prefix = parse_s3_url(url)
    store = S3BlobStore(
        bucket,
        prefix,
        client=make_s3_client(server.endpoint_url),
        part_size=TEST_PART_SIZE,
        downloads="redirect",
        chunk_size=4096,
    )
    return Backend(store, lambda: server.leftovers(url))


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return _local(tmp_path)
    return _s3(request.getfixturevalue("s3_server"))


@pytest.fixture
def store(backend: Backend) -> BlobStore:
    return backend.store


def test_is_a_blob_store(store: BlobStore) -> None:
    assert isinstance(store, BlobStore)


def test_put_then_read_back(backend: Backend) -> None:
    store = backend.store
    data = os.urandom(50_000)
    digest = sha(data)
    assert not store.exists(digest)
    assert store.put_stream(digest, chunks_of(data)) == len(data)
    assert store.exists(digest)
    assert store.size(digest) == len(data)
    parts = list(store.open_range(digest))
    assert b"".join(parts) == data
    assert len(parts) > 1 and max(len(p) for p in parts) <= 4096  # streamed in chunks
    assert len(backend.leftovers()) == 1  # the blob, and nothing else


def test_ranges(store: BlobStore) -> None:
    data = bytes(range(256)) * 100
    digest = sha(data)
    store.put_stream(digest, [data])
    assert b"".join(store.open_range(digest, 10, 20)) == data[10:20]
    assert b"".join(store.open_range(digest, 25_000)) == data[25_000:]
    assert b"".join(store.open_range(digest, 5, 10**9)) == data[5:]
    assert b"".join(store.open_range(digest, 7, 7)) == b""
    with pytest.raises(InvalidInput):
        store.open_range(digest, 30_000)


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


def test_large_blob_streams_in_parts(backend: Backend) -> None:
    store = backend.store
    data = os.urandom(BIG)
    digest = sha(data)
    assert store.put_stream(digest, chunks_of(data, 1024 * 1024)) == BIG
    assert store.size(digest) == BIG
    assert hashlib.sha256(b"".join(store.open_range(digest))).hexdigest() == digest
    assert (
        b"".join(store.open_range(digest, 5 * 1024 * 1024 - 3, 5 * 1024 * 1024 + 3))
        == data[5 * 1024 * 1024 - 3 : 5 * 1024 * 1024 + 3]
    )
    assert len(backend.leftovers()) == 1
    if isinstance(store, S3BlobStore):  # it went up as a multipart upload of three parts
        etag = store.client.head_object(Bucket=store.bucket, Key=store.key(digest))["ETag"]
        assert etag.strip('"').endswith("-3"), etag


@pytest.mark.parametrize("size", [30_000, BIG], ids=["one-part", "multipart"])
def test_digest_mismatch_leaves_nothing(backend: Backend, size: int) -> None:
    store = backend.store
    sent = os.urandom(size)
    claimed = sha(b"what the client said")
    with pytest.raises(DigestMismatch) as info:
        store.put_stream(claimed, chunks_of(sent, 256 * 1024))
    assert info.value.code == "DIGEST_MISMATCH"
    assert info.value.details["actual"] == sha(sent)
    assert not store.exists(claimed)
    assert not store.exists(sha(sent))
    assert backend.leftovers() == []


@pytest.mark.parametrize("size", [10_000, BIG], ids=["one-part", "multipart"])
def test_failing_stream_leaves_nothing(backend: Backend, size: int) -> None:
    def broken() -> Iterator[bytes]:
        yield b"x" * size
        raise ConnectionResetError("client went away")

    digest = sha(b"x" * (2 * size))
    with pytest.raises(ConnectionResetError):
        backend.store.put_stream(digest, broken())
    assert not backend.store.exists(digest)
    assert backend.leftovers() == []


def test_concurrent_identical_puts(backend: Backend) -> None:
    store = backend.store
    data = os.urandom(TEST_PART_SIZE + 1024 * 1024)  # two parts on S3
    digest = sha(data)
    results: list[int | BaseException] = []

    def put() -> None:
        try:
            results.append(store.put_stream(digest, chunks_of(data, 256 * 1024)))
        except BaseException as exc:  # reported by the assertion below
            results.append(exc)

    threads = [threading.Thread(target=put) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [len(data)] * 4
    assert hashlib.sha256(b"".join(store.open_range(digest))).hexdigest() == digest
    assert len(backend.leftovers()) == 1


def test_missing_blob_is_blob_not_found(store: BlobStore) -> None:
    digest = sha(b"never stored")
    assert not store.exists(digest)
    with pytest.raises(BlobNotFound) as info:
        store.size(digest)
    assert info.value.code == "BLOB_NOT_FOUND"
    with pytest.raises(BlobNotFound):
        store.open_range(digest)  # before any iteration


def test_blob_deleted_while_reading_is_blob_not_found(store: BlobStore) -> None:
    data = os.urandom(20_000)
    digest = sha(data)
    store.put_stream(digest, [data])
    reader = store.open_range(digest)
    store.delete(digest)
    with pytest.raises(BlobNotFound):
        b"".join(reader)


def test_delete(backend: Backend) -> None:
    store = backend.store
    digest = sha(b"to delete")
    store.put_stream(digest, [b"to delete"])
    store.delete(digest)
    assert not store.exists(digest)
    store.delete(digest)  # deleting again is not an error
    assert backend.leftovers() == []


@pytest.mark.parametrize("bad", ["", "ABC", "../" + "a" * 61, "g" * 64, "A" * 64])
def test_invalid_digest_is_rejected(store: BlobStore, bad: str) -> None:
    with pytest.raises(InvalidInput):
        store.exists(bad)
    with pytest.raises(InvalidInput):
        store.put_stream(bad, [b"x"])


def test_download_url_serves_the_bytes_to_a_plain_http_client(backend: Backend) -> None:
    store = backend.store
    data = os.urandom(100_000)
    digest = sha(data)
    store.put_stream(digest, [data])
    url = store.download_url(digest)
    if isinstance(store, LocalBlobStore):
        assert url is None  # local blobs are always streamed by the registry
        return
    assert url is not None and url.startswith("http")
    whole = httpx.get(url)
    assert whole.status_code == 200 and whole.content == data
    part = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == data[100:200]


# -- backend-specific behaviour -------------------------------------------------------------------


def test_local_layout_is_content_addressed(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    data = b"layout"
    digest = sha(data)
    store.put_stream(digest, [data])
    assert (tmp_path / digest[:2] / digest[2:4] / digest).read_bytes() == data


def test_s3_layout_is_content_addressed(s3_server: S3Server) -> None:
    url = s3_server.new_url()
    store = open_blob_store(url, RegistrySettings(blob_url=url, **s3_server.settings()))
    data = b"layout"
    digest = sha(data)
    store.put_stream(digest, [data])
    key = f"{url.removeprefix(f's3://{BUCKET}/')}/{digest[:2]}/{digest[2:4]}/{digest}"
    assert s3_server.client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data


def test_store_chosen_by_url_scheme(tmp_path: Path, s3_server: S3Server) -> None:
    store = open_blob_store((tmp_path / "b").as_uri())
    assert isinstance(store, LocalBlobStore) and store.root == tmp_path / "b"
    settings = RegistrySettings(**{**s3_server.settings(), "s3_downloads": "redirect"})
    s3 = open_blob_store(f"s3://{BUCKET}/some/prefix/", settings)
    assert isinstance(s3, S3BlobStore)
    assert (s3.bucket, s3.prefix, s3.part_size, s3.downloads) == (BUCKET, "some/prefix/", TEST_PART_SIZE, "redirect")
    with pytest.raises(UnknownName, match="supported: file, s3"):
        open_blob_store("gs://bucket/prefix")
    with pytest.raises(InvalidInput, match="absolute path"):
        open_blob_store("file://relative/dir")


@pytest.mark.parametrize(
    "url",
    ["s3://", "s3://UPPER/x", "s3://ab", "s3://bucket/x?endpoint=http://elsewhere", "s3://bucket/../x"],
)
def test_bad_s3_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidInput) as info:
        open_blob_store(url, RegistrySettings())
    assert info.value.code == "INVALID_BLOB_URL"


def test_s3_part_size_below_the_minimum_is_refused(s3_server: S3Server) -> None:
    with pytest.raises(InvalidInput) as info:
        S3BlobStore(BUCKET, "", client=s3_server.client, part_size=1024 * 1024)
    assert info.value.code == "INVALID_SETTING"


def test_missing_bucket_is_unavailable_at_startup(s3_server: S3Server) -> None:
    with pytest.raises(Unavailable, match="does not exist") as info:
        open_blob_store("s3://no-such-bucket/x", RegistrySettings(**s3_server.settings()))
    assert info.value.code == "BLOB_STORE_UNAVAILABLE"


def test_unreachable_s3_is_unavailable(s3_server: S3Server) -> None:
    settings = RegistrySettings(**{**s3_server.settings(), "s3_endpoint_url": f"http://127.0.0.1:{free_port()}"})
    with pytest.raises(Unavailable) as info:
        open_blob_store(f"s3://{BUCKET}/x", settings)
    assert info.value.code == "BLOB_STORE_UNAVAILABLE"
    store = S3BlobStore(BUCKET, "x/", client=make_s3_client(settings.s3_endpoint_url))
    with pytest.raises(Unavailable):
        store.exists(sha(b"anything"))
    with pytest.raises(Unavailable):
        store.put_stream(sha(b"anything"), [b"anything"])
