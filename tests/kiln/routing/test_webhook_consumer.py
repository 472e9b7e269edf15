"""examples/routing-webhook against a live registry on a loopback port: it takes only deliveries signed as the
registry signs them, and each change of the channel (a split's weights, a promotion) re-renders its files."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import pytest
import yaml
from fastapi import FastAPI
from starlette.testclient import TestClient

from tests.kiln.routing.kube_schema import assert_valid
from tests.registry.conftest import make_token
from tests.registry.helpers import promote, serve_in_thread
from tests.registry.s3_server import free_port

ROOT = Path(__file__).resolve().parents[3]
CONSUMER = ROOT / "examples/routing-webhook/consumer.py"
SECRET = "routing-webhook-test-secret"
EVENTS = ["channel.split", "channel.promote", "channel.promote.forced", "release.yank"]


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def weights(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("weight:")]


@pytest.fixture
def consumer(app: FastAPI, fleet: TestClient, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The registry served on a loopback port, and the consumer (its own process) rendering from it."""
    reader = make_token(app, ["read"], models=["llama"], name="routing-webhook")
    port = free_port()
    out = tmp_path / "routing"
    log = (tmp_path / "consumer.log").open("w")
    with serve_in_thread(app) as registry_port:
        process = subprocess.Popen(
            [sys.executable, str(CONSUMER), "--listen", f"127.0.0.1:{port}"]
            + ["--registry", f"http://127.0.0.1:{registry_port}", "--model", "llama", "--out-dir", str(out)]
            + ["--format", "gateway-api", "--format", "kserve", "--pool", "h100:8", "--pool", "mi300x:8"],
            env={**os.environ, "PYTHONPATH": str(ROOT), "KILN_TOKEN": reader, "KILN_WEBHOOK_SECRET": SECRET},
            stderr=log,
        )
        try:
            wait_for(lambda: "listening on" in (tmp_path / "consumer.log").read_text(), "the consumer to listen")
            yield f"http://127.0.0.1:{port}", out
        finally:
            process.terminate()
            process.wait(timeout=30)
            log.close()


def post(url: str, body: bytes, timestamp: str, signature: str) -> int:
    headers = {"X-Kiln-Timestamp": timestamp, "X-Kiln-Signature": signature, "Content-Type": "application/json"}
    return httpx2.post(url, content=body, headers=headers, timeout=10).status_code


def test_the_consumer_re_renders_when_the_split_changes(fleet: TestClient, consumer: tuple[str, Path]) -> None:
    url, out = consumer
    gateway, kserve = out / "llama-prod-gateway-api.yaml", out / "llama-prod-kserve.yaml"
    # Named one model: it renders the channel at once, 1.4.0 alone.
    wait_for(lambda: gateway.exists() and kserve.exists(), "the first render")
    assert weights(gateway.read_text()) == ["weight: 10000", "weight: 10000"]

    hook = fleet.post(
        "/v1/webhooks", json={"url": url + "/kiln", "events": EVENTS, "model_pattern": "llama", "secret": SECRET}
    )
    assert hook.status_code == 201, hook.text
    split = "/v1/models/llama/channels/prod/split"
    assert fleet.put(
        split, json={"weights": [{"version": "1.4.0", "weight": 95}, {"version": "1.5.0", "weight": 5}]}
    ).is_success
    wait_for(lambda: weights(gateway.read_text()) == ["weight: 9500", "weight: 500"] * 2, "the 95/5 render")
    wait_for(lambda: weights(kserve.read_text()) == ["weight: 95", "weight: 5"] * 2, "the 95/5 KServe render")
    first = {p: p.read_text() for p in (gateway, kserve)}

    assert fleet.put(
        split, json={"weights": [{"version": "1.4.0", "weight": 90}, {"version": "1.5.0", "weight": 10}]}
    ).is_success
    wait_for(lambda: weights(gateway.read_text()) == ["weight: 9000", "weight: 1000"] * 2, "the 90/10 render")
    wait_for(lambda: weights(kserve.read_text()) == ["weight: 90", "weight: 10"] * 2, "the 90/10 KServe render")
    for path, text in first.items():  # only the weights changed
        changed = [(a, b) for a, b in zip(text.splitlines(), path.read_text().splitlines(), strict=True) if a != b]
        assert len(changed) == 4 and all(a.strip().startswith("weight:") for a, _ in changed), changed
        for document in yaml.safe_load_all(path.read_text()):
            assert_valid(document)

    # Forged, stale or unsigned deliveries are refused before anything is read; the files stay as they are.
    body = json.dumps({"id": 10**9, "event": "channel.split", "model": "llama", "target": "llama/prod"}).encode()
    now = str(int(time.time()))
    forged = "sha256=" + hmac.new(b"not-the-secret", now.encode() + b"." + body, hashlib.sha256).hexdigest()
    stale = str(int(time.time()) - 3600)
    stale_signature = "sha256=" + hmac.new(SECRET.encode(), stale.encode() + b"." + body, hashlib.sha256).hexdigest()
    assert post(url, body, now, forged) == 401
    assert post(url, body, stale, stale_signature) == 401
    assert post(url, body, now, "") == 401

    # A promotion ends the split: one release, and KServe's services without a Splitter.
    before = kserve.read_text()
    assert promote(fleet, "1.5.0", model="llama").status_code == 200
    wait_for(lambda: weights(gateway.read_text()) == ["weight: 10000", "weight: 10000"], "the promotion's render")
    wait_for(lambda: kserve.read_text() != before and "kind: InferenceGraph" not in kserve.read_text(), "KServe's")
    assert "oci://" in kserve.read_text() and ":1.5.0-hf-bundle-fp8" in kserve.read_text()
    deliveries = fleet.get(f"/v1/webhooks/{hook.json()['id']}/deliveries").json()
    assert [d["event"] for d in deliveries] == ["channel.promote", "channel.split", "channel.split"]
    assert all(d["state"] == "delivered" for d in deliveries)
