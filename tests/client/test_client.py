"""RegistryClient, embedded (in process) and against a real uvicorn server on a loopback port."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import uvicorn
from fastapi import FastAPI
from sqlalchemy import insert

from kiln.client import RegistryClient
from kiln.core import errors
from kiln.core.evals import EvalMetrics, PublishedEval
from kiln.core.manifest import ArtifactManifest, FileEntry
from kiln.eval.gates import gate_for
from kiln.eval.report import EvalReport, judged
from kiln.registry.app import create_app
from kiln.registry.models.models import Model
from kiln.registry.paging import PAGE_LIMIT
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import LLAMA_CONFIG, SOURCE_DIGEST, eval_metrics

METRICS = EvalMetrics.model_validate(eval_metrics())


def report_of(kl: float) -> EvalReport:
    """A passed llama.cpp report of a q4_0 GGUF with mean KL `kl`."""
    metrics = METRICS.model_copy(update={"kl": kl})
    return judged(metrics, gate_for("q4_0"), runtime="llama.cpp", runtime_version="llama-cpp-python 0.3.36")


@pytest.fixture(scope="module")
def server_app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    return create_app(RegistrySettings(data_dir=tmp_path_factory.mktemp("served")))


@pytest.fixture(scope="module")
def server_url(server_app: FastAPI) -> Iterator[str]:
    """A real registry server (uvicorn with uvloop + httptools, as in production) on a free port."""
    app = server_app
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, loop="uvloop", http="httptools", ws="none", lifespan="on", log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "registry server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=20)
    sock.close()


def write_artifact(root: Path, files: dict[str, bytes]) -> ArtifactManifest:
    entries = []
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
        entries.append(FileEntry(path=path, sha256=hashlib.sha256(data).hexdigest(), size=len(data)))
    return ArtifactManifest(
        name="gguf-q8", target="gguf", format="gguf-v3", quant="q8_0", hardware=["cpu", "h100"], files=entries
    )


def publish_flow(client: RegistryClient, root: Path, model: str) -> ArtifactManifest:
    files = {"model.gguf": os.urandom(3 * 1024 * 1024 + 5), "tokenizer/tokenizer.json": b"{}"}
    manifest = write_artifact(root, files)
    assert client.ensure_model(model, "a test model").name == model
    client.ensure_model(model)  # exists: fine
    client.create_release(model, "1.0", SOURCE_DIGEST, ["gguf-q8"], {"hf": "x"}, LLAMA_CONFIG)
    client.create_release(model, "1.0", SOURCE_DIGEST, ["gguf-q8"], {"hf": "x"}, LLAMA_CONFIG)  # idempotent
    assert [r.status for r in client.list_releases(model)] == ["open"]
    published = client.publish_artifact(model, "1.0", manifest, files_root=root)
    assert published.manifest_digest == manifest.content_digest()
    assert client.publish_artifact(model, "1.0", manifest).manifest_digest == manifest.content_digest()
    report = judged(METRICS, gate_for("q8_0"), runtime="llama.cpp", runtime_version="llama-cpp-python 0.3.36")
    posted = PublishedEval.of_report("llama.cpp", report)
    recorded = client.post_eval(model, "1.0", "gguf-q8", posted)
    assert client.post_eval(model, "1.0", "gguf-q8", posted) == recorded  # the same result again: as is
    # What went in comes back, typed: the report's metrics and gate, its verdict and runtime version.
    assert recorded.model_dump(exclude={"created_at"}) == posted.model_dump()
    assert (recorded.metrics, recorded.gates, recorded.status) == (report.metrics, report.gate, "passed")
    assert client.artifact_evals(model, "1.0", "gguf-q8") == [recorded]
    assert client.seal_release(model, "1.0").status == "sealed"
    assert client.seal_release(model, "1.0").status == "sealed"  # idempotent
    channel = client.promote(model, "1.0", "prod", actor="ci")
    assert channel.version == "1.0"
    release = client.get_release(model, "1.0")
    assert release.artifacts[0].eval_status == "passed"
    assert release.artifacts[0].evals[0].runtime_version == "llama-cpp-python 0.3.36"
    return manifest


def test_client_against_a_real_server(server_url: str, server_app: FastAPI, tmp_path: Path) -> None:
    with RegistryClient.connect(server_url) as anonymous, pytest.raises(errors.Unauthorized):
        anonymous.ensure_model("served-model")
    with RegistryClient.connect(server_url, token=make_token(server_app, ["publish", "promote"])) as client:
        manifest = publish_flow(client, tmp_path, "served-model")
        answer = client.resolve("served-model", "h100")
        assert answer.artifact.name == "gguf-q8"
        upload = client.upload_blob(tmp_path / "model.gguf")
        assert upload.uploaded is False and upload.size == manifest.files[0].size
    url = next(f.url for f in answer.artifact.files if f.path == "model.gguf")
    assert url.startswith(server_url + "/v1/models/served-model/releases/1.0/artifacts/gguf-q8/files/")
    data = (tmp_path / "model.gguf").read_bytes()
    with httpx2.Client() as http:
        assert http.get(url).content == data
        part = http.get(url, headers={"Range": "bytes=1000-1999"})
        assert part.status_code == 206 and part.content == data[1000:2000]
        assert http.get(f"{server_url}/healthz").json()["status"] == "ok"


def test_client_raises_kiln_errors(
    server_url: str, server_app: FastAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_TOKEN", make_token(server_app, ["admin"]))  # how the CLI passes it
    with RegistryClient.connect(server_url) as client:
        client.ensure_model("errors-model")
        with pytest.raises(errors.NotFound) as not_found:
            client.get_release("errors-model", "9.9")
        assert not_found.value.code == "NOT_FOUND" and "errors-model@9.9" in not_found.value.message
        client.create_release("errors-model", "1.0", SOURCE_DIGEST, ["gguf-q8"])
        with pytest.raises(errors.Conflict) as conflict:
            client.create_release("errors-model", "1.0", "b" * 64, ["gguf-q8"])
        assert conflict.value.details["http_status"] == 409
        manifest = write_artifact(tmp_path, {"w.bin": b"weights"})
        with pytest.raises(errors.InvalidInput) as missing:
            client.publish_artifact("errors-model", "1.0", manifest)
        assert missing.value.code == "BLOB_MISSING"
        client.publish_artifact("errors-model", "1.0", manifest, files_root=tmp_path)
        with pytest.raises(errors.Conflict) as incomplete:
            client.seal_release("errors-model", "1.0")
        assert incomplete.value.code == "RELEASE_INCOMPLETE" and incomplete.value.details["unevaluated"] == ["gguf-q8"]
        failed = judged(METRICS, gate_for("f32"), runtime="llama.cpp", runtime_version="llama-cpp-python 0.3.36")
        assert client.post_eval("errors-model", "1.0", "gguf-q8", PublishedEval.of_report("llama.cpp", failed)).reason
        with pytest.raises(errors.Conflict):  # eval results are immutable
            client.post_eval("errors-model", "1.0", "gguf-q8", PublishedEval.of_report("llama.cpp", report_of(0.02)))
        client.seal_release("errors-model", "1.0")
        with pytest.raises(errors.GateFailed) as gate:
            client.promote("errors-model", "1.0", "prod")
        assert gate.value.code == "EVAL_GATE_FAILED"
        with pytest.raises(errors.InvalidInput):
            client.promote("errors-model", "1.0", "prod", force=True)
        client.promote("errors-model", "1.0", "prod", force=True, reason="known issue", actor="alice")
        with pytest.raises(errors.UnknownName):
            client.resolve("errors-model", "no-such-gpu")
        with pytest.raises(errors.NotFound) as nothing:
            client.resolve("errors-model", "cpu")
        assert nothing.value.code == "NO_COMPATIBLE_ARTIFACT"
        (tmp_path / "w.bin").write_bytes(b"changed")
        with pytest.raises(errors.DigestMismatch):
            client.publish_artifact("errors-model", "1.0", manifest, files_root=tmp_path)


def test_client_follows_a_real_servers_pages(server_url: str, server_app: FastAPI) -> None:
    """Over HTTP, a listing's `Link` is followed to the end: every model once, in order (and through the
    embedded client, the same code: test_api_paging)."""
    names = [f"paged-{i:04d}" for i in range(PAGE_LIMIT * 2 + 3)]
    with server_app.state.session_factory() as session:
        session.execute(insert(Model), [{"name": n, "description": ""} for n in names])
        session.commit()
    with RegistryClient.connect(server_url, token=make_token(server_app, ["read"])) as client:
        listed = [m.name for m in client.list_models()]
    assert [n for n in listed if n.startswith("paged-")] == names and listed == sorted(listed)


def test_unreachable_server_is_unavailable() -> None:
    with RegistryClient.connect("http://127.0.0.1:1") as client, pytest.raises(errors.Unavailable):
        client.ensure_model("m")


def test_embedded_client(tmp_path: Path) -> None:
    registry_dir = tmp_path / "registry"
    with RegistryClient.connect(registry_dir) as client:
        publish_flow(client, tmp_path, "embedded-model")
        assert client.resolve("embedded-model", "cpu", context=1024).artifact.name == "gguf-q8"
    assert (registry_dir / "registry.db").is_file()
    with RegistryClient.connect(str(registry_dir)) as client:  # a second process would see the same
        assert client.get_release("embedded-model", "1.0").version == "1.0"
        with pytest.raises(errors.NotFound):
            client.resolve("embedded-model", "cpu", channel="staging")


def test_embedded_upload_is_streamed(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(12):
            f.write(os.urandom(8 * 1024 * 1024))  # 96 MiB
    with RegistryClient.connect(tmp_path / "registry") as client:
        tracemalloc.start()
        try:
            upload = client.upload_blob(big)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert upload.uploaded and upload.size == 96 * 1024 * 1024
        assert client.blob_exists(upload.sha256)
    assert peak < 48 * 1024 * 1024, f"upload peaked at {peak / 2**20:.0f} MiB for a 96 MiB file"
