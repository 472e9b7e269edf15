"""No request body stalls the server: `/healthz` answers promptly while anonymous clients send the
costliest bodies they can, each at its route's limit, to the routes that take bodies.

The server is `python -m kiln.registry.server` (what `kiln serve` runs: uvicorn with uvloop and httptools, one
worker) in its own process on a free loopback port; the attacking clients run in another, so neither
they nor the server share the interpreter of the thread that times `/healthz`.
"""

from __future__ import annotations

import gc
import http.client
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kiln.registry.api.boundary import JSON_BODY_BYTES, ROUTE_BODY_LIMITS, body_limit
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error
from tests.registry.s3_server import free_port

ROOT = Path(__file__).resolve().parents[2]
HEALTH_WITHIN = 0.1  # seconds, every answer
ATTACK_SECONDS = 6.0
# Routes that take bodies, the largest limits among them; anonymous, so each is refused in the end.
ROUTES = [
    ("POST", "/v1/models"),
    ("POST", "/v1/tokens"),
    ("PUT", "/v1/hardware/h100"),
    ("POST", "/v1/models/m/channels/prod"),
    ("POST", "/v1/models/m/releases/1.0/artifacts/gguf-q4/evals"),
    ("POST", "/v1/models/m/releases"),
    ("POST", "/v1/models/m/releases/1.0/artifacts"),
    ("POST", "/v1/nowhere"),
]


def worst_bodies(size: int) -> list[bytes]:
    """The costliest JSON bodies of exactly `size` bytes we know: an unterminated string of escaped quotes
    (a scanner that re-reads the rest of the text from each quote is quadratic on it), and an object of
    as many tiny keys as fit (the most work per byte for a strict parser that checks every key)."""
    quotes = (b'"' + b'\\"' * size)[:size]
    keys, total, i = [], 2, 0
    while total + len(b'"%x":0,' % i) <= size:
        keys.append(b'"%x":0' % i)
        total += len(keys[-1]) + 1
        i += 1
    tiny_keys = b"{" + b",".join(keys) + b"}"
    return [quotes, tiny_keys + b" " * (size - len(tiny_keys))]


def _anonymous_limit(method: str, path: str) -> int:
    """The most of a body the registry reads from an anonymous client on `path`."""
    limit, large_scope = body_limit(method, path, RegistrySettings.model_fields["max_body_bytes"].default)
    return JSON_BODY_BYTES if large_scope is not None else limit


@pytest.fixture
def server(tmp_path: Path) -> Iterator[int]:
    """`python -m kiln.registry.server` of an embedded registry in `tmp_path`, until it answers /healthz."""
    port = free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below, after the process
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln.registry.server", "--port", str(port), "--log-level", "warning"],
        env={**os.environ, "KILN_REGISTRY_DATA_DIR": str(tmp_path / "data")},
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the registry server did not start"
            try:
                if _get(port, "/healthz") == 200:
                    break
            except OSError:
                time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _get(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def attack(port: int, seconds: float, answers: Any) -> None:
    """Two threads sending every worst body to every route, anonymously, for `seconds`; puts on `answers`
    how many bodies were answered and what went wrong. Run in a process of its own: the clients' threads
    would otherwise delay the health poll's own thread here, not the server."""
    attacks = [(method, path, body) for method, path in ROUTES for body in worst_bodies(_anonymous_limit(method, path))]
    stop_at = time.monotonic() + seconds
    answered: list[int] = []
    problems: list[str] = []

    def send(offset: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        i = offset
        while time.monotonic() < stop_at:
            method, path, body = attacks[i % len(attacks)]
            i += 1
            try:
                connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                answer = response.read()
            except OSError as e:
                problems.append(f"{method} {path}: {e!r}")
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                continue
            # Read whole and parsed: refused as malformed (422), or as anonymous or unknown (401, 404, 405).
            code = json.loads(answer).get("error", {}).get("code") if response.status < 500 else None
            if response.status == 413 or code is None or (response.status == 422 and code != "INVALID_JSON"):
                problems.append(f"{method} {path}: {response.status} {answer[:200]!r}")
            answered.append(len(body))
        connection.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    answers.put((len(answered), sum(answered), len(attacks), problems[:5]))


def _poll_health(port: int, seconds: float) -> tuple[list[float], list[str]]:
    """`GET /healthz` every 20 ms for `seconds`: each answer's time, and what went wrong. The collector is
    off meanwhile, so that its pauses in this process are not counted as the server's."""
    latencies: list[float] = []
    problems: list[str] = []
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    gc.disable()
    try:
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            try:
                connection.request("GET", "/healthz")
                response = connection.getresponse()
                response.read()
                assert response.status == 200
            except (OSError, AssertionError) as e:
                problems.append(f"/healthz: {e!r}")
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    finally:
        gc.enable()
        connection.close()
    return latencies, problems


def test_health_answers_promptly_while_anonymous_clients_send_the_worst_bodies(server: int) -> None:
    """Two windows of attack at most: every answer of one of them within HEALTH_WITHIN (a machine shared
    with other work can stall any process once in a while; a stalled server stalls both)."""
    context = multiprocessing.get_context("spawn")
    slowest: list[str] = []
    for _ in range(2):
        answers = context.Queue()
        attacker = context.Process(target=attack, args=(server, ATTACK_SECONDS + 2, answers))
        attacker.start()
        try:
            time.sleep(2)  # the attacker's process starting
            latencies, problems = _poll_health(server, ATTACK_SECONDS)
            answered, size, kinds, attack_problems = answers.get(timeout=300)
        finally:
            attacker.join(timeout=300)
            if attacker.is_alive():
                attacker.kill()
        assert not problems + attack_problems, problems + attack_problems
        assert answered >= kinds, f"only {answered} bodies were answered in {ATTACK_SECONDS} s"
        if max(latencies) < HEALTH_WITHIN:
            return
        slowest.append(
            f"/healthz took up to {max(latencies) * 1000:.0f} ms (median "
            f"{sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms) while {answered} bodies ({size / 2**20:.0f} MiB)"
            " were refused"
        )
    pytest.fail("; ".join(slowest))


# --- each route takes bodies up to its own limit ------------------------------------------------------------


def test_routes_refuse_bodies_over_their_own_limit_before_parsing(client: TestClient) -> None:
    headers = {"Content-Type": "application/json"}
    small = json.dumps({"name": "m", "description": "x" * JSON_BODY_BYTES}).encode()
    for method, path in [("POST", "/v1/models"), ("PUT", "/v1/hardware/h100"), ("POST", "/v1/nowhere")]:
        error = assert_error(client.request(method, path, content=small, headers=headers), 413, "PAYLOAD_TOO_LARGE")
        assert error["details"] == {"limit": JSON_BODY_BYTES}
    # Refused on its size alone: a body that is not even JSON gets the same answer.
    assert_error(client.post("/v1/models", content=b"[" * (JSON_BODY_BYTES + 1)), 413, "PAYLOAD_TOO_LARGE")
    assert_error(client.post("/v1/models", content=b"[" * JSON_BODY_BYTES), 422, "INVALID_JSON")
    # A manifest takes more: this one is read, and refused for what it says.
    manifest = {"name": "gguf-q4", "target": "gguf", "format": "gguf-v3", "quant": "q4_k_m", "hardware": ["cpu"]}
    files = [{"path": f"shard-{i:05}.gguf", "sha256": "0" * 64, "size": 1} for i in range(5000)]
    body = json.dumps({**manifest, "files": files}).encode()
    assert JSON_BODY_BYTES < len(body) < 4 * 1024**2
    answer = client.post("/v1/models/nobody/releases/1.0/artifacts", content=body, headers=headers)
    assert answer.status_code == 404, answer.text
    # Past 64 KiB, only from a caller whose token may publish: refused before the rest is read.
    url = "/v1/models/nobody/releases/1.0/artifacts"
    anonymous = TestClient(client.app)
    assert_error(anonymous.post(url, content=body, headers=headers), 401, "UNAUTHORIZED")
    unknown = {**headers, "Authorization": "Bearer kiln_unknown"}
    assert_error(anonymous.post(url, content=body, headers=unknown), 401, "INVALID_TOKEN")
    reader = {**headers, "Authorization": f"Bearer {make_token(client.app, ['read'])}"}  # type: ignore[arg-type]
    assert_error(anonymous.post(url, content=body, headers=reader), 403, "FORBIDDEN")
    # Up to 64 KiB, from anyone: read and parsed (a malformed one is refused as such).
    small_manifest = json.dumps({**manifest, "files": files[:10]}).encode()
    assert_error(anonymous.post(url, content=small_manifest[:-1], headers=headers), 422, "INVALID_JSON")
    assert_error(anonymous.post(url, content=small_manifest, headers=headers), 401, "UNAUTHORIZED")


def test_every_route_limit_names_a_route_of_the_app(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    routes = {(method.upper(), path) for path, operations in paths.items() for method in operations}
    assert set(ROUTE_BODY_LIMITS) <= routes, set(ROUTE_BODY_LIMITS) - routes
