"""Blob uploads and downloads through the HTTP API: verification, size limit, Range, ETag."""

from __future__ import annotations

import os

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error, sha, stored_blob_objects, upload

DATA = bytes(range(256)) * 40  # 10240 bytes


def test_upload_then_present(client: TestClient) -> None:
    digest = sha(DATA)
    assert client.head(f"/v1/blobs/{digest}").status_code == 404
    created = client.put(f"/v1/blobs/{digest}", content=DATA)
    assert created.status_code == 201, created.text
    assert created.json()["size"] == len(DATA)
    again = client.put(f"/v1/blobs/{digest}", content=DATA)
    assert again.status_code == 200
    head = client.head(f"/v1/blobs/{digest}")
    assert head.status_code == 200
    assert head.headers["content-length"] == str(len(DATA))
    assert head.headers["etag"] == f'"{digest}"'


def test_streamed_upload(client: TestClient) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)

    def body():
        for i in range(0, len(data), 65536):
            yield data[i : i + 65536]

    digest = sha(data)
    assert client.put(f"/v1/blobs/{digest}", content=body()).status_code == 201
    assert client.get(f"/v1/blobs/{digest}").content == data


def test_digest_mismatch_stores_nothing(client: TestClient, settings: RegistrySettings) -> None:
    claimed = sha(b"something else")
    error = assert_error(client.put(f"/v1/blobs/{claimed}", content=DATA), 422, "DIGEST_MISMATCH")
    assert error["details"]["actual"] == sha(DATA)
    assert client.head(f"/v1/blobs/{claimed}").status_code == 404
    assert client.get(f"/v1/blobs/{claimed}").status_code == 404
    assert stored_blob_objects(settings) == []


def test_invalid_digest_in_path(client: TestClient) -> None:
    assert_error(client.put("/v1/blobs/ABC", content=b"x"), 422, "INVALID_INPUT")
    assert_error(client.get("/v1/blobs/" + "A" * 64), 422, "INVALID_INPUT")


@pytest.fixture
def small_limit_client(settings: RegistrySettings):
    app: FastAPI = create_app(settings.model_copy(update={"max_upload_bytes": 1000}))
    with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['publish'])}"}) as c:
        yield c


def test_upload_over_limit_is_413(small_limit_client: TestClient, settings: RegistrySettings) -> None:
    digest = sha(DATA)
    error = assert_error(small_limit_client.put(f"/v1/blobs/{digest}", content=DATA), 413, "PAYLOAD_TOO_LARGE")
    assert error["details"]["limit"] == 1000

    def body():  # no Content-Length: the limit is enforced while streaming
        yield DATA[:600]
        yield DATA[600:]

    assert_error(small_limit_client.put(f"/v1/blobs/{digest}", content=body()), 413, "PAYLOAD_TOO_LARGE")
    assert small_limit_client.head(f"/v1/blobs/{digest}").status_code == 404
    assert stored_blob_objects(settings) == []


def test_download_whole(client: TestClient) -> None:
    digest = upload(client, DATA)
    response = client.get(f"/v1/blobs/{digest}")
    assert response.status_code == 200
    assert response.content == DATA
    assert response.headers["etag"] == f'"{digest}"'
    assert response.headers["accept-ranges"] == "bytes"
    assert response.headers["content-length"] == str(len(DATA))


@pytest.mark.parametrize(
    ("header", "first", "last"),
    [
        ("bytes=0-99", 0, 99),
        ("bytes=100-", 100, len(DATA) - 1),
        ("bytes=-10", len(DATA) - 10, len(DATA) - 1),
        ("bytes=10000-999999", 10000, len(DATA) - 1),
        ("bytes=-999999", 0, len(DATA) - 1),
        ("bytes=5-5", 5, 5),
    ],
)
def test_download_range(client: TestClient, header: str, first: int, last: int) -> None:
    digest = upload(client, DATA)
    response = client.get(f"/v1/blobs/{digest}", headers={"Range": header})
    assert response.status_code == 206
    assert response.content == DATA[first : last + 1]
    assert response.headers["content-range"] == f"bytes {first}-{last}/{len(DATA)}"
    assert response.headers["content-length"] == str(last - first + 1)


@pytest.mark.parametrize("header", [f"bytes={len(DATA)}-", "bytes=99999-100000", "bytes=-0"])
def test_unsatisfiable_range_is_416(client: TestClient, header: str) -> None:
    digest = upload(client, DATA)
    response = client.get(f"/v1/blobs/{digest}", headers={"Range": header})
    assert_error(response, 416, "RANGE_NOT_SATISFIABLE")
    assert response.headers["content-range"] == f"bytes */{len(DATA)}"


@pytest.mark.parametrize("header", ["bytes=0-1,5-6", "items=0-1", "bytes=9-3", "bytes=abc"])
def test_ranges_we_do_not_serve_get_the_whole_blob(client: TestClient, header: str) -> None:
    digest = upload(client, DATA)
    response = client.get(f"/v1/blobs/{digest}", headers={"Range": header})
    assert response.status_code == 200
    assert response.content == DATA


def test_conditional_requests(client: TestClient) -> None:
    digest = upload(client, DATA)
    etag = f'"{digest}"'
    not_modified = client.get(f"/v1/blobs/{digest}", headers={"If-None-Match": etag})
    assert not_modified.status_code == 304
    assert not_modified.content == b""
    assert not_modified.headers["etag"] == etag
    assert client.get(f"/v1/blobs/{digest}", headers={"If-None-Match": f'W/"x", {etag}'}).status_code == 304
    assert client.get(f"/v1/blobs/{digest}", headers={"If-None-Match": '"other"'}).status_code == 200
    # If-Range with a stale validator: the whole blob, not the range.
    stale = client.get(f"/v1/blobs/{digest}", headers={"Range": "bytes=0-9", "If-Range": '"old"'})
    assert stale.status_code == 200 and stale.content == DATA
    fresh = client.get(f"/v1/blobs/{digest}", headers={"Range": "bytes=0-9", "If-Range": etag})
    assert fresh.status_code == 206 and fresh.content == DATA[:10]


def test_missing_blob_download_is_404(client: TestClient) -> None:
    assert_error(client.get(f"/v1/blobs/{sha(b'nothing')}"), 404, "BLOB_NOT_FOUND")


def test_empty_blob(client: TestClient) -> None:
    digest = upload(client, b"")
    response = client.get(f"/v1/blobs/{digest}")
    assert response.status_code == 200 and response.content == b""
    assert_error(client.get(f"/v1/blobs/{digest}", headers={"Range": "bytes=0-"}), 416, "RANGE_NOT_SATISFIABLE")
