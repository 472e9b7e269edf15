"""Every mutating route × every kind of caller: the answer each gets, and that a refusal changes nothing.

The routes are enumerated from the app itself, so a new mutating route without a row here fails the
test. Callers: an unrestricted admin, an admin limited to other models (`other-*`), an admin limited to
this model (`tiny-*`), unlimited `publish`, `promote` and `read` tokens, and an anonymous caller (the
registry reads anonymously, as by default). Each row names what an allowed caller may get (the state
moves on as allowed callers act) and each refused cell its exact status; after every refused request
every row of every table and every stored blob object is compared with the state before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from sqlalchemy import select
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.schema import registry_metadata
from kiln.registry.settings import RegistrySettings
from tests.pipeline.test_signing import write_key_pair
from tests.registry.conftest import make_token
from tests.registry.helpers import (
    LLAMA_CONFIG,
    SOURCE_DIGEST,
    assert_error,
    make_release,
    manifest,
    post_eval,
    promote,
    publish,
    seal,
    sha,
    stored_blob_objects,
    upload,
)

MODEL = "tiny-llama"
CALLERS = ("anonymous", "read", "publish", "promote", "other-admin", "this-admin", "admin")
FILES = {"model.gguf": b"tiny-llama q8" * 40}
NEW_BLOB = b"a blob nobody uploaded before"
HOOK_URL = "https://93.184.216.34/kiln"  # a public address: no name to resolve
OK = "ok"


def _row(
    anonymous: int | str, read: int | str, publish: int | str, promote: int | str, other: int | str, this: int | str
) -> dict[str, int | str]:
    """The expected answer per caller; the unrestricted admin may always act."""
    return {
        "anonymous": anonymous,
        "read": read,
        "publish": publish,
        "promote": promote,
        "other-admin": other,
        "this-admin": this,
        "admin": OK,
    }


PUBLISH_HERE = _row(401, 403, OK, 403, 403, OK)  # publish on tiny-llama
PROMOTE_HERE = _row(401, 403, 403, OK, 403, OK)  # promote on tiny-llama (prod is protected)
PUBLISH_ANY = _row(401, 403, OK, 403, OK, OK)  # publish, no model named (a blob upload)
ADMIN_HERE = _row(401, 403, 403, 403, 403, OK)  # admin over tiny-* (tokens, keys, webhooks it creates)
ADMIN_HERE_BY_ID = _row(401, 403, 403, 403, 404, OK)  # an existing one of tiny-*: unseen outside it
ADMIN_OF_ALL = _row(401, 403, 403, 403, 403, 403)  # the hardware catalog
OCI_PUSH = {caller: 405 for caller in CALLERS}  # pull-only: the same answer for everyone


@dataclass
class Setup:
    ids: dict[str, str]
    hardware_cpu: dict[str, Any]
    key_pem: str


@dataclass(frozen=True)
class Row:
    request: Callable[[Setup], tuple[str, dict[str, Any]]]  # url and request arguments
    expected: dict[str, int | str]
    ok: frozenset[int]  # what an allowed caller may get, as the state moves on


def _json(url: str, body: dict[str, Any] | None = None) -> Callable[[Setup], tuple[str, dict[str, Any]]]:
    return lambda _s: (url, {"json": body if body is not None else {}})


REL = f"/v1/models/{MODEL}/releases"
ART = f"{REL}/5.0/artifacts/gguf-q8"
MATRIX: dict[tuple[str, str], Row] = {
    ("POST", "/v1/models"): Row(_json("/v1/models", {"name": MODEL}), PUBLISH_HERE, frozenset({200, 201})),
    ("POST", "/v1/models/{model}/releases"): Row(
        _json(
            REL,
            {
                "version": "3.0",
                "source_digest": SOURCE_DIGEST,
                "planned_artifacts": ["gguf-q8"],
                "lineage": {"source": "hf:tiny"},
                "model_config": LLAMA_CONFIG,
            },
        ),
        PUBLISH_HERE,
        frozenset({200, 201}),
    ),
    ("POST", "/v1/models/{model}/releases/{version}/seal"): Row(
        _json(f"{REL}/2.0/seal"), PUBLISH_HERE, frozenset({200, 201})
    ),
    ("POST", "/v1/models/{model}/releases/{version}/abandon"): Row(
        _json(f"{REL}/4.0/abandon", {"reason": "never built"}), PUBLISH_HERE, frozenset({200, 409})
    ),
    ("POST", "/v1/models/{model}/releases/{version}/yank"): Row(
        _json(f"{REL}/1.1/yank", {"reason": "bad"}), PROMOTE_HERE, frozenset({200, 409})
    ),
    ("POST", "/v1/models/{model}/releases/{version}/artifacts"): Row(
        _json(f"{REL}/5.0/artifacts", manifest("gguf-q8", FILES, ["cpu"])), PUBLISH_HERE, frozenset({200, 201})
    ),
    ("POST", "/v1/models/{model}/releases/{version}/artifacts/{name}/evals"): Row(
        _json(f"{ART}/evals", {"runtime": "llama.cpp", "status": "passed"}), PUBLISH_HERE, frozenset({200, 201})
    ),
    ("POST", "/v1/models/{model}/releases/{version}/artifacts/{name}/attestations"): Row(
        # No key is trusted for tiny-llama: an allowed caller is told so (NO_TRUSTED_KEY).
        _json(f"{ART}/attestations", {"kind": "signature", "sha256": sha(b"a bundle"), "size": 8}),
        PUBLISH_HERE,
        frozenset({422}),
    ),
    ("POST", "/v1/models/{model}/releases/{version}/artifacts/{name}/performance"): Row(
        _json(
            f"{REL}/1.0/artifacts/gguf-q8/performance",
            {
                "hardware": "cpu",
                "runtime": "llama.cpp",
                "runtime_version": "b4000",
                "tp": 1,
                "context": 4096,
                "concurrency": 1,
                "tokens_per_s": 25.0,
                "ttft_ms": 100.0,
                "itl_p50_ms": 40.0,
                "itl_p99_ms": 55.0,
            },
        ),
        PUBLISH_HERE,
        frozenset({201}),
    ),
    ("PUT", "/v1/blobs/{sha256}"): Row(
        lambda _s: (f"/v1/blobs/{sha(NEW_BLOB)}", {"content": NEW_BLOB}), PUBLISH_ANY, frozenset({200, 201})
    ),
    ("POST", "/v1/models/{model}/channels/{channel}"): Row(
        _json(f"/v1/models/{MODEL}/channels/prod", {"version": "1.0"}), PROMOTE_HERE, frozenset({200})
    ),
    ("PUT", "/v1/models/{model}/channels/{channel}/split"): Row(
        _json(f"/v1/models/{MODEL}/channels/prod/split", {"weights": [{"version": "1.0", "weight": 100}]}),
        PROMOTE_HERE,
        frozenset({200}),
    ),
    ("POST", "/v1/keys"): Row(
        lambda s: ("/v1/keys", {"json": {"model_pattern": "tiny-y*", "public_key_pem": s.key_pem}}),
        ADMIN_HERE,
        frozenset({200, 201}),
    ),
    ("POST", "/v1/keys/{key_id}/revoke"): Row(
        lambda s: (f"/v1/keys/{s.ids['key']}/revoke", {"json": {"reason": "rotated"}}),
        ADMIN_HERE_BY_ID,
        frozenset({200}),
    ),
    ("POST", "/v1/tokens"): Row(
        _json("/v1/tokens", {"name": "made", "scopes": ["read"], "models": ["tiny-*"]}), ADMIN_HERE, frozenset({201})
    ),
    ("POST", "/v1/tokens/{token_id}/revoke"): Row(
        lambda s: (f"/v1/tokens/{s.ids['token']}/revoke", {"json": {"reason": "left"}}),
        ADMIN_HERE_BY_ID,
        frozenset({200}),
    ),
    ("POST", "/v1/webhooks"): Row(
        _json("/v1/webhooks", {"url": HOOK_URL, "events": ["channel.promote"], "model_pattern": "tiny-*"}),
        ADMIN_HERE,
        frozenset({201}),
    ),
    ("DELETE", "/v1/webhooks/{webhook_id}"): Row(
        lambda s: (f"/v1/webhooks/{s.ids['webhook']}", {}), ADMIN_HERE_BY_ID, frozenset({200})
    ),
    ("POST", "/v1/webhooks/{webhook_id}/deliveries/{delivery_id}/redeliver"): Row(
        lambda s: (f"/v1/webhooks/{s.ids['webhook']}/deliveries/{s.ids['delivery']}/redeliver", {}),
        ADMIN_HERE_BY_ID,
        frozenset({201, 409}),
    ),
    ("PUT", "/v1/hardware/{name}"): Row(
        lambda s: ("/v1/hardware/cpu", {"json": s.hardware_cpu}), ADMIN_OF_ALL, frozenset({200})
    ),
    ("DELETE", "/v1/hardware/{name}"): Row(lambda _s: ("/v1/hardware/cpu", {}), ADMIN_OF_ALL, frozenset({204, 404})),
    ("POST", "/v2/{path:path}"): Row(_json("/v2/tiny-llama/blobs/uploads/"), OCI_PUSH, frozenset()),
    ("PUT", "/v2/{path:path}"): Row(_json("/v2/tiny-llama/manifests/1.0"), OCI_PUSH, frozenset()),
    ("PATCH", "/v2/{path:path}"): Row(_json("/v2/tiny-llama/blobs/uploads/x"), OCI_PUSH, frozenset()),
    ("DELETE", "/v2/{path:path}"): Row(_json("/v2/tiny-llama/manifests/1.0"), OCI_PUSH, frozenset()),
}
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}


def mutating_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path) of every route of the app that may change something, from its routing table."""
    return {
        (method, str(route.path))
        for route in iter_route_contexts(app.routes)
        for method in (route.methods or set()) & MUTATING
    }


def _snapshot(app: FastAPI, settings: RegistrySettings) -> dict[str, Any]:
    """Every row of every table, and every object in the blob store."""
    with app.state.session_factory() as session:
        rows = {
            table.name: sorted(repr(tuple(r)) for r in session.execute(select(table)).all())
            for table in registry_metadata().sorted_tables
        }
    return {"rows": rows, "blobs": stored_blob_objects(settings)}


def _seed(app: FastAPI, root: TestClient, tmp_path: Path) -> Setup:
    """tiny-llama: 1.0 sealed on prod, 1.1 sealed, 2.0 open and complete, 4.0 open and empty, 5.0 open
    with its artifact; other-model; a token, a key and a webhook of tiny-*, with a delivery."""
    webhook = root.post(
        "/v1/webhooks", json={"url": HOOK_URL, "events": ["channel.promote"], "model_pattern": "tiny-*"}
    )
    assert webhook.status_code == 201, webhook.text
    for version, state in (
        ("1.0", "sealed"),
        ("1.1", "sealed"),
        ("2.0", "complete"),
        ("4.0", "empty"),
        ("5.0", "open"),
    ):
        make_release(root, model=MODEL, version=version, planned=["gguf-q8"])
        if state != "empty":
            publish(root, "gguf-q8", FILES, ["cpu"], model=MODEL, version=version)
        if state in ("sealed", "complete"):
            assert post_eval(root, "gguf-q8", "passed", model=MODEL, version=version).status_code == 201
        if state == "sealed":
            seal(root, version, model=MODEL)
    assert promote(root, "1.0", model=MODEL).status_code == 200
    make_release(root, model="other-model", planned=["gguf-q8"])
    upload(root, b"a bundle")
    (tmp_path / "victim").mkdir()
    (tmp_path / "new").mkdir()
    victim_pem = write_key_pair(tmp_path / "victim")[1].read_text()
    key = root.post("/v1/keys", json={"model_pattern": "tiny-z*", "public_key_pem": victim_pem})
    assert key.status_code == 201, key.text
    token = root.post("/v1/tokens", json={"name": "victim", "scopes": ["read"], "models": ["tiny-*"]})
    deliveries = root.get(f"/v1/webhooks/{webhook.json()['id']}/deliveries").json()
    assert deliveries, "the promotion queued a delivery"
    cpu = {k: v for k, v in root.get("/v1/hardware/cpu").json().items() if k != "source"}
    return Setup(
        ids={
            "key": key.json()["key_id"],
            "token": str(token.json()["id"]),
            "webhook": str(webhook.json()["id"]),
            "delivery": str(deliveries[0]["id"]),
        },
        hardware_cpu=cpu,
        key_pem=write_key_pair(tmp_path / "new")[1].read_text(),
    )


def test_every_mutating_route_answers_every_caller_as_its_scope_says(
    settings: RegistrySettings, tmp_path: Path
) -> None:
    settings = settings.model_copy(update={"webhook_delivery": False})
    app = create_app(settings)
    routes = mutating_routes(app)
    assert routes == set(MATRIX), (
        f"mutating routes without a row: {sorted(routes - set(MATRIX))}; rows without a route: "
        f"{sorted(set(MATRIX) - routes)}"
    )
    tokens = {
        "admin": make_token(app, ["admin"], name="root"),
        "this-admin": make_token(app, ["admin"], ["tiny-*"], name="tiny-admin"),
        "other-admin": make_token(app, ["admin"], ["other-*"], name="other-admin"),
        "publish": make_token(app, ["publish"], name="ci"),
        "promote": make_token(app, ["promote"], name="release-manager"),
        "read": make_token(app, ["read"], name="reader"),
    }
    with TestClient(app) as bare:
        root = TestClient(app, headers={"Authorization": f"Bearer {tokens['admin']}"})
        setup = _seed(app, root, tmp_path)
        state = _snapshot(app, settings)
        cells = refused_cells = 0
        for (method, path), row in MATRIX.items():
            url, kwargs = row.request(setup)
            for caller in CALLERS:
                headers = {"Authorization": f"Bearer {tokens[caller]}"} if caller in tokens else {}
                response = bare.request(method, url, headers=headers, **kwargs)
                expected = row.expected[caller]
                cell = (method, path, caller, response.status_code, response.text[:300])
                cells += 1
                if expected == OK:
                    assert response.status_code in row.ok, cell
                    state = _snapshot(app, settings)
                    continue
                refused_cells += 1
                assert response.status_code == expected, cell
                if path.startswith("/v2/"):
                    assert response.json()["errors"][0]["code"] == "UNSUPPORTED", cell
                else:
                    code = {401: "UNAUTHORIZED", 403: "FORBIDDEN", 404: "NOT_FOUND"}[int(expected)]
                    assert_error(response, int(expected), code)
                after = _snapshot(app, settings)
                assert after == state, cell
        assert cells == len(MATRIX) * len(CALLERS) and refused_cells > cells // 2
