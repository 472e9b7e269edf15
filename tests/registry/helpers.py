"""Small builders for registry tests: upload bytes, publish releases and artifacts through the API."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.settings import RegistrySettings
from kiln.storage.s3 import make_s3_client, parse_s3_url
from tests.registry.s3_server import free_port

LLAMA_CONFIG = {  # Llama-3-8B-like: 128 KiB of KV cache per token
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "vocab_size": 128256,
}
SOURCE_DIGEST = "a" * 64


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stored_blob_objects(settings: RegistrySettings) -> list[str]:
    """Everything the registry's blob store holds: files on disk, or S3 objects and unfinished uploads."""
    url = settings.effective_blob_url()
    if url.startswith("file://"):
        root = Path(url.removeprefix("file://"))
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    bucket, prefix = parse_s3_url(url)
    s3 = make_s3_client(settings.s3_endpoint_url)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    uploads = [
        f"(unfinished) {u['Key']}" for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    ]
    return sorted(keys + uploads)


# A static 64-bit x86-64 ELF header and nothing to run: a model-car base where no busybox is installed
# (the registry serves a base image's bytes as they are; only running the image needs a real one).
STAND_IN_EXECUTABLE = b"\x7fELF\x02\x01" + bytes(12) + (62).to_bytes(2, "little") + bytes(100)


def overwrite_stored_blob(store: Any, sha256: str, data: bytes) -> None:
    """Replace a stored blob's bytes behind the registry's back (a disk or bucket going bad), in either store."""
    from kiln.storage.local import LocalBlobStore
    from kiln.storage.s3 import S3BlobStore

    if isinstance(store, LocalBlobStore):
        store.path(sha256).write_bytes(data)
    else:
        assert isinstance(store, S3BlobStore)
        store.client.put_object(Bucket=store.bucket, Key=store.key(sha256), Body=data)


def assert_error(response: Any, status: int, code: str) -> dict[str, Any]:
    """Check the error shape and return `error`."""
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == code, error
    assert error["message"]
    return error


def upload(client: TestClient, data: bytes) -> str:
    digest = sha(data)
    response = client.put(f"/v1/blobs/{digest}", content=data)
    assert response.status_code in (200, 201), response.text
    return digest


def make_release(
    client: TestClient,
    model: str = "tiny",
    version: str = "1.0",
    model_config: dict[str, Any] | None = None,
    planned: tuple[str, ...] | list[str] = ("gguf-q8",),
    lineage: dict[str, Any] | None = None,
) -> None:
    """Open `model@version` planning the artifacts `planned`."""
    assert client.post("/v1/models", json={"name": model}).status_code in (200, 201)
    response = client.post(
        f"/v1/models/{model}/releases",
        json={
            "version": version,
            "source_digest": SOURCE_DIGEST,
            "planned_artifacts": list(planned),
            "lineage": {"source": "hf:tiny"} if lineage is None else lineage,
            "model_config": LLAMA_CONFIG if model_config is None else model_config,
        },
    )
    assert response.status_code in (200, 201), response.text


def seal(client: TestClient, version: str = "1.0", model: str = "tiny") -> dict[str, Any]:
    """Seal `model@version` (every planned artifact must be published with an eval)."""
    response = client.post(f"/v1/models/{model}/releases/{version}/seal")
    assert response.status_code in (200, 201), response.text
    result: dict[str, Any] = response.json()
    assert result["status"] == "sealed"
    return result


def manifest(name: str, files: dict[str, bytes], hardware: list[str], quant: str = "q8_0", **extra: Any) -> dict:
    return {
        "name": name,
        "target": extra.pop("target", "gguf"),
        "format": extra.pop("format", "gguf-v3"),
        "quant": quant,
        "hardware": hardware,
        "unsupported": extra.pop("unsupported", {}),
        "runtime": extra.pop("runtime", {"llama.cpp": ">=b4000"}),
        "files": [{"path": p, "sha256": sha(d), "size": len(d)} for p, d in files.items()],
        "provenance": extra.pop("provenance", {"host": "test"}),
    }


def publish(
    client: TestClient,
    name: str,
    files: dict[str, bytes],
    hardware: list[str],
    model: str = "tiny",
    version: str = "1.0",
    **extra: Any,
) -> dict[str, Any]:
    for data in files.values():
        upload(client, data)
    response = client.post(
        f"/v1/models/{model}/releases/{version}/artifacts", json=manifest(name, files, hardware, **extra)
    )
    assert response.status_code in (200, 201), response.text
    result: dict[str, Any] = response.json()
    return result


# An eval's metrics (`core.evals.EvalMetrics`) where a test cares only about a few: `eval_metrics(kl=0.3)`.
METRICS: dict[str, Any] = {
    "tokens": 255, "windows": 1, "vocab_size": 512, "ppl_ref": 10.0, "ppl": 10.01, "ppl_change": 0.001,
    "kl": 0.001, "kl_error": 0.0, "kl_max": 0.02, "top1": 0.99, "greedy_tokens": 32, "greedy_match": None,
    "greedy_match_total": None,
}  # fmt: skip


def eval_metrics(**values: Any) -> dict[str, Any]:
    """Whole metrics as JSON: `METRICS` with `values` in their place."""
    return METRICS | values


def post_eval(
    client: TestClient,
    artifact: str,
    status: str,
    runtime: str = "llama.cpp",
    model: str = "tiny",
    version: str = "1.0",
    **fields: Any,
) -> Any:
    """POST one runtime's eval; `metrics`, when given, names only the metrics the test is about
    (`eval_metrics` fills in the rest)."""
    if "metrics" in fields:
        fields["metrics"] = eval_metrics(**fields["metrics"])
    return client.post(
        f"/v1/models/{model}/releases/{version}/artifacts/{artifact}/evals",
        json={"runtime": runtime, "status": status, **fields},
    )


def promote(client: TestClient, version: str = "1.0", channel: str = "prod", model: str = "tiny", **fields: Any) -> Any:
    return client.post(f"/v1/models/{model}/channels/{channel}", json={"version": version, **fields})


@contextlib.contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[int]:
    """Serve `app` with uvicorn on a free 127.0.0.1 port in a background thread; yields the port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "registry server did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def declare_blob(app: FastAPI, size: int, label: str) -> str:
    """Record a blob of `size` bytes as stored, without its bytes, and return its digest.

    For tests of what sizes decide (replica fit, TP, cost): a 70B checkpoint's 141 GB cannot be
    uploaded in a test. Publishing checks only that the blob is recorded with the manifest's size,
    so an artifact can be published from declared blobs; its files cannot be downloaded."""
    from kiln.registry.blobs.models import Blob

    digest = sha(f"declared blob {label} of {size} bytes".encode())
    with app.state.session_factory() as session:
        if session.get(Blob, digest) is None:
            session.add(Blob(sha256=digest, size=size))
            session.commit()
    return digest


def publish_declared(
    client: TestClient,
    app: FastAPI,
    name: str,
    size: int,
    hardware: list[str],
    model: str = "tiny",
    version: str = "1.0",
    **extra: Any,
) -> dict[str, Any]:
    """Publish artifact `name` as one file of `size` bytes from a declared blob (`declare_blob`)."""
    body = manifest(name, {}, hardware, **extra)
    digest = declare_blob(app, size, f"{model}@{version}/{name}")
    body["files"] = [{"path": "model.safetensors", "sha256": digest, "size": size}]
    response = client.post(f"/v1/models/{model}/releases/{version}/artifacts", json=body)
    assert response.status_code in (200, 201), response.text
    result: dict[str, Any] = response.json()
    return result
