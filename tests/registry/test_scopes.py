"""Scopes hold everywhere: a token grants only what it has, and a token limited to model patterns
sees nothing of other models, by any route (path, query, blob digest, pages, audit, lists)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.auth.patterns import pattern_contains
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error, make_release, post_eval, promote, publish, seal, sha

WEIGHTS = b"tiny-llama weights" * 10


@pytest.fixture
def closed(settings: RegistrySettings) -> FastAPI:
    """A registry with anonymous read off, holding tiny-llama@1.0 on prod and other-model@1.0 on prod."""
    app = create_app(settings.model_copy(update={"anonymous_read": False}))
    with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['admin'], name='root')}"}) as admin:
        for model, data in (("tiny-llama", WEIGHTS), ("other-model", b"other weights")):
            make_release(admin, model=model, planned=["gguf-q8"])
            publish(admin, "gguf-q8", {"model.gguf": data}, ["cpu"], model=model)
            post_eval(admin, "gguf-q8", "passed", model=model)
            seal(admin, model=model)
            assert promote(admin, model=model, actor="ci").status_code == 200
    return app


def _as(app: FastAPI, token: str) -> TestClient:
    return TestClient(app, headers={"Authorization": f"Bearer {token}"})


def test_a_limited_admin_grants_only_within_its_patterns(closed: FastAPI) -> None:
    unlimited = make_token(closed, ["admin"], name="everything")
    limited = make_token(closed, ["admin"], models=["other-*"], name="other-admin")
    with _as(closed, limited) as other_admin:
        for body in (
            {"name": "x", "scopes": ["admin"]},  # no models: every model
            {"name": "x", "scopes": ["read"], "models": ["*"]},
            {"name": "x", "scopes": ["read"], "models": ["tiny-llama"]},
            {"name": "x", "scopes": ["read"], "models": ["other-*", "tiny-*"]},
            {"name": "x", "scopes": ["read"], "models": ["o*"]},
            {"name": "x", "scopes": ["read"], "models": ["other*"]},
            {"name": "x", "scopes": ["read"], "models": ["[ot]ther-*"]},
        ):
            assert_error(other_admin.post("/v1/tokens", json=body), 403, "FORBIDDEN")
        # Containment is computed: a bracket or `?` that stays within other-* is granted.
        for models in (["other-*"], ["other-model"], ["other-m*"], ["other-[a-z]*"], ["[o]ther-?"]):
            made = other_admin.post("/v1/tokens", json={"name": "ok", "scopes": ["publish"], "models": models})
            assert made.status_code == 201, (models, made.text)
        listed = other_admin.get("/v1/tokens").json()
        assert listed and all(t["models"] and all(pattern_contains("other-*", m) for m in t["models"]) for t in listed)
        everything_id = next(t["id"] for t in _as(closed, unlimited).get("/v1/tokens").json() if t["name"] == "root")
        assert_error(other_admin.post(f"/v1/tokens/{everything_id}/revoke", json={}), 404, "NOT_FOUND")
    with _as(closed, unlimited) as root:
        assert root.get("/v1/models/tiny-llama").status_code == 200  # the root token still works
        assert {t["name"] for t in root.get("/v1/tokens").json()} >= {"root", "other-admin", "ok"}


def test_a_token_grants_no_scope_it_lacks() -> None:
    from kiln.core.errors import Forbidden
    from kiln.registry.auth.principal import Principal

    publisher = Principal("token:p", frozenset({"publish"}))
    with pytest.raises(Forbidden):
        publisher.check_grant(["admin"], [])
    with pytest.raises(Forbidden):
        publisher.check_grant(["promote"], [])
    publisher.check_grant(["publish", "read"], ["m"])


def test_a_read_token_for_other_models_reads_nothing_of_this_one(closed: FastAPI) -> None:
    reader = make_token(closed, ["read"], models=["other-*"], name="other-reader")
    blob = sha(WEIGHTS)
    refused: list[tuple[str, dict[str, Any]]] = [
        ("/v1/resolve", {"model": "tiny-llama", "hardware": "cpu"}),
        ("/v1/resolve", {"model": ["other-model", "tiny-llama"], "hardware": "cpu"}),  # repeated ?model=
        ("/v1/audit", {"model": "tiny-llama"}),
        ("/v1/models/tiny-llama", {}),
        ("/v1/models/tiny-llama/releases/1.0/artifacts/gguf-q8/files/model.gguf", {}),
        ("/ui/audit", {"model": "tiny-llama"}),
        ("/ui/models/tiny-llama", {}),
        ("/ui/models/tiny-llama/releases/1.0/fit", {"pool": "cpu"}),
    ]
    with _as(closed, reader) as other:
        for path, params in refused:
            response = other.get(path, params=params)
            assert response.status_code == 403, (path, params, response.text[:200])
        for method in ("GET", "HEAD"):
            assert other.request(method, f"/v1/blobs/{blob}").status_code == 404
        hub = other.get("/tiny-llama/resolve/prod%2Fgguf-q8/model.gguf")
        assert hub.status_code == 403
        # Lists and logs show only its models.
        assert [m["name"] for m in other.get("/v1/models").json()] == ["other-model"]
        audit = other.get("/v1/audit").json()
        assert audit and {e["model"] for e in audit} == {"other-model"}
        page = other.get("/ui/").text
        assert "other-model" in page and "tiny-llama" not in page
        audit_page = other.get("/ui/audit").text
        assert "other-model" in audit_page and "tiny-llama" not in audit_page and "token.create" not in audit_page
        # What it may read, it reads.
        assert other.get("/v1/resolve", params={"model": "other-model", "hardware": "cpu"}).status_code == 200
        assert other.get(f"/v1/blobs/{sha(b'other weights')}").content == b"other weights"
    everyone = make_token(closed, ["read"], name="reader")
    with _as(closed, everyone) as reader_all:
        assert reader_all.get(f"/v1/blobs/{blob}").content == WEIGHTS
        assert reader_all.head(f"/v1/blobs/{blob}").status_code == 200
