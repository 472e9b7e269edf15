"""Webhooks cannot be aimed inside the network: a URL must name a public address, unless the operator's
allow-list admits an internal receiver; checked at registration and, resolved afresh, before every attempt,
which connects to the address it checked. Redirects are not followed, attempts record error classes, and
no log line carries a URL's credentials or query."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx2
import pytest
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from kiln.registry.webhooks.delivery import ERROR_CLASSES
from kiln.registry.webhooks.destinations import IPAddress, system_resolver
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error
from tests.registry.s3_server import free_port
from tests.registry.test_webhooks import FAST_DELIVERY, Receiver, record_events, settled, subscribe, wait_for

PUBLIC = "93.184.215.14"  # a public address; nothing here connects to it
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


class HostsResolver:
    """A resolver with host names of the test's own, as /etc/hosts would hold them; the system's resolver
    answers for any other name. A name's addresses may be changed between registration and delivery."""

    def __init__(self, names: dict[str, list[str]] | None = None) -> None:
        self.names = dict(names or {})

    def __call__(self, host: str, port: int) -> Sequence[IPAddress]:
        if host in self.names:
            return [ipaddress.ip_address(a) for a in self.names[host]]
        return system_resolver(host, port)


@contextlib.contextmanager
def registry(
    settings: RegistrySettings, resolver: HostsResolver, allow: Sequence[str] = (), **changes: Any
) -> Iterator[TestClient]:
    """An admin's client of a registry that sends deliveries, with this allow-list and resolver."""
    app = create_app(
        settings.model_copy(update={**FAST_DELIVERY, "webhook_allow": list(allow), **changes}),
        webhook_resolver=resolver,
    )
    token = make_token(app, ["admin"], name=f"hooks-{os.urandom(4).hex()}")
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
        yield client


def record_seal(client: TestClient) -> None:
    """Commit a seal event in the client's registry: every subscribed webhook gets a delivery."""
    app = client.app
    assert isinstance(app, FastAPI)
    record_events(app, 1)


class Listener:
    """A loopback TCP port that takes connections, counts them, and never answers."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self.accepted = 0
        self._open: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        self._socket.settimeout(0.05)  # a blocked accept() would not see the socket closed
        while not self._closed.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            self._open.append(connection)

    def __enter__(self) -> Listener:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._closed.set()
        self._thread.join(timeout=10)
        self._socket.close()
        for connection in self._open:
            connection.close()


class Redirector:
    """An HTTP endpoint on loopback that answers every POST with a redirect to `location`."""

    def __init__(self, location: str) -> None:
        self.posts = 0
        redirector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                redirector.posts += 1
                self.send_response(307)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Redirector:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


FORBIDDEN = "WEBHOOK_DESTINATION_FORBIDDEN"
REFUSED_AT_REGISTRATION: dict[str, str] = {
    # Loopback, the registry's own port included, by name, and in every spelling of its address.
    "http://127.0.0.1/hook": FORBIDDEN,
    "http://127.0.0.1:8000/v1/webhooks": FORBIDDEN,
    "http://127.8.9.10:8000/": FORBIDDEN,
    "http://localhost/": FORBIDDEN,
    "http://localhost./": FORBIDDEN,
    "http://LOCALHOST:8000/": FORBIDDEN,
    "http://[::1]/": FORBIDDEN,
    "http://[::ffff:127.0.0.1]/": FORBIDDEN,
    "http://[::ffff:7f00:1]/": FORBIDDEN,
    "http://[::127.0.0.1]/": FORBIDDEN,
    "http://2130706433/": FORBIDDEN,
    "http://0x7f000001/": FORBIDDEN,
    "http://0177.0.0.1/": FORBIDDEN,
    "http://017700000001/": FORBIDDEN,
    "http://127.1/": FORBIDDEN,
    "http://0x7f.1/": FORBIDDEN,
    "https://[2002:7f00:1::]/": FORBIDDEN,  # 6to4 of 127.0.0.1
    # Private, shared, link-local and unique-local networks.
    "http://10.0.0.1/": FORBIDDEN,
    "http://10.255.255.254:9200/_search": FORBIDDEN,
    "http://172.16.0.1/": FORBIDDEN,
    "http://172.31.255.1/": FORBIDDEN,
    "http://192.168.1.1/": FORBIDDEN,
    "http://100.64.0.1/": FORBIDDEN,
    "http://169.254.1.1/": FORBIDDEN,
    "http://[fe80::1]/": FORBIDDEN,
    "http://[fd12:3456::1]/": FORBIDDEN,
    "http://[64:ff9b::a00:1]/": FORBIDDEN,  # NAT64 of 10.0.0.1
    "http://[2001:0:4136:e378:8000:63bf:f5ff:fffe]/": FORBIDDEN,  # Teredo
    # Cloud metadata, unspecified, multicast, reserved, documentation.
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/": FORBIDDEN,
    "http://[fd00:ec2::254]/latest/meta-data/": FORBIDDEN,
    "http://[::ffff:169.254.169.254]/": FORBIDDEN,
    "http://0.0.0.0:8000/": FORBIDDEN,
    "http://0/": FORBIDDEN,
    "http://[::]/": FORBIDDEN,
    "http://224.0.0.1/": FORBIDDEN,
    "http://240.0.0.1/": FORBIDDEN,
    "http://255.255.255.255/": FORBIDDEN,
    "http://192.0.2.1/": FORBIDDEN,
    # Names that resolve inside (one of their addresses is enough).
    "http://intranet.corp.test/hook": FORBIDDEN,
    "https://hooks.loopback.test:8443/": FORBIDDEN,
    "https://metadata.test/": FORBIDDEN,
    "https://mixed.test/": FORBIDDEN,
    "https://intranet.corp.test./": FORBIDDEN,
    # Not a destination at all.
    "http://nowhere.test/": "WEBHOOK_DESTINATION_UNRESOLVABLE",
    "http://user:password@hooks.public.test/": "INVALID_WEBHOOK_URL",
    "http://token@hooks.public.test/": "INVALID_WEBHOOK_URL",
    "http://[fe80::1%25eth0]/": "INVALID_WEBHOOK_URL",
    "http://1.2.3.4.5/": "INVALID_WEBHOOK_URL",
    "http://hooks.exämple.test/": "INVALID_WEBHOOK_URL",
    "http://[127.0.0.1]/": "INVALID_WEBHOOK_URL",
    "file:///etc/passwd": "INVALID_WEBHOOK_URL",
    "gopher://127.0.0.1:6379/": "INVALID_WEBHOOK_URL",
}
NAMES = {
    "intranet.corp.test": ["10.1.2.3"],
    "hooks.loopback.test": ["127.0.0.1"],
    "metadata.test": ["169.254.169.254"],
    "mixed.test": [PUBLIC, "192.168.0.10"],
    "nowhere.test": [],
    "hooks.public.test": [PUBLIC, "2606:2800:21f:cb07:6820:80da:af6b:8b2c"],
}


def test_registration_refuses_destinations_inside_the_network(settings: RegistrySettings) -> None:
    with registry(settings, HostsResolver(NAMES)) as client:
        answers = {}
        for url, code in REFUSED_AT_REGISTRATION.items():
            response = client.post("/v1/webhooks", json={"url": url, "events": ["release.seal"]})
            answers[url] = response.json()["error"]["code"] if response.status_code == 422 else response.status_code
            if response.status_code == 422 and code == FORBIDDEN:
                error = assert_error(response, 422, FORBIDDEN)
                assert "KILN_REGISTRY_WEBHOOK_ALLOW" in error["message"]
                assert error["details"]["reason"]
        assert answers == REFUSED_AT_REGISTRATION
        assert client.get("/v1/webhooks").json() == []
        # A name resolving only to public addresses is accepted, and so is a public address.
        for url in ("https://hooks.public.test/kiln?token=abc", f"http://{PUBLIC}:8080/kiln"):
            assert subscribe(client, url, ["release.seal"])["url"] == url


def test_the_allow_list_admits_internal_receivers_and_deliveries_reach_them(
    settings: RegistrySettings, receiver: Receiver
) -> None:
    port = int(receiver.url.rpartition(":")[2])
    resolver = HostsResolver({"receiver.internal.test": ["127.0.0.1"], "other.internal.test": ["127.0.0.1"]})
    allow = [f"receiver.internal.test:{port}", "169.254.0.0/16", "0.0.0.0/0", "::/0"]
    with registry(settings, resolver, allow) as client:
        # A name admitted on its port: the connection goes to the address the registry resolved.
        hook = subscribe(client, f"http://receiver.internal.test:{port}/hooks/kiln?token=t1", ["release.seal"])
        record_seal(client)
        [delivery] = settled(client, hook["id"], 1)
        assert (delivery["state"], delivery["attempt_log"][0]["error"]) == ("delivered", None)
        [request] = receiver.received
        assert request.path == "/hooks/kiln?token=t1"
        assert request.headers["host"] == f"receiver.internal.test:{port}"
        # An allow-list never admits unspecified or metadata addresses, however wide its networks.
        for url in ("http://169.254.169.254/", "http://[fd00:ec2::254]/", "http://0.0.0.0/", "http://[::]/"):
            body = {"url": url, "events": ["release.seal"]}
            assert_error(client.post("/v1/webhooks", json=body), 422, FORBIDDEN)
        subscribe(client, "http://169.254.1.1/", ["release.seal"])  # the network it listed
        for webhook in client.get("/v1/webhooks").json():
            assert client.delete(f"/v1/webhooks/{webhook['id']}").status_code == 200
    with registry(settings, resolver, [f"receiver.internal.test:{port}"]) as client:
        # Only that name, on only that port.
        for url in (receiver.url, f"http://other.internal.test:{port}/", f"http://receiver.internal.test:{port + 1}/"):
            assert_error(client.post("/v1/webhooks", json={"url": url, "events": ["release.seal"]}), 422, FORBIDDEN)
    with registry(settings, resolver, ["127.0.0.1/32"]) as client:
        # A network: any name resolving into it, any port.
        hook = subscribe(client, f"http://other.internal.test:{port}/by-network", ["release.seal"])
        record_seal(client)
        [delivery] = settled(client, hook["id"], 1)
        assert delivery["state"] == "delivered"
        assert [r.path for r in receiver.received] == ["/hooks/kiln?token=t1", "/by-network"]


def test_a_name_that_resolves_inside_at_delivery_is_not_connected_to(settings: RegistrySettings) -> None:
    resolver = HostsResolver({"rebinding.test": [PUBLIC]})
    with Listener() as listener, registry(settings, resolver) as client:
        hook = subscribe(client, f"http://rebinding.test:{listener.port}/hook", ["release.seal"])
        resolver.names["rebinding.test"] = [PUBLIC, "127.0.0.1"]  # one inside is enough
        record_seal(client)
        [delivery] = settled(client, hook["id"], 1)
        assert (delivery["state"], delivery["last_error"]) == ("failed", "destination_forbidden")
        assert [(a["status_code"], a["error"]) for a in delivery["attempt_log"]] == [
            (None, "destination_forbidden")
        ] * 3
        assert listener.accepted == 0


def test_a_redirect_is_not_followed(settings: RegistrySettings, receiver: Receiver) -> None:
    with (
        Redirector(receiver.url + "/stolen") as redirector,
        registry(settings, HostsResolver(), ["127.0.0.1"]) as client,
    ):
        hook = subscribe(client, redirector.url + "/hook", ["release.seal"])
        record_seal(client)
        [delivery] = settled(client, hook["id"], 1)
        assert delivery["state"] == "failed"
        assert [(a["status_code"], a["error"]) for a in delivery["attempt_log"]] == [(307, "http_status")] * 3
        assert redirector.posts == 3 and receiver.received == []


def test_delivery_errors_are_recorded_as_classes(settings: RegistrySettings, receiver: Receiver) -> None:
    resolver = HostsResolver({"gone.test": ["127.0.0.1"]})
    with (
        Listener() as silent,
        registry(settings, resolver, ["127.0.0.1"], webhook_timeout_s=0.5, webhook_max_attempts=2) as client,
    ):
        closed_port = free_port()
        hooks = {
            "refused": subscribe(client, f"http://127.0.0.1:{closed_port}/hook", ["release.seal"]),
            "timeout": subscribe(client, f"http://127.0.0.1:{silent.port}/hook", ["release.seal"]),
            "tls": subscribe(client, receiver.url.replace("http://", "https://") + "/hook", ["release.seal"]),
            "dns": subscribe(client, f"http://gone.test:{closed_port}/hook", ["release.seal"]),
        }
        resolver.names["gone.test"] = []  # the name disappeared after registration
        record_seal(client)
        for expected, hook in hooks.items():
            [delivery] = settled(client, hook["id"], 1)
            errors = [(a["status_code"], a["error"]) for a in delivery["attempt_log"]]
            assert errors == [(None, expected)] * 2, (expected, errors)
            assert delivery["last_error"] == expected
        assert silent.accepted >= 2
        assert receiver.received == []  # the TLS handshake never became a request
    assert {"refused", "timeout", "tls", "dns", "destination_forbidden", "http_status"} <= set(ERROR_CLASSES)


def test_the_allow_list_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_REGISTRY_WEBHOOK_ALLOW", "127.0.0.1, 10.0.0.0/8,hooks.internal:8443")
    assert RegistrySettings().webhook_allow == ["127.0.0.1", "10.0.0.0/8", "hooks.internal:8443"]
    monkeypatch.setenv("KILN_REGISTRY_WEBHOOK_ALLOW", '["[::1]:9000", "fd00::/8"]')
    assert RegistrySettings().webhook_allow == ["[::1]:9000", "fd00::/8"]
    monkeypatch.delenv("KILN_REGISTRY_WEBHOOK_ALLOW")
    assert RegistrySettings().webhook_allow == []
    for bad in ("10.0.0.0/33", "hooks.internal", "hooks.internal:0", "http://10.0.0.1/"):
        monkeypatch.setenv("KILN_REGISTRY_WEBHOOK_ALLOW", bad)
        with pytest.raises(ValidationError, match="allow-list entry"):
            RegistrySettings()


def test_no_log_line_carries_a_url_credential_or_query(tmp_path: Path, receiver: Receiver) -> None:
    """`kiln serve`'s own logs, at debug, through a real delivery and requests with secrets in their URLs;
    then a library's logs (urllib3, as boto's S3 client would write them) under the same log setup."""
    secret = "s3cr3t-" + os.urandom(8).hex()
    settings = RegistrySettings(data_dir=tmp_path / "data")
    app = create_app(settings)  # the embedded database, migrated; the server below opens it too
    token = make_token(app, ["admin"], name="ops")
    receiver_port = int(receiver.url.rpartition(":")[2])
    port = free_port()
    env = {
        **os.environ,
        "KILN_REGISTRY_DATA_DIR": str(settings.data_dir),
        "KILN_REGISTRY_WEBHOOK_ALLOW": "127.0.0.1",
        "KILN_REGISTRY_WEBHOOK_POLL_INTERVAL_S": "0.05",
    }
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "kiln.registry.server", "--port", str(port), "--log-level", "debug"]
    with open(log, "wb") as stderr:
        server = subprocess.Popen(command, cwd=REPO, env=env, stdout=stderr, stderr=stderr)
        try:
            base = f"http://127.0.0.1:{port}"
            with httpx2.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:

                def up() -> bool:
                    assert server.poll() is None, log.read_text()
                    with contextlib.suppress(httpx2.TransportError):
                        return http.get("/healthz").status_code == 200
                    return False

                wait_for(up, "the registry server")
                url = f"{receiver.url}/hook?token={secret}"
                created = http.post("/v1/webhooks", json={"url": url, "events": ["release.seal"]})
                assert created.status_code == 201, created.text
                refused = {"url": f"http://ops:{secret}@127.0.0.1:{receiver_port}/", "events": ["release.seal"]}
                assert http.post("/v1/webhooks", json=refused).status_code == 422
                # a query the listing does not take is refused, and its access line is still written
                assert http.get(f"/v1/models?token={secret}").status_code == 422
                record_events(app, 1)
                wait_for(lambda: receiver.received, "the delivery")
                assert receiver.received[0].path == f"/hook?token={secret}"
                wait_for(lambda: "HTTP Request: POST" in log.read_text(), "the delivery's log line")
        finally:
            server.terminate()
            server.wait(timeout=30)
            app.state.engine.dispose()
        library = (
            "import logging.config, urllib3\n"
            "from kiln.registry.ops.logs import log_config\n"
            "logging.config.dictConfig(log_config('debug'))\n"
            "http = urllib3.PoolManager()\n"
            f"http.request('GET', 'http://ops:{secret}@127.0.0.1:{receiver_port}/x?X-Amz-Signature={secret}')\n"
            "try:\n"
            f"    raise ValueError('cannot fetch https://ops:{secret}@s3.test/b/k#{secret}')\n"
            "except ValueError:\n"
            "    logging.getLogger('botocore.endpoint').exception('request failed')\n"
        )
        subprocess.run([sys.executable, "-c", library], cwd=REPO, env=env, stderr=stderr, check=True, timeout=60)
    text = log.read_text()
    assert secret not in text
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    said = "\n".join(r.get("message", "") + r.get("exception", "") for r in records)
    assert f"POST http://127.0.0.1:{receiver_port}/hook?REDACTED" in said  # the delivery's line
    assert '"GET /x?REDACTED HTTP/1.1" 501' in said  # urllib3's request line
    assert "https://REDACTED@s3.test/b/k#REDACTED" in said  # a traceback
