"""HEAD answers as GET does on every route: the same status and headers (the server sends no body).

Every GET route of the app must be reached by one of the representative URLs below (a new GET route
without one fails the test); each URL is asked with GET and HEAD, by an admin and anonymously.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.routing import RouteContext, iter_route_contexts
from starlette.routing import Match
from starlette.testclient import TestClient

from tests.registry.conftest import make_token
from tests.registry.helpers import make_release, post_eval, promote, publish, seal, sha

DATA = b"GGUF tiny weights" * 30
ART = "/v1/models/tiny/releases/1.0/artifacts/gguf-q8"
DIGEST = sha(DATA)
URLS = [
    "/",
    "/healthz",
    "/readyz",
    "/metrics",
    "/v1/models",
    "/v1/models/tiny",
    "/v1/models/nobody",
    "/v1/models/tiny/releases",
    "/v1/models/tiny/releases/1.0",
    "/v1/models/tiny/releases/1.0/artifacts",
    ART,
    f"{ART}/files/model.gguf",
    f"{ART}/attestations",
    f"{ART}/attestations/signature",
    f"{ART}/performance",
    f"/v1/blobs/{DIGEST}",
    f"/v1/blobs/{'0' * 64}",
    "/v1/models/tiny/channels",
    "/v1/models/tiny/channels/prod",
    "/v1/resolve?model=tiny&hardware=cpu",
    "/v1/resolve?model=tiny",
    "/v1/hardware",
    "/v1/hardware/cpu",
    "/v1/audit",
    "/v1/tokens",
    "/v1/keys",
    "/v1/webhooks",
    "/v1/webhooks/1",
    "/v1/webhooks/1/deliveries",
    "/ui/",
    "/ui/static/kiln.css",
    "/ui/models/tiny",
    "/ui/models/tiny/releases/1.0",
    "/ui/models/tiny/releases/1.0/fit?pool=cpu",
    "/ui/models/tiny/channels/prod",
    "/ui/audit",
    "/ui/nothing-here",
    "/v2/",
    "/v2/token",
    "/v2/tiny/manifests/prod-gguf-q8",
    f"/v2/tiny/blobs/sha256:{DIGEST}",
    "/v2/tiny/tags/list",
    f"/v2/tiny/referrers/sha256:{DIGEST}",
    "/v2/tiny/nothing",
    "/api/models/tiny/revision/prod%2Fgguf-q8",
    "/api/models/tiny/tree/prod%2Fgguf-q8",
    "/tiny/resolve/prod%2Fgguf-q8/model.gguf",
    "/kiln/tiny/resolve/prod%2Fgguf-q8/model.gguf",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
]
# Headers that differ between any two requests.
PER_REQUEST = {"date", "x-request-id"}


def _get_routes(app: FastAPI) -> list[RouteContext]:
    return [r for r in iter_route_contexts(app.routes) if "GET" in (r.methods or set())]


def _reached(route: RouteContext, url: str) -> bool:
    scope = {"type": "http", "method": "GET", "path": urlsplit(url).path, "root_path": ""}
    match, _ = route.matches(scope)
    return match == Match.FULL


def test_every_get_route_answers_head_with_the_same_status_and_headers(app: FastAPI, client: TestClient) -> None:
    make_release(client, planned=["gguf-q8"])
    publish(client, "gguf-q8", {"model.gguf": DATA}, ["cpu"])
    assert post_eval(client, "gguf-q8", "passed").status_code == 201
    seal(client)
    assert promote(client).status_code == 200
    unreached = [r.path for r in _get_routes(app) if not any(_reached(r, u) for u in URLS)]
    assert not unreached, f"GET routes without a representative URL: {unreached}"
    reader = make_token(app, ["read"], models=["other-*"], name="other-reader")
    for headers in ({}, {"Authorization": ""}, {"Authorization": f"Bearer {reader}"}):
        for url in URLS:
            got = client.get(url, headers=headers, follow_redirects=False)
            head = client.head(url, headers=headers, follow_redirects=False)
            what = (url, headers, got.status_code, head.status_code, got.text[:200])
            assert head.status_code == got.status_code, what
            same = {k: v for k, v in got.headers.items() if k not in PER_REQUEST}
            if url == "/metrics":  # the counters move between the two requests
                same.pop("content-length")
            assert {k: v for k, v in head.headers.items() if k in same} == same, what
