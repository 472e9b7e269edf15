"""Hub-compatible downloads, driven by the real `huggingface_hub` client against a live registry server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from tests.registry.helpers import assert_error, make_release, post_eval, promote, publish, seal, serve_in_thread, sha

GGUF = os.urandom(24 * 1024 * 1024 + 17)  # over two of the client's 10 MiB download chunks
CUT_AT = 12 * 1024 * 1024
CONFIG = b'{"model_type": "llama"}'
WEIGHTS = os.urandom(200_000)


class CutFirstDownload:
    """ASGI middleware: records Range headers, and cuts the first full GET of a `.gguf` after CUT_AT bytes,
    as a dropped connection would (the client sees a short body and must resume)."""

    def __init__(self, app: Any, ranges: list[str]) -> None:
        self.app, self.ranges, self.cut = app, ranges, False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        range_header = dict(scope["headers"]).get(b"range")
        if range_header is not None:
            self.ranges.append(range_header.decode())
        if self.cut or scope["method"] != "GET" or range_header is not None or not scope["path"].endswith(".gguf"):
            return await self.app(scope, receive, send)
        self.cut, sent = True, 0

        async def cut_send(message: Any) -> None:
            nonlocal sent
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                if sent + len(body) > CUT_AT:
                    await send({**message, "body": body[: CUT_AT - sent], "more_body": True})
                    raise ConnectionAbortedError("connection cut mid-download (test)")
                sent += len(body)
            await send(message)

        await self.app(scope, receive, cut_send)


@pytest.fixture
def seen_ranges(app: FastAPI) -> list[str]:
    """Range headers the server received; the first .gguf download is cut after CUT_AT bytes."""
    ranges: list[str] = []
    app.add_middleware(CutFirstDownload, ranges=ranges)
    return ranges


@pytest.fixture
def live(app: FastAPI, seen_ranges: list[str], client: TestClient) -> Iterator[str]:
    """The app served by uvicorn on a free loopback port, seeded with one promoted release."""
    make_release(client, planned=["gguf-q4", "hf-bf16"])
    publish(client, "gguf-q4", {"model-q4.gguf": GGUF}, ["cpu"], quant="q4_k_m")
    publish(
        client,
        "hf-bf16",
        {"config.json": CONFIG, "model.safetensors": WEIGHTS, "tokenizer/tokenizer.json": b"{}"},
        ["cpu"],
        quant="bf16",
        target="hf-bundle",
        format="safetensors",
    )
    for name in ("gguf-q4", "hf-bf16"):
        post_eval(client, name, "not_evaluated", reason="no evals in this test")
    seal(client)
    assert promote(client, "1.0").status_code == 200
    with serve_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}"


def _commit(client: TestClient, artifact: str, version: str = "1.0") -> str:
    digest: str = client.get(f"/v1/models/tiny/releases/{version}/artifacts/{artifact}").json()["manifest_digest"]
    return digest[:40]


def test_snapshot_download_by_channel_and_version(live: str, client: TestClient, tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    path = Path(snapshot_download("tiny", revision="prod/gguf-q4", endpoint=live, cache_dir=tmp_path / "cache"))
    assert (path / "model-q4.gguf").read_bytes() == GGUF
    assert path.name == _commit(client, "gguf-q4")  # the client's cache is keyed by our commit id
    bundle = Path(snapshot_download("kiln/tiny", revision="1.0/hf-bf16", endpoint=live, cache_dir=tmp_path / "c2"))
    assert sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()) == [
        "config.json",
        "model.safetensors",
        "tokenizer/tokenizer.json",
    ]
    assert (bundle / "model.safetensors").read_bytes() == WEIGHTS


def test_hf_hub_download_headers_and_immutable_commit(live: str, client: TestClient, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download

    response = httpx.head(f"{live}/tiny/resolve/prod%2Fhf-bf16/config.json")
    assert response.status_code == 200
    assert response.headers["X-Repo-Commit"] == _commit(client, "hf-bf16")
    assert response.headers["ETag"] == f'"{sha(CONFIG)}"' and response.headers["X-Linked-Size"] == str(len(CONFIG))
    assert not any(h.lower().startswith("x-xet") for h in response.headers)
    old_commit = response.headers["X-Repo-Commit"]

    # A new release behind prod: the channel revision moves, the old commit still serves the old bytes.
    make_release(client, version="2.0", planned=["hf-bf16"])
    publish(client, "hf-bf16", {"config.json": b'{"v": 2}'}, ["cpu"], version="2.0", quant="bf16")
    post_eval(client, "hf-bf16", "not_evaluated", version="2.0", reason="no evals in this test")
    seal(client, "2.0")
    assert promote(client, "2.0").status_code == 200
    new = hf_hub_download("tiny", "config.json", revision="prod/hf-bf16", endpoint=live, cache_dir=tmp_path)
    assert Path(new).read_bytes() == b'{"v": 2}'
    old = hf_hub_download("tiny", "config.json", revision=old_commit, endpoint=live, cache_dir=tmp_path / "o")
    assert Path(old).read_bytes() == CONFIG


def test_interrupted_download_resumes_with_range(live: str, seen_ranges: list[str], tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download("tiny", "model-q4.gguf", revision="prod/gguf-q4", endpoint=live, cache_dir=tmp_path)
    assert Path(path).read_bytes() == GGUF
    # The client kept the 10 MiB chunk it had written before the cut and asked for the rest only.
    assert seen_ranges == [f"bytes={10 * 1024 * 1024}-"]


def test_missing_things_map_to_the_client_errors(live: str, tmp_path: Path) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi(endpoint=live)
    assert api.file_exists("tiny", "model-q4.gguf", revision="prod/gguf-q4")
    assert not api.file_exists("tiny", "missing.gguf", revision="prod/gguf-q4")
    assert not api.file_exists("tiny", "model-q4.gguf", revision="prod/no-such-artifact")
    assert not api.file_exists("tiny", "model-q4.gguf", revision="staging/gguf-q4")  # no such channel
    with pytest.raises(RevisionNotFoundError):
        api.model_info("tiny", revision="9.9/gguf-q4")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("nope", revision="prod/gguf-q4")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("someone/tiny", revision="prod/gguf-q4")


def test_tree_listing_is_what_the_hub_returns(live: str, client: TestClient) -> None:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=live)
    entries = {e.path: e for e in api.list_repo_tree("tiny", revision="prod/hf-bf16", recursive=True)}
    assert set(entries) == {"tokenizer", "config.json", "model.safetensors", "tokenizer/tokenizer.json"}
    weights: Any = entries["model.safetensors"]
    assert weights.size == len(WEIGHTS) and weights.lfs.sha256 == sha(WEIGHTS) and len(weights.blob_id) == 40
    top = {e.path for e in api.list_repo_tree("tiny", revision="prod/hf-bf16")}
    assert top == {"tokenizer", "config.json", "model.safetensors"}
    info = api.model_info("tiny", revision="prod/hf-bf16")
    assert info.sha == _commit(client, "hf-bf16")
    assert sorted(s.rfilename for s in info.siblings or []) == sorted(entries.keys() - {"tokenizer"})


def test_a_tree_comes_a_page_at_a_time_as_the_hub_pages_it(live: str, client: TestClient) -> None:
    """At most `limit` entries (1,000 unless asked), the next page in a `Link` that huggingface_hub's
    `paginate` follows as given; a cursor naming no entry is refused."""
    url: str | None = "/api/models/tiny/tree/prod%2Fhf-bf16?recursive=true&limit=2"
    pages: list[list[str]] = []
    while url is not None:
        page = client.get(url)
        assert page.status_code == 200, page.text
        pages.append([e["path"] for e in page.json()])
        link = page.headers.get("link")
        url = link[1 : link.index(">")] if link else None
    assert pages == [["tokenizer", "config.json"], ["model.safetensors", "tokenizer/tokenizer.json"]]
    whole = client.get("/api/models/tiny/tree/prod%2Fhf-bf16?recursive=true")
    assert [e["path"] for e in whole.json()] == sum(pages, []) and "link" not in whole.headers
    unknown = client.get("/api/models/tiny/tree/prod%2Fhf-bf16?cursor=nowhere")
    assert unknown.status_code == 422 and unknown.json()["error"]["code"] == "PAGE_CURSOR_UNKNOWN"


@pytest.mark.parametrize(
    ("path", "status", "code", "hub_code"),
    [
        ("/api/models/tiny/revision/..%2F..%2Fetc", 400, "INVALID_REVISION", None),
        ("/api/models/tiny/revision/main", 400, "INVALID_REVISION", None),
        ("/tiny/resolve/prod%2Fgguf-q4/..%2Fhf-bf16%2Fconfig.json", 404, "ENTRY_NOT_FOUND", "EntryNotFound"),
        ("/tiny/resolve/prod%2Fgguf-q4/%2Fetc%2Fpasswd", 404, "ENTRY_NOT_FOUND", "EntryNotFound"),
        ("/tiny/resolve/" + "0" * 40 + "/model-q4.gguf", 404, "REVISION_NOT_FOUND", "RevisionNotFound"),
        ("/api/models/tiny/tree/prod%2Fhf-bf16/nowhere", 404, "ENTRY_NOT_FOUND", "EntryNotFound"),
    ],
)
def test_bad_revisions_and_paths_are_clear_4xx(
    live: str, path: str, status: int, code: str, hub_code: str | None
) -> None:
    response = httpx.get(live + path)
    assert_error(response, status, code)
    assert response.headers.get("X-Error-Code") == hub_code


def test_range_requests_on_resolve(live: str) -> None:
    url = f"{live}/tiny/resolve/prod%2Fgguf-q4/model-q4.gguf"
    part = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == GGUF[10:20]
    assert part.headers["Content-Range"] == f"bytes 10-19/{len(GGUF)}"
    assert httpx.get(url, headers={"Range": f"bytes={len(GGUF)}-"}).status_code == 416
