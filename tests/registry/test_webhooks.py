"""Webhooks: registry events reach a real HTTP receiver, signed, retried with backoff, logged, exactly as
subscribed; nothing is sent for a change that rolled back; only admins manage them."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import pytest
from fastapi import FastAPI
from sqlalchemy import func, select
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.audit import service as audit
from kiln.registry.db import utcnow
from kiln.registry.settings import RegistrySettings
from kiln.registry.webhooks import outbox
from kiln.registry.webhooks.models import WebhookDelivery
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error, make_release, post_eval, promote, publish, seal
from tests.registry.s3_server import free_port

T = TypeVar("T")
# Senders that poll often and back off briefly, so retries take a fraction of a second.
FAST_DELIVERY = {
    "webhook_poll_interval_s": 0.05,
    "webhook_backoff_base_s": 0.05,
    "webhook_backoff_max_s": 0.2,
    "webhook_max_attempts": 3,
    "webhook_timeout_s": 5.0,
    "webhook_allow": ["127.0.0.1"],  # the receivers of these tests listen on loopback
}


@pytest.fixture
def app(settings: RegistrySettings) -> FastAPI:
    return create_app(settings.model_copy(update=FAST_DELIVERY))


@pytest.fixture
def quiet(settings: RegistrySettings) -> Iterator[TestClient]:
    """An admin's client of a registry process that queues deliveries but sends none."""
    app = create_app(settings.model_copy(update={**FAST_DELIVERY, "webhook_delivery": False}))
    with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['admin'], name='quiet')}"}) as client:
        yield client


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # names lowercased
    body: bytes

    @property
    def payload(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the senders open up to a batch of connections at once


class Receiver:
    """A webhook endpoint on a free loopback port: records every POST; answers 500 while told to fail."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self._failures = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    failing = receiver._failures > 0
                    receiver._failures -= failing
                self.send_response(500 if failing else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def fail(self, times: int) -> None:
        """Answer the next `times` requests with 500."""
        with self._lock:
            self._failures = times

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def wait_for(check: Callable[[], T | None], what: str, timeout: float = 30.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def verified(request: Received, secret: str) -> dict[str, Any]:
    """The payload, once its signature checks out as a receiver would check it."""
    timestamp = request.headers["x-kiln-timestamp"]
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + request.body, hashlib.sha256)
    assert hmac.compare_digest("sha256=" + mac.hexdigest(), request.headers["x-kiln-signature"])
    assert abs(time.time() - int(timestamp)) < 300
    assert request.headers["content-type"] == "application/json"
    payload = request.payload
    assert request.headers["x-kiln-event"] == payload["event"]
    return payload


def subscribe(client: TestClient, url: str, events: list[str], **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/webhooks", json={"url": url, "events": events, **fields})
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def deliveries(client: TestClient, webhook_id: int) -> list[dict[str, Any]]:
    response = client.get(f"/v1/webhooks/{webhook_id}/deliveries")
    assert response.status_code == 200, response.text
    log: list[dict[str, Any]] = response.json()
    return log


def settled(client: TestClient, webhook_id: int, count: int) -> list[dict[str, Any]]:
    """The delivery log once `count` deliveries are no longer pending."""

    def done() -> list[dict[str, Any]] | None:
        log = deliveries(client, webhook_id)
        return log if len(log) == count and all(d["state"] != "pending" for d in log) else None

    return wait_for(done, f"{count} settled deliveries of webhook {webhook_id}")


def sealed_release(client: TestClient, model: str = "tiny", version: str = "1.0") -> None:
    make_release(client, model=model, version=version)
    publish(client, "gguf-q8", {"m": f"{model}@{version}".encode()}, ["cpu"], model=model, version=version)
    assert post_eval(client, "gguf-q8", "passed", model=model, version=version).status_code in (200, 201)
    seal(client, version, model)


def record_events(app: FastAPI, count: int) -> None:
    """Commit `count` seal events, as `count` sealing requests would."""
    with app.state.write_session_factory() as session:
        for n in range(count):
            audit.record(session, action="release.seal", target=f"tiny@{n}", model="tiny", details={"n": n})
        session.commit()


def test_seal_promotion_and_yank_are_delivered_signed(client: TestClient, receiver: Receiver) -> None:
    hook = subscribe(client, receiver.url + "/hooks/kiln", ["release.seal", "channel.promote", "release.yank"])
    sealed_release(client)
    assert promote(client, actor="ci").status_code == 200
    assert client.post("/v1/models/tiny/releases/1.0/yank", json={"reason": "bad tokenizer"}).status_code == 200

    log = settled(client, hook["id"], 3)
    assert [(d["event"], d["state"], d["attempts"]) for d in log] == [  # newest first
        ("release.yank", "delivered", 1),
        ("channel.promote", "delivered", 1),
        ("release.seal", "delivered", 1),
    ]
    assert all([a["status_code"] for a in d["attempt_log"]] == [204] for d in log)
    received = sorted(receiver.received, key=lambda r: r.payload["id"])
    assert [r.path for r in received] == ["/hooks/kiln"] * 3
    payloads = [verified(r, hook["secret"]) for r in received]
    events = {e["id"]: e for e in client.get("/v1/audit", params={"model": "tiny"}).json()}
    for request, payload in zip(received, payloads, strict=True):
        assert set(payload) == {"id", "event", "at", "model", "target", "actor", "reason", "details"}
        event = events[payload["id"]]
        assert (payload["event"], payload["target"], payload["actor"], payload["details"]) == (
            event["action"],
            event["target"],
            event["actor"],
            event["details"],
        )
        assert datetime.fromisoformat(payload["at"]) == datetime.fromisoformat(event["at"])
        delivery = next(d for d in log if d["audit_event_id"] == payload["id"])
        assert request.headers["x-kiln-delivery"] == str(delivery["id"])
        assert delivery["payload"] == payload
        assert hook["secret"] not in request.body.decode()
    seal_event, promotion, yank = payloads
    assert (seal_event["event"], seal_event["model"], seal_event["target"]) == ("release.seal", "tiny", "tiny@1.0")
    assert seal_event["details"]["after"] == {"status": "sealed"}
    assert (promotion["event"], promotion["target"], promotion["actor"]) == (
        "channel.promote",
        "tiny/prod",
        "token:test-admin (ci)",
    )
    assert promotion["details"]["after"]["version"] == "1.0"
    assert (yank["event"], yank["reason"], yank["details"]["channels"]) == ("release.yank", "bad tokenizer", ["prod"])


def test_a_receiver_failing_twice_gets_the_event_on_the_third_attempt(client: TestClient, receiver: Receiver) -> None:
    receiver.fail(2)
    hook = subscribe(client, receiver.url, ["release.seal"])
    sealed_release(client)
    [delivery] = settled(client, hook["id"], 1)
    assert (delivery["state"], delivery["attempts"], delivery["last_status"]) == ("delivered", 3, 204)
    attempts = delivery["attempt_log"]
    assert [(a["attempt"], a["status_code"], a["error"]) for a in attempts] == [
        (1, 500, "http_status"),
        (2, 500, "http_status"),
        (3, 204, None),
    ]
    times = [datetime.fromisoformat(a["at"]) for a in attempts]
    # Backoff: 0.05 s after the first failure, 0.1 s after the second.
    assert (times[1] - times[0]).total_seconds() >= 0.05 and (times[2] - times[1]).total_seconds() >= 0.1
    assert len(receiver.received) == 3
    assert len({r.headers["x-kiln-delivery"] for r in receiver.received}) == 1
    assert len({r.body for r in receiver.received}) == 1  # the same event, byte for byte
    for request in receiver.received:
        verified(request, hook["secret"])


def test_a_receiver_that_always_fails_ends_failed(client: TestClient, receiver: Receiver) -> None:
    receiver.fail(1000)
    failing = subscribe(client, receiver.url, ["release.seal"])
    unreachable = subscribe(client, f"http://127.0.0.1:{free_port()}/nobody", ["release.seal"])
    sealed_release(client)
    [delivery] = settled(client, failing["id"], 1)
    assert (delivery["state"], delivery["attempts"], delivery["delivered_at"]) == ("failed", 3, None)
    assert [a["status_code"] for a in delivery["attempt_log"]] == [500, 500, 500]
    assert len(receiver.received) == 3
    [nobody] = settled(client, unreachable["id"], 1)
    assert (nobody["state"], nobody["attempts"], nobody["last_status"]) == ("failed", 3, None)
    assert all((a["status_code"], a["error"]) == (None, "refused") for a in nobody["attempt_log"])
    assert len(nobody["attempt_log"]) == 3
    time.sleep(0.3)  # no fourth attempt comes
    assert len(receiver.received) == 3


def test_a_rolled_back_change_enqueues_nothing(app: FastAPI, client: TestClient, receiver: Receiver) -> None:
    hook = subscribe(client, receiver.url, list(outbox.EVENTS))
    with app.state.write_session_factory() as session:
        audit.record(session, action="release.seal", target="tiny@9.9", model="tiny", details={})
        assert session.scalar(select(func.count()).select_from(WebhookDelivery)) == 1  # queued with the change
        session.rollback()
    with app.state.session_factory() as session:
        assert session.scalar(select(func.count()).select_from(WebhookDelivery)) == 0
    # Refused changes (an open release cannot be promoted) send nothing either.
    make_release(client)
    assert_error(promote(client), 409, "RELEASE_NOT_SEALED")
    time.sleep(0.3)
    assert deliveries(client, hook["id"]) == [] and receiver.received == []


def test_events_and_model_pattern_filter_what_a_webhook_gets(client: TestClient, receiver: Receiver) -> None:
    promotions = subscribe(client, receiver.url + "/tiny-promotions", ["channel.promote"], model_pattern="tiny")
    other_seals = subscribe(client, receiver.url + "/other-seals", ["release.seal"], model_pattern="other-*")
    everything = subscribe(client, receiver.url + "/all", list(outbox.EVENTS))
    for model in ("tiny", "other-model"):
        sealed_release(client, model=model)
        assert promote(client, model=model).status_code == 200
    assert promote(client, channel="dev", force=True, reason="hotfix").status_code == 200  # another event
    # Deliveries are made with the change, so the logs already say what will be sent.
    assert [(d["event"], d["payload"]["model"]) for d in deliveries(client, promotions["id"])] == [
        ("channel.promote", "tiny")
    ]
    assert [(d["event"], d["payload"]["model"]) for d in deliveries(client, other_seals["id"])] == [
        ("release.seal", "other-model")
    ]
    assert len(deliveries(client, everything["id"])) == 5
    settled(client, everything["id"], 5)
    settled(client, promotions["id"], 1)
    settled(client, other_seals["id"], 1)
    by_path = sorted((r.path, r.payload["event"], r.payload["model"]) for r in receiver.received)
    assert by_path == [
        ("/all", "channel.promote", "other-model"),
        ("/all", "channel.promote", "tiny"),
        ("/all", "channel.promote.forced", "tiny"),
        ("/all", "release.seal", "other-model"),
        ("/all", "release.seal", "tiny"),
        ("/other-seals", "release.seal", "other-model"),
        ("/tiny-promotions", "channel.promote", "tiny"),
    ]
    # Webhook changes are audited, and are not themselves events.
    actions = [e["action"] for e in client.get("/v1/audit").json()]
    assert actions.count("webhook.create") == 3
    creation = next(e for e in client.get("/v1/audit").json() if e["target"] == f"webhook:{promotions['id']}")
    # The audit log is readable with `read`: it names the receiver's origin, never its path or the secret.
    assert creation["details"]["after"] == {"url": receiver.url, "events": ["channel.promote"], "model_pattern": "tiny"}


def test_a_deleted_webhook_gets_nothing_and_its_pending_deliveries_stop(
    app: FastAPI, admin_token: str, quiet: TestClient, receiver: Receiver
) -> None:
    idle = quiet  # nothing is sent until `live` below starts a sender
    kept, stopped, gone = (subscribe(idle, receiver.url, ["release.seal"]) for _ in range(3))
    assert idle.delete(f"/v1/webhooks/{gone['id']}").json()["active"] is False
    sealed_release(idle, version="1.0")
    assert [d["state"] for d in deliveries(idle, stopped["id"])] == ["pending"]
    assert deliveries(idle, gone["id"]) == []
    deleted = idle.delete(f"/v1/webhooks/{stopped['id']}")
    assert deleted.status_code == 200 and deleted.json()["active"] is False
    assert idle.delete(f"/v1/webhooks/{stopped['id']}").status_code == 200  # again: nothing changes
    [cancelled] = deliveries(idle, stopped["id"])
    assert (cancelled["state"], cancelled["attempts"], cancelled["last_error"]) == (
        "failed",
        0,
        "the webhook was deleted",
    )
    sealed_release(idle, version="2.0")
    assert len(deliveries(idle, stopped["id"])) == 1
    assert {w["id"]: w["active"] for w in idle.get("/v1/webhooks").json()} == {
        kept["id"]: True,
        stopped["id"]: False,
        gone["id"]: False,
    }
    assert_error(
        idle.post(f"/v1/webhooks/{stopped['id']}/deliveries/{cancelled['id']}/redeliver"), 409, "WEBHOOK_INACTIVE"
    )
    with TestClient(app, headers={"Authorization": f"Bearer {admin_token}"}) as live:
        settled(live, kept["id"], 2)
        time.sleep(0.3)
    assert len(receiver.received) == 2
    assert {r.headers["x-kiln-delivery"] for r in receiver.received} == {
        str(d["id"]) for d in deliveries(idle, kept["id"])
    }
    actions = [e["action"] for e in idle.get("/v1/audit").json()]
    assert actions.count("webhook.delete") == 2  # the repeated delete changed nothing


def test_redelivery_sends_the_same_event_as_a_new_delivery(client: TestClient, receiver: Receiver) -> None:
    hook = subscribe(client, receiver.url, ["release.seal"])
    sealed_release(client)
    [first] = settled(client, hook["id"], 1)
    again = client.post(f"/v1/webhooks/{hook['id']}/deliveries/{first['id']}/redeliver")
    assert again.status_code == 201, again.text
    copy = again.json()
    assert copy["id"] != first["id"] and copy["state"] == "pending" and copy["attempt_log"] == []
    assert (copy["payload"], copy["audit_event_id"]) == (first["payload"], first["audit_event_id"])
    log = settled(client, hook["id"], 2)
    assert [d["id"] for d in log] == [copy["id"], first["id"]]
    first_request, second_request = receiver.received
    assert first_request.body == second_request.body
    assert second_request.headers["x-kiln-delivery"] == str(copy["id"])
    assert verified(second_request, hook["secret"])["id"] == first["payload"]["id"]
    missing = client.post(f"/v1/webhooks/{hook['id']}/deliveries/{copy['id'] + 100}/redeliver")
    assert_error(missing, 404, "NOT_FOUND")
    other = subscribe(client, receiver.url, ["release.yank"])
    assert_error(client.post(f"/v1/webhooks/{other['id']}/deliveries/{first['id']}/redeliver"), 404, "NOT_FOUND")


def test_only_admins_manage_webhooks(app: FastAPI, client: TestClient, receiver: Receiver) -> None:
    hook = subscribe(client, receiver.url, ["release.seal"])
    routes = [
        ("POST", "/v1/webhooks", {"url": receiver.url, "events": ["release.seal"]}),
        ("GET", "/v1/webhooks", None),
        ("GET", f"/v1/webhooks/{hook['id']}", None),
        ("GET", f"/v1/webhooks/{hook['id']}/deliveries", None),
        ("DELETE", f"/v1/webhooks/{hook['id']}", None),
        ("POST", f"/v1/webhooks/{hook['id']}/deliveries/1/redeliver", None),
    ]
    for scope in ("read", "publish", "promote"):
        with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, [scope], name=scope)}"}) as other:
            for method, path, body in routes:
                assert_error(other.request(method, path, json=body), 403, "FORBIDDEN")
    with TestClient(app) as anonymous:
        for method, path, body in routes:
            assert_error(anonymous.request(method, path, json=body), 401, "UNAUTHORIZED")
    assert client.get(f"/v1/webhooks/{hook['id']}").json()["active"] is True  # nothing was changed

    # An admin limited to some models subscribes to their events only, and sees only such webhooks.
    limited = make_token(app, ["admin"], models=["other-*"], name="other-admin")
    with TestClient(app, headers={"Authorization": f"Bearer {limited}"}) as other_admin:
        for pattern in ("*", "tiny", "o*"):
            body = {"url": receiver.url, "events": ["release.seal"], "model_pattern": pattern}
            assert_error(other_admin.post("/v1/webhooks", json=body), 403, "FORBIDDEN")
        own = subscribe(other_admin, receiver.url, ["release.seal"], model_pattern="other-m*")
        assert [w["id"] for w in other_admin.get("/v1/webhooks").json()] == [own["id"]]
        assert_error(other_admin.get(f"/v1/webhooks/{hook['id']}"), 404, "NOT_FOUND")
        assert_error(other_admin.delete(f"/v1/webhooks/{hook['id']}"), 404, "NOT_FOUND")
    assert {w["id"] for w in client.get("/v1/webhooks").json()} == {hook["id"], own["id"]}


def test_the_secret_is_returned_once(client: TestClient, receiver: Receiver) -> None:
    generated = subscribe(client, receiver.url, ["release.seal"])
    assert len(generated["secret"]) >= 43
    given = subscribe(client, receiver.url, ["release.seal"], secret="s" * 32)
    assert given["secret"] == "s" * 32
    for hook in (generated, given):
        shown = client.get(f"/v1/webhooks/{hook['id']}")
        assert "secret" not in shown.json() and hook["secret"] not in shown.text
        assert shown.json() == {k: v for k, v in hook.items() if k != "secret"}
    listed = client.get("/v1/webhooks")
    assert all("secret" not in w for w in listed.json())
    assert generated["secret"] not in listed.text and given["secret"] not in listed.text
    audit_log = client.get("/v1/audit").text
    assert generated["secret"] not in audit_log and given["secret"] not in audit_log
    assert_error(client.get("/v1/webhooks/999"), 404, "NOT_FOUND")


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"url": "ftp://example.com/hook"}, "INVALID_WEBHOOK_URL"),
        ({"url": "not a url"}, "INVALID_WEBHOOK_URL"),
        ({"url": "http://"}, "INVALID_WEBHOOK_URL"),
        ({"url": "http://example.com:99999/"}, "INVALID_WEBHOOK_URL"),
        ({"url": "https://example.com/a b"}, "INVALID_WEBHOOK_URL"),
        ({"url": "javascript:alert(1)"}, "INVALID_WEBHOOK_URL"),
        ({"url": "/relative/path"}, "INVALID_WEBHOOK_URL"),
        ({"url": "http://example.com/" + "a" * 2100}, "INVALID_INPUT"),
        ({"events": ["release.sealed"]}, "UNKNOWN_EVENT"),
        ({"events": []}, "INVALID_INPUT"),
        ({"events": ["webhook.create"]}, "UNKNOWN_EVENT"),
        ({"model_pattern": "Tiny*"}, "INVALID_PATTERN"),
        ({"secret": "short"}, "INVALID_INPUT"),
        ({"active": False}, "INVALID_INPUT"),
    ],
)
def test_a_bad_webhook_is_refused_with_a_code(client: TestClient, body: dict[str, Any], code: str) -> None:
    spec = {"url": "https://hooks.example.com/kiln", "events": ["release.seal"], **body}
    error = assert_error(client.post("/v1/webhooks", json=spec), 422, code)
    if code == "UNKNOWN_EVENT":
        assert error["details"]["known"] == list(outbox.EVENTS)
        assert all(name in error["message"] for name in outbox.EVENTS)
    assert client.get("/v1/webhooks").json() == []


def test_concurrent_claimers_never_take_one_delivery_twice(quiet: TestClient, receiver: Receiver) -> None:
    app = quiet.app
    assert isinstance(app, FastAPI)
    subscribe(quiet, receiver.url, ["release.seal"])
    record_events(app, 60)
    claimed: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(len(claimed))

    def claim(mine: list[int]) -> None:
        start.wait()
        while True:
            with app.state.write_session_factory() as session:
                claims = outbox.claim_due(session, now=utcnow(), lease_s=60, limit=3)
                session.commit()
            if not claims:
                return
            mine += [c.delivery_id for c in claims]

    threads = [threading.Thread(target=claim, args=(mine,)) for mine in claimed]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    everything = [delivery_id for mine in claimed for delivery_id in mine]
    assert len(everything) == 60 and len(set(everything)) == 60


def test_two_server_processes_send_each_delivery_once(
    settings: RegistrySettings, admin_token: str, app: FastAPI, receiver: Receiver
) -> None:
    second = create_app(settings.model_copy(update=FAST_DELIVERY))  # another worker on the same database
    auth = {"Authorization": f"Bearer {admin_token}"}
    with TestClient(app, headers=auth) as one, TestClient(second, headers=auth):
        hook = subscribe(one, receiver.url, ["release.seal"])
        record_events(app, 40)
        log = settled(one, hook["id"], 40)
    assert all((d["state"], d["attempts"]) == ("delivered", 1) for d in log)
    sent = [r.headers["x-kiln-delivery"] for r in receiver.received]
    assert sorted(sent) == sorted(str(d["id"]) for d in log)


def test_delivery_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_REGISTRY_WEBHOOK_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("KILN_REGISTRY_WEBHOOK_BACKOFF_BASE_S", "2")
    monkeypatch.setenv("KILN_REGISTRY_WEBHOOK_BACKOFF_MAX_S", "7")
    policy = outbox.RetryPolicy.from_settings(RegistrySettings())
    assert [policy.delay(n).total_seconds() for n in range(1, 6)] == [2, 4, 7, 7, 7]
    assert policy.max_attempts == 5


def test_a_weight_change_of_a_split_is_delivered(client: TestClient, receiver: Receiver) -> None:
    hook = subscribe(client, receiver.url, ["channel.split"])
    for version in ("1.0", "2.0"):
        sealed_release(client, version=version)
    assert promote(client, "1.0").status_code == 200  # not a split: not sent to this webhook
    split = {"weights": [{"version": "1.0", "weight": 95}, {"version": "2.0", "weight": 5}]}
    assert client.put("/v1/models/tiny/channels/prod/split", json=split).status_code == 200
    [delivery] = settled(client, hook["id"], 1)
    assert delivery["state"] == "delivered"
    [request] = receiver.received
    payload = verified(request, hook["secret"])
    assert (payload["event"], payload["model"], payload["target"]) == ("channel.split", "tiny", "tiny/prod")
