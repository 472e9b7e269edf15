"""Operations: liveness, readiness, request ids, Prometheus metrics, JSON logs, the settings file, and
503 + Retry-After while a real PostgreSQL server is down, recovering without a restart."""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry import migrate
from kiln.registry.app import create_app
from kiln.registry.ops.logs import JsonFormatter
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error, make_release, publish, sha

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def test_health_readiness_and_request_ids(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "checks": {}}
    ready = client.get("/readyz").json()
    assert ready == {"status": "ready", "checks": {"database": "ok", "blob_store": "ok"}}
    given = client.get("/v1/models", headers={"X-Request-ID": "ci-run-42"})
    assert given.headers["X-Request-ID"] == "ci-run-42"
    made = client.get("/v1/models", headers={"X-Request-ID": "bad id with spaces"}).headers["X-Request-ID"]
    assert len(made) == 32 and made != client.get("/v1/models").headers["X-Request-ID"]


def test_metrics_count_requests_bytes_and_publishes(client: TestClient) -> None:
    make_release(client, planned=["gguf-q4"])
    publish(client, "gguf-q4", {"model.gguf": b"m" * 1000}, ["cpu"])
    publish(client, "gguf-q4", {"model.gguf": b"m" * 1000}, ["cpu"])  # identical again: not a new publish
    assert client.get(f"/v1/blobs/{sha(b'm' * 1000)}").content == b"m" * 1000
    text = client.get("/metrics").text
    assert 'kiln_artifact_publishes_total{target="gguf"} 1.0' in text
    assert 'kiln_http_requests_total{method="GET",route="/v1/blobs/{sha256}",status="200"} 1.0' in text
    served = re.search(r'kiln_http_response_bytes_total\{route="/v1/blobs/\{sha256\}"\} ([0-9.e+]+)', text)
    assert served is not None and float(served.group(1)) >= 1000  # the download, plus the upload answers
    assert 'kiln_http_request_duration_seconds_count{method="POST",route="/v1/models"}' in text


def test_access_log_is_one_json_line_per_request(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kiln.registry.access"):
        client.get("/v1/models/nope", headers={"X-Request-ID": "req-1"})
    (record,) = [r for r in caplog.records if r.name == "kiln.registry.access"]
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "req-1" and line["status"] == 404 and line["route"] == "/v1/models/{model}"
    assert line["level"] == "info" and line["time"].endswith("Z") and line["duration_ms"] >= 0


def test_access_lines_are_the_formatter_s_lines() -> None:
    """`kiln serve`'s access handler writes, for each request, the line `JsonFormatter` writes for the same
    fields, whatever the path holds (quotes, backslashes, control characters, non-ASCII)."""
    import io

    from kiln.registry.ops.logs import AccessLineHandler, access_fields

    paths = ["/v1/resolve", '/v1/models/"quoted"\\back', "/v1/\x00\x1f\u2028caf\u00e9/\U0001f600", ""]
    entries = [
        (1_790_000_000.0 + i * 0.0004, f"r-{i}", "GET", path, "unmatched", 404, i * 7, i * 0.0123456, "::1")
        for i, path in enumerate(paths)
    ]
    stream = io.StringIO()
    handler = AccessLineHandler(stream)
    handler.write_lines(entries)
    formatter = JsonFormatter()
    for entry, line in zip(entries, stream.getvalue().splitlines(), strict=True):
        record = logging.makeLogRecord({"name": "kiln.registry.access", "levelno": logging.INFO, "levelname": "INFO"})
        record.created = entry[0]
        record.access = access_fields(entry)
        assert line == formatter.format(record)
        assert json.loads(line)["path"] == entry[3]
    handler.emit(logging.makeLogRecord({"msg": "another record", "levelname": "WARNING", "name": "x"}))
    assert json.loads(stream.getvalue().splitlines()[-1])["message"] == "another record"


def test_request_log_hands_on_batches(tmp_path: Path) -> None:
    """What requests leave behind goes out `FLUSH_S` after the first on an event loop, at once off one, when
    `MAX_PENDING` wait, and on `flush` (which `/metrics` and shutdown call): the access lines in order, the
    counters and the latency histogram as one call per request would have left them."""
    import asyncio
    import io
    import time

    from kiln.registry.ops.logs import ACCESS_LOGGER, AccessLineHandler
    from kiln.registry.ops.metrics import RegistryMetrics
    from kiln.registry.ops.middleware import RequestLog

    stream = io.StringIO()
    handler = AccessLineHandler(stream)
    access = logging.getLogger(ACCESS_LOGGER)
    saved = (access.handlers[:], access.propagate, access.level)
    access.handlers, access.propagate = [handler], False
    access.setLevel(logging.INFO)
    metrics = RegistryMetrics()
    log = RequestLog(metrics)

    def entry(i: int, status: int = 200) -> tuple[float, str, str, str, str, int, int, float, str]:
        return (time.time(), f"r-{i}", "GET", "/v1/resolve", "/v1/resolve", status, 100, 0.001 * (i % 40), "::1")

    def lines() -> int:
        return stream.getvalue().count("\n")

    async def on_the_loop() -> list[int]:
        seen = []
        log.add(entry(0))
        seen.append(lines())  # pending
        await asyncio.sleep(RequestLog.FLUSH_S * 3)
        seen.append(lines())  # the timer handed it on
        for i in range(1, RequestLog.MAX_PENDING + 1):
            log.add(entry(i, 200 if i % 3 else 404))
        seen.append(lines())  # MAX_PENDING waited: handed on without the timer
        log.add(entry(10_000))
        seen.append(lines())
        return seen

    try:
        log.add(entry(-1))  # no event loop: at once
        assert lines() == 1
        pending, timed, filled, last = asyncio.run(on_the_loop())
        assert (pending, timed, filled, last) == (1, 2, 2 + RequestLog.MAX_PENDING, 2 + RequestLog.MAX_PENDING)
        log.flush()
        assert lines() == RequestLog.MAX_PENDING + 3
    finally:
        access.handlers, access.propagate = saved[0], saved[1]
        access.setLevel(saved[2])
    ids = [json.loads(x)["request_id"] for x in stream.getvalue().splitlines()]
    assert ids == ["r--1", "r-0", *(f"r-{i}" for i in range(1, RequestLog.MAX_PENDING + 1)), "r-10000"]

    # The same requests observed one by one, the way the middleware did before it batched.
    direct = RegistryMetrics()
    for i in [-1, 0, *range(1, RequestLog.MAX_PENDING + 1), 10_000]:
        status = 200 if i <= 0 or i == 10_000 or i % 3 else 404
        direct.requests.labels("GET", "/v1/resolve", str(status)).inc()
        direct.latency.labels("GET", "/v1/resolve").observe(0.001 * (i % 40))
        direct.bytes_served.labels("/v1/resolve").inc(100)

    def samples(m: RegistryMetrics) -> list[str]:  # sums rounded: added in another order
        text = m.exposition().decode()
        return [
            re.sub(r"(_sum\{[^}]*\}) (\S+)", lambda g: f"{g[1]} {float(g[2]):.9f}", x)
            for x in text.splitlines()
            if x.startswith("kiln_http") and "_created" not in x
        ]

    assert samples(metrics) == samples(direct)
    assert any('le="0.025"' in x and not x.endswith(" 0.0") for x in samples(metrics))  # buckets moved


def test_metrics_read_every_request_answered_before_it(client: TestClient) -> None:
    """`/metrics` counts each request this process answered before it, none waiting for a batch."""
    for _ in range(5):
        client.get("/v1/models/nope")
    text = client.get("/metrics").text
    assert 'kiln_http_requests_total{method="GET",route="/v1/models/{model}",status="404"} 5.0' in text


def test_fastapi_opentelemetry_is_off_unless_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `opentelemetry`, no request asks the global providers whether one is configured (FastAPI's
    instrumentation would, on each); with it, FastAPI's instrumentation looks for them."""
    from opentelemetry import trace

    asked = []
    real = trace.get_tracer_provider

    def counted() -> object:
        asked.append(1)
        return real()

    monkeypatch.setattr(trace, "get_tracer_provider", counted)
    for enabled in (False, True):
        asked.clear()
        settings = RegistrySettings(data_dir=tmp_path / str(enabled), opentelemetry=enabled)
        with TestClient(create_app(settings)) as client:
            for _ in range(3):
                assert client.get("/healthz").status_code == 200
        assert (len(asked) >= 3) is enabled, (enabled, len(asked))


def test_served_access_lines_reach_stderr(tmp_path: Path) -> None:
    """A real `kiln serve` process writes one JSON access line per request to stderr, promptly."""
    import os
    import sys
    import time
    import urllib.error
    import urllib.request

    port = _free_port()
    env = {**os.environ, "KILN_REGISTRY_DATA_DIR": str(tmp_path / "registry")}
    log = open(tmp_path / "stderr.log", "wb")  # noqa: SIM115 (the server writes to it while it runs)
    server = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port)], env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "kiln serve did not start"
                time.sleep(0.2)
        for i in range(3):
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/resolve?model=nope&hardware=cpu", headers={"X-Request-ID": f"ci-{i}"}
            )
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(req, timeout=5)
        deadline = time.monotonic() + 5
        while True:
            lines = [json.loads(x) for x in (tmp_path / "stderr.log").read_text().splitlines() if x.startswith("{")]
            access = [
                x for x in lines if x.get("logger") == "kiln.registry.access" and x["request_id"].startswith("ci-")
            ]
            if len(access) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [x["request_id"] for x in access] == ["ci-0", "ci-1", "ci-2"]
        assert all(x["status"] == 404 and x["route"] == "/v1/resolve" and x["level"] == "info" for x in access)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_settings_file_with_environment_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "registry.yaml"
    config.write_text("anonymous_read: false\nprotected_channels: [prod, staging]\nmax_upload_bytes: 1000\n")
    monkeypatch.setenv("KILN_REGISTRY_CONFIG", str(config))
    monkeypatch.setenv("KILN_REGISTRY_MAX_UPLOAD_BYTES", "2000")
    settings = RegistrySettings()
    assert (settings.anonymous_read, settings.protected_channels, settings.max_upload_bytes) == (
        False,
        ["prod", "staging"],
        2000,
    )
    monkeypatch.setenv("KILN_REGISTRY_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(Exception, match="not a file"):
        RegistrySettings()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """A private PostgreSQL cluster (its own data directory and port), to stop and start in a test."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, _free_port()
        self.data = root / "data"
        root.mkdir(parents=True, exist_ok=True)
        shutil.chown(root, "postgres", "postgres")
        self._as_postgres(PG_BIN / "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def _as_postgres(self, *cmd: object) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *map(str, cmd)], check=True, capture_output=True)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        self._as_postgres(PG_BIN / "pg_ctl", "-D", self.data, "-o", options, "-l", self.root / "log", "-w", "start")

    def stop(self) -> None:
        self._as_postgres(PG_BIN / "pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


@pytest.fixture
def private_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    if not (PG_BIN / "pg_ctl").is_file() or shutil.which("runuser") is None:
        pytest.fail("PostgreSQL 15 server binaries (postgresql package) and runuser are needed for this test")
    server = PostgresServer(Path("/tmp") / f"kiln-pg-{_free_port()}")
    server.start()
    try:
        yield server
    finally:
        subprocess.run(
            [
                "runuser",
                "-u",
                "postgres",
                "--",
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(server.data),
                "-m",
                "immediate",
                "stop",
            ],
            capture_output=True,
        )
        shutil.rmtree(server.root, ignore_errors=True)


@pytest.mark.postgres
def test_database_outage_is_503_with_retry_after_and_recovers(private_postgres: PostgresServer, tmp_path: Path) -> None:
    migrate.upgrade(private_postgres.url)
    app: FastAPI = create_app(
        RegistrySettings(database_url=private_postgres.url, blob_url=(tmp_path / "blobs").as_uri(), data_dir=tmp_path)
    )
    token = make_token(app, ["admin"])
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
        assert client.post("/v1/models", json={"name": "tiny"}).status_code == 201
        private_postgres.stop()
        down = client.get("/v1/models")
        assert_error(down, 503, "UNAVAILABLE")
        assert down.headers["Retry-After"] == "5"
        assert client.get("/readyz").status_code == 503 and client.get("/healthz").status_code == 200
        refused = client.post("/v1/models", json={"name": "other"})
        assert refused.status_code == 503
        private_postgres.start()
        # Same app, same pool: the next requests reconnect.
        assert [m["name"] for m in client.get("/v1/models").json()] == ["tiny"]
        assert client.get("/readyz").json()["status"] == "ready"
        assert client.post("/v1/models", json={"name": "other"}).status_code == 201
