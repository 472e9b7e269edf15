"""Tokens expire, and administrators' events are for administrators (issue 40, section 5).

Before: every token lived until revoked, and anonymous readers saw the token names, scopes and model
patterns of every `token.create` in `/v1/audit`. Now a token has an expiry (at most the server's
`token_max_lifetime_days`, which is also its default), shown in listings and in the audit log, and
refused once passed as a revoked one is (401 INVALID_TOKEN); events that name no model are seen
only by an admin of all models.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error, make_release


def _as(app: FastAPI, secret: str | None) -> TestClient:
    return TestClient(app, headers={"Authorization": f"Bearer {secret}"} if secret else {})


def test_only_an_admin_of_all_models_sees_events_that_name_no_model(app: FastAPI, client: TestClient) -> None:
    assert client.post("/v1/tokens", json={"name": "ci", "scopes": ["publish"], "models": ["tiny*"]}).status_code == 201
    make_release(client)
    assert client.post("/v1/models/tiny/releases/1.0/abandon", json={"reason": "test"}).status_code == 200
    everything = [e["action"] for e in client.get("/v1/audit").json()]
    assert everything[0] == "release.abandon" and "token.create" in everything
    readers = {
        "anonymous": None,
        "read": make_token(app, ["read"], name="reader"),
        "publish": make_token(app, ["publish"], name="publisher"),
        "scoped admin": make_token(app, ["admin"], ["tiny*"], name="tiny-admin"),
    }
    for who, secret in readers.items():
        with _as(app, secret) as reader:
            seen = reader.get("/v1/audit").json()
            assert [e["action"] for e in seen] == ["release.abandon"], who
            assert "ci" not in reader.get("/v1/audit", params={"limit": 1000}).text, who


def test_a_token_expires_and_is_then_refused_like_a_revoked_one(app: FastAPI, client: TestClient) -> None:
    soon = datetime.now(UTC) + timedelta(seconds=2)
    made = client.post("/v1/tokens", json={"name": "brief", "scopes": ["publish"], "expires_at": soon.isoformat()})
    assert made.status_code == 201, made.text
    assert datetime.fromisoformat(made.json()["expires_at"]) == soon
    listed = {t["name"]: t for t in client.get("/v1/tokens").json()}
    assert datetime.fromisoformat(listed["brief"]["expires_at"]) == soon
    created = next(e for e in client.get("/v1/audit").json() if e["action"] == "token.create")
    assert datetime.fromisoformat(created["details"]["after"]["expires_at"]) == soon
    with _as(app, made.json()["token"]) as brief:
        assert brief.post("/v1/models", json={"name": "tiny"}).status_code == 201  # cached as valid from now on
        time.sleep(max((soon - datetime.now(UTC)).total_seconds(), 0) + 0.1)
        error = assert_error(brief.post("/v1/models", json={"name": "tiny2"}), 401, "INVALID_TOKEN")
        assert "expired" in error["message"]
        app.state.token_cache.clear()  # and when the database is asked afresh
        assert_error(brief.get("/v1/tokens"), 401, "INVALID_TOKEN")


def test_a_token_lives_at_most_the_server_s_maximum(client: TestClient) -> None:
    made = client.post("/v1/tokens", json={"name": "default", "scopes": ["read"]})
    assert made.status_code == 201
    lifetime = datetime.fromisoformat(made.json()["expires_at"]) - datetime.now(UTC)
    assert timedelta(days=364) < lifetime <= timedelta(days=365)
    for when in (datetime.now(UTC) + timedelta(days=366), datetime.now(UTC) - timedelta(seconds=1)):
        spec = {"name": "x", "scopes": ["read"], "expires_at": when.isoformat()}
        assert_error(client.post("/v1/tokens", json=spec), 422, "TOKEN_EXPIRY_INVALID")
    naive = {"name": "x", "scopes": ["read"], "expires_at": "2099-01-01T00:00:00"}
    assert_error(client.post("/v1/tokens", json=naive), 422, "INVALID_INPUT")


def test_without_a_maximum_a_token_may_never_expire(settings: RegistrySettings) -> None:
    app = create_app(settings.model_copy(update={"token_max_lifetime_days": None}))
    with _as(app, make_token(app, ["admin"], name="root")) as root:
        made = root.post("/v1/tokens", json={"name": "forever", "scopes": ["read"]})
        assert made.status_code == 201 and made.json()["expires_at"] is None
        far = (datetime.now(UTC) + timedelta(days=3650)).isoformat()
        assert root.post("/v1/tokens", json={"name": "far", "scopes": ["read"], "expires_at": far}).status_code == 201


@pytest.mark.parametrize("days", [0, -1, 36_501])
def test_the_maximum_lifetime_setting_is_bounded(days: float) -> None:
    with pytest.raises(ValueError, match="token_max_lifetime_days"):
        RegistrySettings(token_max_lifetime_days=days)
