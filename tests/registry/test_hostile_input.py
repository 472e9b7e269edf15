"""No input makes the registry answer 500 or store what it cannot keep: every class below gets a 4xx
with a stable code, on both deployments (SQLite + disk, PostgreSQL + S3)."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from tests.registry.helpers import (
    LLAMA_CONFIG,
    SOURCE_DIGEST,
    assert_error,
    make_release,
    manifest,
    post_eval,
    promote,
    publish,
    seal,
    serve_in_thread,
    sha,
    upload,
)

DATA = bytes(range(256)) * 40  # 10,240 bytes
RELEASE = "/v1/models/tiny/releases/1.0"


@pytest.fixture
def served(client: TestClient) -> TestClient:
    make_release(client, planned=["gguf-q8"])
    publish(client, "gguf-q8", {"model.gguf": DATA}, ["cpu"])
    post_eval(client, "gguf-q8", "passed")
    seal(client)
    assert promote(client).status_code == 200
    return client


DOWNLOADS = [
    f"/v1/blobs/{sha(DATA)}",
    f"{RELEASE}/artifacts/gguf-q8/files/model.gguf",
    "/tiny/resolve/prod%2Fgguf-q8/model.gguf",
    "/kiln/tiny/resolve/1.0%2Fgguf-q8/model.gguf",
]


@pytest.mark.parametrize("url", DOWNLOADS)
def test_absurd_ranges_are_answered_not_crashed(served: TestClient, url: str) -> None:
    huge = "9" * 4300
    for method in ("GET", "HEAD"):
        for header, status in (
            (f"bytes={huge}-".encode(), 416),
            (f"bytes=0-{huge}".encode(), 206),
            (f"bytes=-{huge}".encode(), 206),
            (f"bytes={huge}-{huge}0".encode(), 416),
            (f"bytes={'0' * 5000}-10".encode(), 206),
            (b"bytes=\xb2-\xb3", 200),  # superscript digits (latin-1): not a range, ignored
            (b"bytes=10-5", 200),
            (b"items=0-1", 200),
        ):
            response = served.request(method, url, headers={b"Range": header})
            assert response.status_code == status, (method, header[:30], response.status_code)


@pytest.mark.parametrize("url", DOWNLOADS)
def test_head_answers_as_get_does(served: TestClient, url: str) -> None:
    etag = served.get(url).headers["etag"]
    for method in ("GET", "HEAD"):
        assert served.request(method, url, headers={"If-None-Match": etag}).status_code == 304, method
        part = served.request(method, url, headers={"Range": "bytes=100-199"})
        assert part.status_code == 206 and part.headers["content-range"] == f"bytes 100-199/{len(DATA)}", method
        assert part.headers["content-length"] == "100"
        assert served.request(method, url, headers={"Range": "bytes=999999-"}).status_code == 416, method


def test_model_config_holds_only_storable_numbers(client: TestClient) -> None:
    client.post("/v1/models", json={"name": "tiny"})
    body = {"version": "1.0", "source_digest": SOURCE_DIGEST, "planned_artifacts": ["gguf-q8"]}
    for raw in ('{"num_hidden_layers": 1e400}', '{"num_hidden_layers": NaN}', '{"n": ' + "9" * 4400 + "}"):
        text = json.dumps(body)[:-1] + ', "model_config": ' + raw + "}"
        response = client.post("/v1/models/tiny/releases", content=text, headers={"Content-Type": "application/json"})
        assert_error(response, 422, "INVALID_JSON")
    # Storable but absurd: accepted, and resolve treats it as unknown rather than multiplying it out.
    absurd = {**LLAMA_CONFIG, "num_hidden_layers": 2**62, "num_key_value_heads": 2**62, "head_dim": 2**62}
    make_release(client, model_config=absurd)
    publish(client, "gguf-q8", {"model.gguf": DATA}, ["cpu"])
    post_eval(client, "gguf-q8", "passed")
    seal(client)
    assert promote(client).status_code == 200
    answer = client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu", "context": 10_000_000})
    assert answer.status_code == 200, answer.text
    assert "lacks num_hidden_layers" in answer.json()["reason"]["explanation"]


def test_strings_that_cannot_be_stored_are_refused(client: TestClient) -> None:
    make_release(client, planned=["gguf-q8"])
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/models", {"name": "m", "description": "nul \x00 here"}),
        ("POST", "/v1/models", {"name": "m", "description": "\ud800 lone surrogate"}),
        ("POST", f"{RELEASE}/artifacts/gguf-q8/evals", {"runtime": "x", "status": "passed", "reason": "a\x00b"}),
        ("POST", "/v1/models/tiny/channels/prod", {"version": "1.0", "actor": "\x00"}),
        ("POST", "/v1/models/tiny/channels/prod", {"version": "1.0", "reason": "x", "metrics": {"\x00": 1}}),
    ]
    for method, path, body in cases:
        response = client.request(
            method, path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 422, (path, body, response.text)
    assert [m["name"] for m in client.get("/v1/models").json()] == ["tiny"]


def test_json_bodies_are_bounded_and_strict(client: TestClient) -> None:
    make_release(client)
    headers = {"Content-Type": "application/json"}
    big = json.dumps({"name": "m", "description": "x" * (5 * 1024 * 1024)})
    assert_error(client.post("/v1/models", content=big, headers=headers), 413, "PAYLOAD_TOO_LARGE")
    deep = '{"name": "m", "description": ' + "[" * 30_000 + "]" * 30_000 + "}"  # within the route's 64 KiB
    assert_error(client.post("/v1/models", content=deep, headers=headers), 422, "INVALID_JSON")
    twice = '{"name": "m", "name": "n"}'
    assert_error(client.post("/v1/models", content=twice, headers=headers), 422, "INVALID_JSON")
    no_type = b'{"name": "m", "description": "\\u0000"}'
    assert_error(client.post("/v1/models", content=no_type), 422, "INVALID_JSON")
    assert client.get("/v1/models").json()[0]["name"] == "tiny"


def test_names_longer_than_their_columns_are_refused(client: TestClient) -> None:
    make_release(client, planned=["gguf-q8"])
    upload(client, DATA)
    artifacts = f"{RELEASE}/artifacts"
    for field in ("target", "format", "quant"):
        body = manifest("gguf-q8", {"model.gguf": DATA}, ["cpu"], **{field: "x" * 65})
        assert_error(client.post(artifacts, json=body), 422, "INVALID_INPUT")
    too_long: list[tuple[str, dict[str, Any]]] = [
        ("/v1/models", {"name": "m" * 65}),
        (f"{artifacts}/gguf-q8/evals", {"runtime": "r" * 65, "status": "passed"}),
        ("/v1/tokens", {"name": "t" * 65, "scopes": ["read"]}),
        ("/v1/tokens", {"name": "t", "scopes": ["read"], "models": ["m" * 65]}),
        ("/v1/models/tiny/channels/prod", {"version": "1.0", "actor": "a" * 129}),
    ]
    for path, body in too_long:
        response = client.post(path, json=body)
        assert response.status_code == 422, (path, response.text)
    body = manifest("gguf-q8", {"d/" * 300 + "model.gguf": DATA}, ["cpu"])
    assert_error(client.post(artifacts, json=body), 422, "INVALID_INPUT")


def test_file_names_longer_than_a_file_system_keeps_are_refused(client: TestClient) -> None:
    make_release(client, planned=["gguf-q8"])
    upload(client, DATA)
    artifacts = f"{RELEASE}/artifacts"
    for path in ("m" * 404, "m" * 256, "d/" + "m" * 256 + ".gguf", "d" * 256 + "/model.gguf"):
        error = assert_error(
            client.post(artifacts, json=manifest("gguf-q8", {path: DATA}, ["cpu"])), 422, "INVALID_INPUT"
        )
        assert "more than a file system keeps (255)" in error["message"], error
    assert client.get(f"{RELEASE}/artifacts").json() == []
    assert client.post(artifacts, json=manifest("gguf-q8", {"d/" + "m" * 255: DATA}, ["cpu"])).status_code == 201


def test_names_ending_in_a_newline_are_refused_everywhere(client: TestClient) -> None:
    make_release(client, planned=["gguf-q8"])
    upload(client, DATA)
    artifacts = f"{RELEASE}/artifacts"
    refused: list[tuple[str, dict[str, Any]]] = [
        ("/v1/models", {"name": "tiny2\n"}),
        ("/v1/models/tiny/releases", {"version": "2.0\n", "source_digest": SOURCE_DIGEST, "planned_artifacts": ["a"]}),
        ("/v1/models/tiny/releases", {"version": "2.0", "source_digest": SOURCE_DIGEST, "planned_artifacts": ["a\n"]}),
        (artifacts, manifest("gguf-q8\n", {"model.gguf": DATA}, ["cpu"])),
        (artifacts, {**manifest("gguf-q8", {"model.gguf": DATA}, ["cpu"]), "hardware": ["cpu\n"]}),
        (f"{artifacts}/gguf-q8/evals", {"runtime": "llama.cpp\n", "status": "passed"}),
        ("/v1/tokens", {"name": "ci\n", "scopes": ["read"]}),
        ("/v1/tokens", {"name": "ci", "scopes": ["read"], "models": ["tiny\n"]}),
        ("/v1/models/tiny/channels/prod", {"version": "1.0\n"}),
    ]
    body = manifest("gguf-q8", {"model.gguf": DATA}, ["cpu"])
    body["files"][0]["path"] = "model.gguf\n"
    refused.append((artifacts, body))
    for path, payload in refused:
        response = client.post(path, json=payload)
        assert response.status_code == 422, (path, payload, response.text)
    for url in ("/v1/models/tiny%0A", "/v1/models/tiny/releases/1.0%0A", "/v1/models/tiny/channels/prod%0A"):
        assert client.get(url).status_code == 422, url
    hub = client.get("/tiny%0A/resolve/prod%2Fgguf-q8/model.gguf")
    assert hub.status_code == 404 and hub.headers["X-Error-Code"] == "RepoNotFound"


def test_pages_and_answers_carry_security_headers(served: TestClient) -> None:
    page = served.get("/ui/models/tiny/releases/1.0")
    assert page.status_code == 200
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for response in (page, served.get("/v1/models"), served.get(DOWNLOADS[0]), served.get("/ui/nope")):
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def test_absurd_content_lengths_are_refused(app: FastAPI, served: TestClient, admin_token: str) -> None:
    with serve_in_thread(app) as port:
        for path in (f"/v1/blobs/{'0' * 64}", "/v1/models"):
            method = "PUT" if "blobs" in path else "POST"
            head = (
                f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin_token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {'9' * 5000}\r\n\r\n"
            )
            status = _raw(port, head.encode()).split(b"\r\n", 1)[0]
            assert status.split()[1] in (b"400", b"413"), (path, status)
