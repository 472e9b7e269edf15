"""The event loop never waits on the database: a real server under hardware writes and resolves keeps it free.

Many nodes publishing their probed hardware (`PUT /v1/hardware/{name}`, each one bumping the routing
revision, so every resolve after it misses its caches) while routers resolve anonymously once froze the
server: resolve read the database on the event loop while writers waited on SQLite's lock, /healthz took
10 s and writes answered 503. Here the registry runs in its own process (`tests.registry.loop_watch`),
which reports every database call or file opened on its event loop's thread (none may, ever) and every
callback that holds the loop over 50 ms (none may during that load, where the machine is not running
more than its cores), on either database. A PUT also answers what it committed: a DELETE of the same SKU
landing before a read-back must not turn its 200 into a 404.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import free_port, make_release, post_eval, promote, publish, seal

ROOT = Path(__file__).resolve().parents[2]
THRESHOLD_S = 0.05
WRITERS, PUTS_EACH = 16, 12  # the reported reproduction: 16 concurrent full-admin PUTs
DELETERS, DELETES_EACH = 4, 12
RESOLVERS, RESOLVES_EACH = 16, 30
SKUS = [f"node-{i}" for i in range(4)]


def _seed(settings: RegistrySettings) -> tuple[str, dict[str, object]]:
    """A sealed release on prod that resolves on h100, an admin token, and h100's entry to write as new SKUs."""
    app = create_app(settings)
    token = make_token(app, ["admin"], name="loop-admin")
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
        make_release(client)
        publish(client, "gguf-q8", {"model.gguf": b"8" * 200}, ["cpu", "h100"], quant="q8_0")
        assert post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.01}).status_code in (200, 201)
        seal(client)
        assert promote(client, "1.0").status_code == 200
        entry = {k: v for k, v in client.get("/v1/hardware/h100").json().items() if k not in ("name", "source")}
    app.state.engine.dispose()
    return token, entry


@pytest.fixture
def watched(settings: RegistrySettings, tmp_path: Path) -> Iterator[tuple[str, str, dict[str, object], list[str]]]:
    """The seeded registry served by `loop_watch` in a subprocess: (base URL, admin token, an entry, its SLOW lines)."""
    local = settings.model_copy(update={"blob_url": (tmp_path / "blobs").as_uri()})  # the loop, not S3, is tested
    token, entry = _seed(local)
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KILN_REGISTRY_DATABASE_URL": str(local.database_url),
        "KILN_REGISTRY_DATA_DIR": str(local.data_dir),
        "KILN_REGISTRY_BLOB_URL": local.blob_url or "",
    }
    command = [sys.executable, "-m", "tests.registry.loop_watch", str(port), str(THRESHOLD_S)]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(server.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None, "".join(lines)
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the watched registry did not start:\n" + "".join(lines)
        time.sleep(0.1)
    try:
        yield base, token, entry, lines
    finally:
        server.terminate()
        server.wait(timeout=30)
        reader.join(timeout=10)


def _in_threads(count: int, work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_hardware_writes_and_resolves_never_hold_the_event_loop(
    watched: tuple[str, str, dict[str, object], list[str]],
) -> None:
    base, token, entry, lines = watched
    admin = {"Authorization": f"Bearer {token}"}
    statuses: Counter[tuple[str, int]] = Counter()
    slowest_health = 0.0

    def put(i: int) -> None:
        with httpx.Client(base_url=base, headers=admin, timeout=60) as c:
            for n in range(PUTS_EACH):
                sku = SKUS[(i + n) % len(SKUS)]
                response = c.put(f"/v1/hardware/{sku}", json={**entry, "memory_gib": 80 + n})
                statuses["put", response.status_code] += 1
                assert response.status_code == 200, response.text
                assert response.json()["name"] == sku and response.json()["memory_gib"] == 80 + n

    def delete(i: int) -> None:
        with httpx.Client(base_url=base, headers=admin, timeout=60) as c:
            for n in range(DELETES_EACH):
                response = c.delete(f"/v1/hardware/{SKUS[(i + n) % len(SKUS)]}")
                statuses["delete", response.status_code] += 1
                assert response.status_code in (204, 404), response.text

    def resolve(i: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as c:  # anonymous, as routers ask
            for n in range(RESOLVES_EACH):
                params: dict[str, str | int] = {"model": "tiny", "hardware": "h100", "context": 1024 + i * 64 + n}
                response = c.get("/v1/resolve", params=params)
                statuses["resolve", response.status_code] += 1
                assert response.status_code == 200, response.text

    def health(_: int) -> None:
        nonlocal slowest_health
        with httpx.Client(base_url=base, timeout=60) as c:
            while not done.is_set():
                started = time.monotonic()
                assert c.get("/healthz").status_code == 200
                slowest_health = max(slowest_health, time.monotonic() - started)
                time.sleep(0.02)

    # Warm up: first calls import and compile what later ones reuse (FastAPI reads each endpoint's source
    # file once, for its error messages); that is not the loop waiting.
    _in_threads(2, put)
    _in_threads(1, delete)
    _in_threads(2, resolve)
    done = threading.Event()
    poller = threading.Thread(target=health, args=(0,))
    started = time.time()
    poller.start()
    try:
        _in_threads(
            WRITERS + DELETERS + RESOLVERS,
            lambda i: put(i) if i < WRITERS else delete(i) if i < WRITERS + DELETERS else resolve(i),
        )
    finally:
        done.set()
        poller.join()
    ended = time.time()
    time.sleep(0.2)  # the last report, if any, printed before the server is stopped
    blocking = [line for line in list(lines) if line.startswith("BLOCKING ") and float(line.split()[1]) >= started]
    slow = [line for line in list(lines) if line.startswith("SLOW ") and started <= float(line.split()[1]) <= ended]
    assert statuses["put", 200] == WRITERS * PUTS_EACH + 2 * PUTS_EACH
    assert statuses["resolve", 200] == RESOLVERS * RESOLVES_EACH + 2 * RESOLVES_EACH
    assert not blocking, "the event loop's thread waited on the database or the disk:\n" + "".join(blocking)
    # Held time is only meaningful where the server gets the CPU it asks for: on a machine running more
    # than its cores (a shared 2-core box), a thread holding the interpreter lock may be descheduled.
    if os.getloadavg()[0] < len(os.sched_getaffinity(0)):
        assert not slow, f"callbacks held the event loop over {THRESHOLD_S * 1000:.0f} ms:\n" + "".join(slow)
        assert slowest_health < 1.0, f"/healthz took {slowest_health:.2f} s"
