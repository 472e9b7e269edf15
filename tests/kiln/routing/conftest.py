"""A registry for routing renders: the registry tests' databases and blob stores (SQLite with local disk,
PostgreSQL with S3), serving model cars, sending webhooks quickly to loopback receivers, and seeded with
`llama` releases 1.4.0 and 1.5.0 for H100 (an FP8 hf-bundle), MI300X (a bf16 rocm-bundle), CPUs and Apple
GPUs (a GGUF) and B200 (a TensorRT engine, which runs at TP 1 only)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.oci.base_image import write_busybox_base
from kiln.registry.settings import RegistrySettings
from tests.registry import conftest as registry_fixtures
from tests.registry.helpers import STAND_IN_EXECUTABLE, make_release, post_eval, promote, publish, seal

# The registry tests' databases and deployments, and their admin token.
sqlite_template = registry_fixtures.sqlite_template
postgres_url = registry_fixtures.postgres_url
postgres_engine = registry_fixtures.postgres_engine
db_url = registry_fixtures.db_url
settings = registry_fixtures.settings
admin_token = registry_fixtures.admin_token

MODEL = "llama"
VERSIONS = ("1.4.0", "1.5.0")
# Senders that poll often, to receivers on loopback (as tests/registry/test_webhooks.py does).
FAST_DELIVERY = {
    "webhook_poll_interval_s": 0.05,
    "webhook_backoff_base_s": 0.05,
    "webhook_backoff_max_s": 0.2,
    "webhook_max_attempts": 5,
    "webhook_timeout_s": 10.0,
    "webhook_allow": ["127.0.0.1"],
}
# (artifact, target, format, quant, hardware, eval runtime)
ARTIFACTS = (
    ("hf-bundle-fp8", "hf-bundle", "safetensors", "fp8", ["h100"], "vllm"),
    ("rocm-bundle-bf16", "rocm-bundle", "safetensors", "bf16", ["mi300x"], "vllm"),
    ("gguf-q8_0", "gguf", "gguf-v3", "q8_0", ["cpu", "apple-m2"], "llama.cpp"),
    ("trtllm-engine-fp8-b200", "trtllm", "trtllm-engine", "fp8", ["b200"], "tensorrt_llm@b200"),
)


@pytest.fixture(scope="session")
def base_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model-car base image (a stand-in executable: the registry serves its bytes, nothing runs it here)."""
    layout = tmp_path_factory.mktemp("modelcar-base")
    binary = layout.parent / "stand-in-busybox"
    binary.write_bytes(STAND_IN_EXECUTABLE)
    write_busybox_base(binary, layout)
    return layout


@pytest.fixture
def app(settings: RegistrySettings, base_layout: Path) -> Iterator[FastAPI]:
    app = create_app(settings.model_copy(update={"modelcar_base": base_layout, **FAST_DELIVERY}))
    yield app
    app.state.engine.dispose()


@pytest.fixture
def client(app: FastAPI, admin_token: str) -> Iterator[TestClient]:
    with TestClient(app, headers={"Authorization": f"Bearer {admin_token}"}) as c:
        yield c


def seed_release(client: TestClient, version: str) -> None:
    """`llama@version` with the three artifacts, each evaluated as passed, sealed."""
    make_release(client, model=MODEL, version=version, planned=[a[0] for a in ARTIFACTS])
    for name, target, format, quant, hardware, runtime in ARTIFACTS:
        files = {"config.json": b'{"release": "%s"}' % version.encode(), f"{name}.bin": f"{name} {version}".encode()}
        publish(client, name, files, hardware, model=MODEL, version=version, target=target, format=format, quant=quant)
        assert post_eval(client, name, "passed", runtime=runtime, model=MODEL, version=version).is_success
    seal(client, version, MODEL)


@pytest.fixture
def fleet(client: TestClient) -> TestClient:
    """Both releases sealed, 1.4.0 promoted to prod."""
    for version in VERSIONS:
        seed_release(client, version)
    assert promote(client, "1.4.0", model=MODEL).status_code == 200
    return client
