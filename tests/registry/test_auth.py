"""Access control: every mutating route refuses a missing or insufficient token and changes nothing;
scopes, model patterns, protected channels, token lifecycle, yank, and their audit trail."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from sqlalchemy import func, select
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.schema import registry_metadata
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import (
    assert_error,
    make_release,
    post_eval,
    promote,
    publish,
    seal,
    sha,
    stored_blob_objects,
    upload,
)

PARAMS = {
    "model": "tiny",
    "version": "1.0",
    "name": "gguf-q4",
    "channel": "prod",
    "token_id": "1",
    "path": "model.gguf",
    "repo": "tiny",
    "namespace": "kiln",
}
NEW_BLOB = b"never stored"


def _seed(client: TestClient) -> None:
    make_release(client, planned=["gguf-q4"])
    publish(client, "gguf-q4", {"model.gguf": b"q4" * 50}, ["cpu"], quant="q4_k_m")
    post_eval(client, "gguf-q4", "passed", metrics={"kl": 0.01})
    seal(client)
    assert promote(client, "1.0").status_code == 200


def _state(app: FastAPI, settings: RegistrySettings) -> dict[str, Any]:
    """Everything a refused request must leave as it was: row counts of every table, and stored blobs."""
    with app.state.session_factory() as session:
        counts = {
            t.name: session.execute(select(func.count()).select_from(t)).scalar_one()
            for t in registry_metadata().sorted_tables
        }
        revoked = session.execute(
            select(func.count()).where(registry_metadata().tables["tokens"].c.revoked_at.is_not(None))
        ).scalar_one()
    return {"rows": counts, "revoked": revoked, "blobs": stored_blob_objects(settings)}


def _mutating_routes(app: FastAPI) -> list[tuple[str, str]]:
    routes = []
    for path, ops in app.openapi()["paths"].items():
        for method in ops:
            if method in ("post", "put", "patch", "delete"):
                routes.append((method.upper(), path))
    return routes


def _url(path: str) -> str:
    url = re.sub(r"\{(\w+)(:path)?\}", lambda m: PARAMS.get(m.group(1), "x"), path)
    return url.replace("{sha256}", sha(NEW_BLOB))


def test_every_mutating_route_refuses_without_a_sufficient_token(
    app: FastAPI, client: TestClient, settings: RegistrySettings
) -> None:
    _seed(client)
    routes = _mutating_routes(app)
    assert {p for _, p in routes} >= {
        "/v1/models",
        "/v1/blobs/{sha256}",
        "/v1/models/{model}/channels/{channel}",
        "/v1/models/{model}/releases/{version}/yank",
        "/v1/tokens",
        "/v1/tokens/{token_id}/revoke",
    }
    reader = make_token(app, ["read"], name="reader")
    elsewhere = make_token(app, ["publish", "promote"], models=["llama-*"], name="llama-only")
    before = _state(app, settings)
    assert before["blobs"]  # the seeded release's blob: the comparison sees the store (disk or S3)
    for method, path in routes:
        url, body = _url(path), {"name": "tiny", "version": "1.0", "reason": "r", "scopes": ["admin"]}
        kwargs: dict[str, Any] = {"content": NEW_BLOB} if "blobs" in path else {"json": body}
        anonymous = client.request(method, url, headers={"Authorization": ""}, **kwargs)
        # TestClient keeps the admin header unless overridden; an empty one is refused as malformed.
        assert anonymous.status_code == 401, (method, path, anonymous.text)
        with TestClient(app) as bare:
            assert_error(bare.request(method, url, **kwargs), 401, "UNAUTHORIZED")
            refused = bare.request(method, url, headers={"Authorization": f"Bearer {reader}"}, **kwargs)
            assert_error(refused, 403, "FORBIDDEN")
            if "{model}" in path or path == "/v1/models":
                # The model of POST /v1/models is in its body, checked once the body is valid.
                own = {"json": {"name": "tiny"}} if path == "/v1/models" else kwargs
                other = bare.request(method, url, headers={"Authorization": f"Bearer {elsewhere}"}, **own)
                assert_error(other, 403, "FORBIDDEN")
        assert _state(app, settings) == before, (method, path)


def test_reads_need_a_token_when_anonymous_read_is_off(settings: RegistrySettings) -> None:
    app = create_app(settings.model_copy(update={"anonymous_read": False}))
    reader = make_token(app, ["read"])
    with TestClient(app) as bare:
        for path, ops in app.openapi()["paths"].items():
            if "get" not in ops or path in ("/healthz", "/readyz", "/metrics"):
                continue
            assert_error(bare.get(_url(path)), 401, "UNAUTHORIZED")
        assert bare.get("/healthz").status_code == 200
        assert bare.get("/v1/models", headers={"Authorization": f"Bearer {reader}"}).status_code == 200
        assert_error(bare.get("/v1/models", headers={"Authorization": "Bearer kiln_nope"}), 401, "INVALID_TOKEN")
        assert_error(bare.get("/v1/models", headers={"Authorization": "Basic abc"}), 401, "INVALID_TOKEN")


def test_token_lifecycle_is_audited(app: FastAPI, client: TestClient) -> None:
    created = client.post("/v1/tokens", json={"name": "ci", "scopes": ["publish"], "models": ["tiny*"]})
    assert created.status_code == 201
    secret, token_id = created.json()["token"], created.json()["id"]
    listed = client.get("/v1/tokens").json()
    assert all("token" not in t and "token_hash" not in t for t in listed)
    assert secret not in str(listed) and any(t["prefix"] == secret[:11] for t in listed)
    with TestClient(app, headers={"Authorization": f"Bearer {secret}"}) as ci:
        assert ci.post("/v1/models", json={"name": "tiny"}).status_code == 201
        assert_error(ci.post("/v1/models", json={"name": "llama"}), 403, "FORBIDDEN")
        assert_error(ci.get("/v1/tokens"), 403, "FORBIDDEN")
        revoked = client.post(f"/v1/tokens/{token_id}/revoke", json={"reason": "leaked in a log"})
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        assert_error(ci.post("/v1/models", json={"name": "tiny2"}), 401, "INVALID_TOKEN")
    events: dict[str, Any] = {}
    for e in client.get("/v1/audit").json():  # newest first
        events.setdefault(e["action"], e)
    assert events["token.create"]["details"]["after"]["scopes"] == ["publish"]
    assert events["token.revoke"]["reason"] == "leaked in a log"
    assert events["token.revoke"]["details"] == {
        "before": {"name": "ci", "revoked": False},
        "after": {"name": "ci", "revoked": True},
    }
    assert_error(client.post("/v1/tokens", json={"name": "x", "scopes": ["root"]}), 422, "INVALID_INPUT")


def test_protected_channels_need_the_promote_scope(app: FastAPI, client: TestClient) -> None:
    _seed(client)
    publisher = make_token(app, ["publish"], name="publisher")
    promoter = make_token(app, ["promote"], name="promoter")
    with TestClient(app) as bare:
        as_publisher = {"Authorization": f"Bearer {publisher}"}
        assert bare.post("/v1/models/tiny/channels/staging", json={"version": "1.0"}, headers=as_publisher).is_success
        denied = bare.post("/v1/models/tiny/channels/prod", json={"version": "1.0"}, headers=as_publisher)
        assert_error(denied, 403, "FORBIDDEN")
        as_promoter = {"Authorization": f"Bearer {promoter}"}
        assert bare.post("/v1/models/tiny/channels/prod", json={"version": "1.0"}, headers=as_promoter).is_success
    prod = client.get("/v1/models/tiny/channels/prod").json()
    assert prod["history"][0]["actor"] == "token:promoter"


def test_yank_keeps_the_release_but_nothing_serves_it(app: FastAPI, client: TestClient) -> None:
    _seed(client)
    publisher = make_token(app, ["publish"])
    with TestClient(app) as bare:
        denied = bare.post(
            "/v1/models/tiny/releases/1.0/yank", json={"reason": "x"}, headers={"Authorization": f"Bearer {publisher}"}
        )
        assert_error(denied, 403, "FORBIDDEN")
    yanked = client.post("/v1/models/tiny/releases/1.0/yank", json={"reason": "tokenizer bug"})
    assert yanked.status_code == 200 and yanked.json()["yanked_at"] is not None
    assert client.get("/v1/models/tiny/releases/1.0").json()["yank_reason"] == "tokenizer bug"
    error = assert_error(
        client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}), 410, "CHANNEL_RELEASE_YANKED"
    )
    assert "yanked" in error["message"]
    assert_error(promote(client, "1.0", channel="staging"), 409, "RELEASE_YANKED")
    hub = client.head("/tiny/resolve/prod%2Fgguf-q4/model.gguf")
    assert hub.status_code == 404 and hub.headers["X-Error-Code"] == "RevisionNotFound"
    event = client.get("/v1/audit", params={"model": "tiny"}).json()[0]
    assert (event["action"], event["reason"], event["details"]["channels"]) == (
        "release.yank",
        "tokenizer bug",
        ["prod"],
    )
    # Not served by any name: neither its files by path, nor its blobs by digest, nor the Hub's commit id.
    commit = client.get("/v1/models/tiny/releases/1.0/artifacts/gguf-q4").json()["manifest_digest"][:40]
    assert_error(
        client.get("/v1/models/tiny/releases/1.0/artifacts/gguf-q4/files/model.gguf"), 410, "RELEASE_NOT_SERVED"
    )
    with TestClient(app) as anonymous:
        assert_error(anonymous.get(f"/v1/blobs/{sha(b'q4' * 50)}"), 404, "BLOB_NOT_FOUND")
        by_commit = anonymous.get(f"/tiny/resolve/{commit}/model.gguf")
        assert by_commit.status_code == 404 and by_commit.headers["X-Error-Code"] == "RevisionNotFound"
    # The release and its blobs are still stored.
    assert client.get("/v1/models/tiny/releases/1.0").json()["artifacts"][0]["name"] == "gguf-q4"
    assert upload(client, b"q4" * 50) == sha(b"q4" * 50)
    assert client.get(f"/v1/blobs/{sha(b'q4' * 50)}").content == b"q4" * 50  # an unlimited admin reads any blob
