"""S3 with KILN_REGISTRY_S3_DOWNLOADS=redirect: downloads are 307s to presigned URLs, fetched from S3 directly.

The S3 server is moto's, on 127.0.0.1; the registry is reached as `localhost`, so that Hub
clients see the presigned URL on another host, as they would with real S3.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.settings import RegistrySettings
from tests.registry.helpers import assert_error, make_release, post_eval, promote, publish, seal, serve_in_thread, sha
from tests.registry.s3_server import S3Server

WEIGHTS = os.urandom(11 * 1024 * 1024 + 5)  # a multipart upload, and over one Hub download chunk
CONFIG = b'{"model_type": "llama"}'
FILE_URL = "/v1/models/tiny/releases/1.0/artifacts/hf-bf16/files/model.safetensors"


@pytest.fixture
def settings(db_url: str, tmp_path: Path, s3_server: S3Server) -> RegistrySettings:
    return RegistrySettings(
        database_url=db_url,
        data_dir=tmp_path / "data",
        blob_url=s3_server.new_url(),
        public_url=None,
        **{**s3_server.settings(), "s3_downloads": "redirect"},
    )


@pytest.fixture
def seeded(client: TestClient) -> TestClient:
    make_release(client, planned=["hf-bf16"])
    files = {"config.json": CONFIG, "model.safetensors": WEIGHTS}
    publish(client, "hf-bf16", files, ["cpu"], quant="bf16", target="hf-bundle", format="safetensors")
    post_eval(client, "hf-bf16", "not_evaluated", reason="no evals in this test")
    seal(client)
    assert promote(client, "1.0").status_code == 200
    return client


def test_downloads_redirect_to_presigned_urls(seeded: TestClient, s3_server: S3Server) -> None:
    digest = sha(WEIGHTS)
    for url in (f"/v1/blobs/{digest}", FILE_URL):
        response = seeded.get(url, follow_redirects=False)
        assert response.status_code == 307, response.text
        location = response.headers["location"]
        assert location.startswith(s3_server.endpoint_url + "/")
        assert response.headers["etag"] == f'"{digest}"' and response.headers["cache-control"] == "no-store"
        # A plain HTTP client follows it to S3, which serves the bytes and byte ranges itself.
        assert httpx.get(location).content == WEIGHTS
        part = httpx.get(location, headers={"Range": "bytes=1000-1999"})
        assert part.status_code == 206 and part.content == WEIGHTS[1000:2000]


def test_head_and_conditional_requests_are_answered_by_the_registry(seeded: TestClient) -> None:
    digest = sha(WEIGHTS)
    # A presigned URL is signed for GET only: HEAD is answered here, with the blob's headers.
    for url in (f"/v1/blobs/{digest}", FILE_URL):
        head = seeded.head(url, follow_redirects=False)
        assert head.status_code == 200 and head.headers["content-length"] == str(len(WEIGHTS))
    cached = seeded.get(FILE_URL, headers={"If-None-Match": f'"{digest}"'}, follow_redirects=False)
    assert cached.status_code == 304
    assert_error(seeded.get(f"/v1/blobs/{sha(b'never uploaded')}", follow_redirects=False), 404, "BLOB_NOT_FOUND")


@pytest.fixture
def live(app: FastAPI, seeded: TestClient) -> Iterator[str]:
    """The app served by uvicorn on 127.0.0.1, addressed as `localhost` (S3 is at 127.0.0.1)."""
    with serve_in_thread(app) as port:
        yield f"http://localhost:{port}"


def test_hub_head_is_a_redirect_carrying_the_file_metadata(live: str, s3_server: S3Server) -> None:
    response = httpx.head(f"{live}/tiny/resolve/prod%2Fhf-bf16/model.safetensors")
    assert response.status_code == 307
    assert response.headers["location"].startswith(s3_server.endpoint_url + "/")
    assert len(response.headers["x-repo-commit"]) == 40
    assert response.headers["x-linked-etag"] == f'"{sha(WEIGHTS)}"'
    assert response.headers["x-linked-size"] == str(len(WEIGHTS))
    ranged = httpx.get(
        f"{live}/tiny/resolve/prod%2Fhf-bf16/model.safetensors", headers={"Range": "bytes=-10"}, follow_redirects=True
    )
    assert ranged.status_code == 206 and ranged.content == WEIGHTS[-10:]


def test_hub_clients_download_from_s3(live: str, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download, snapshot_download

    path = hf_hub_download("tiny", "model.safetensors", revision="prod/hf-bf16", endpoint=live, cache_dir=tmp_path)
    assert Path(path).read_bytes() == WEIGHTS
    snapshot = Path(snapshot_download("tiny", revision="prod/hf-bf16", endpoint=live, cache_dir=tmp_path / "s"))
    assert (snapshot / "config.json").read_bytes() == CONFIG
    assert (snapshot / "model.safetensors").read_bytes() == WEIGHTS
