"""One parser per boundary: every body a route takes becomes data through the strict parser, whatever
its Content-Type says, and nothing stored is answered with a 500 when read back.

The routes are enumerated from the app, so a new body-taking route is covered without editing this file.
Requests go to a real server over a socket: the test client re-encodes header values as UTF-8, so it
cannot send the Latin-1 bytes (0x85, 0xA0) a client on the wire can.
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from sqlalchemy import func, select, update
from starlette.testclient import TestClient

from kiln.registry.api.boundary import STREAMED_BODY
from kiln.registry.artifacts.models import Artifact
from kiln.registry.releases.models import Release
from kiln.registry.schema import registry_metadata
from tests.registry.helpers import SOURCE_DIGEST, make_release, post_eval, promote, publish, seal, serve_in_thread

RELEASE = "/v1/models/tiny/releases/1.0"
DEEP = "[" * 300 + "]" * 300
HUGE = "9" * 4000

# Every character `str.strip()` removes that can travel in a header value (not CR or LF), the ones an
# ASCII-minded reader keeps (U+0085, U+00A0, U+001C..U+001F) among them.
STRIPPED = [chr(c) for c in range(256) if chr(c).isspace() and chr(c) not in "\r\n"]
SPELLINGS: list[bytes | None] = [
    None,
    b"application/json",
    b"application/json; charset=utf-8",
    b"text/plain",
    b"application/octet-stream",
    b"application/ld+json\xa0",
    b"application/ld+json\x85",
    b"APPLICATION/JSON\xa0",
    *(f"{ws}application/json".encode("latin-1") for ws in STRIPPED),
    *(f"application/json{ws}".encode("latin-1") for ws in STRIPPED),
]
# Bodies Python's json.loads takes and the registry must not: each a storable-looking document.
HOSTILE: dict[str, str] = {
    "duplicate key": '{"name": "m", "description": "a", "description": "b"}',
    "NUL": '{"name": "m", "description": "a\\u0000b"}',
    "NaN": '{"name": "m", "lineage": {"x": NaN}}',
    "Infinity": '{"name": "m", "lineage": {"x": -Infinity}}',
    "300 deep": '{"name": "m", "lineage": {"x": ' + DEEP + "}}",
    "4,000 digits": '{"name": "m", "lineage": {"x": ' + HUGE + "}}",
}
PATH_VALUES = {"model": "tiny", "version": "1.0", "name": "gguf-q8", "channel": "prod"}


def body_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, concrete path) of every route of the app that takes a request body."""
    found: list[tuple[str, str]] = []
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if not isinstance(route, APIRoute) or route.body_field is None:
            continue
        path = re.sub(r"\{(\w+)\}", lambda m: PATH_VALUES.get(m.group(1), "1"), str(context.path))
        found.extend((method, path) for method in sorted(route.methods or ()))
    return found


def row_counts(app: FastAPI) -> dict[str, int]:
    with app.state.session_factory() as session:
        return {
            t.name: session.scalar(select(func.count()).select_from(t)) or 0 for t in registry_metadata().sorted_tables
        }


class Wire:
    """Requests with header values sent as the bytes given, on one kept-alive connection."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def send(self, method: str, path: str, body: str, content_type: bytes | None) -> tuple[int, dict[str, Any]]:
        """The status and the JSON answer (empty when the server refused the request before the app)."""
        self.conn.putrequest(method, path, skip_accept_encoding=True)
        self.conn.putheader("Authorization", f"Bearer {self.token}")
        if content_type is not None:
            self.conn.putheader("Content-Type", content_type)
        data = body.encode()
        self.conn.putheader("Content-Length", str(len(data)))
        self.conn.endheaders(data)
        response = self.conn.getresponse()
        raw = response.read()
        if response.will_close:
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        answer = json.loads(raw) if response.getheader("content-type") == "application/json" else {}
        return response.status, answer


@pytest.fixture
def wire(app: FastAPI, client: TestClient, admin_token: str) -> Iterator[Wire]:
    with serve_in_thread(app) as port:
        wire = Wire(port, admin_token)
        yield wire
        wire.conn.close()


def refused_as_json(status: int, answer: dict[str, Any]) -> bool:
    """Refused by the strict parser (422 INVALID_JSON), or by the server before the app (400: h11 takes no
    control character in a header value)."""
    return (status, answer.get("error", {}).get("code")) == (422, "INVALID_JSON") or (status == 400 and not answer)


def test_every_body_route_is_parsed_strictly(app: FastAPI) -> None:
    routes = body_routes(app)
    assert ("POST", "/v1/models/tiny/releases") in routes and ("PUT", "/v1/hardware/gguf-q8") in routes
    for method, path in routes:
        assert method not in ("GET", "HEAD", "OPTIONS"), (method, path)  # the boundary reads no body of these
        assert not STREAMED_BODY.fullmatch(path), path  # nor of a streamed upload


def test_no_header_spelling_bypasses_the_strict_parser(app: FastAPI, client: TestClient, wire: Wire) -> None:
    make_release(client)
    before = row_counts(app)
    reached = 0
    for method, path in body_routes(app):
        for spelling in SPELLINGS:
            for what, text in HOSTILE.items():
                status, answer = wire.send(method, path, text, spelling)
                assert refused_as_json(status, answer), (method, path, spelling, what, status, answer)
                reached += status == 422
    assert reached > len(body_routes(app)) * len(HOSTILE) * 10  # most spellings reach the app
    assert row_counts(app) == before


@pytest.mark.parametrize("spelling", [b"application/json\xa0", b"\xa0application/json", b"application/json\x85"])
def test_a_release_with_hostile_lineage_is_refused_in_any_spelling(
    client: TestClient, wire: Wire, spelling: bytes
) -> None:
    client.post("/v1/models", json={"name": "tiny"})
    for value in (DEEP, HUGE, "NaN", "Infinity"):
        text = (
            '{"version": "1.0", "source_digest": "' + SOURCE_DIGEST + '", "planned_artifacts": ["gguf-q8"], '
            '"lineage": {"source": ' + value + "}}"
        )
        assert wire.send("POST", "/v1/models/tiny/releases", text, spelling)[1]["error"]["code"] == "INVALID_JSON"
    description = '{"name": "other", "description": "a\\u0000b"}'
    assert wire.send("POST", "/v1/models", description, spelling)[1]["error"]["code"] == "INVALID_JSON"
    assert client.get("/v1/models/tiny/releases").json() == []


def test_stored_json_is_bounded_at_the_model_layer() -> None:
    """A value built in code, not parsed from a body, meets the same bounds."""
    from pydantic import ValidationError

    from kiln.registry.releases.schemas import ReleaseCreate

    base = {"version": "1.0", "source_digest": SOURCE_DIGEST, "planned_artifacts": ["gguf-q8"]}
    deep: Any = []
    for _ in range(300):
        deep = [deep]
    for bad in (
        {"lineage": {"x": deep}},
        {"lineage": {"x": 2**64}},
        {"lineage": {"x": -(2**63) - 1}},
        {"lineage": {"x": float("nan")}},
        {"lineage": {"x": float("inf")}},
        {"lineage": {"x": "a\x00b"}},
        {"model_config": {"n": deep}},
    ):
        with pytest.raises(ValidationError):
            ReleaseCreate.model_validate({**base, **bad})
    assert ReleaseCreate.model_validate({**base, "lineage": {"x": [[1, 2.5, None, True, "s"]]}}).lineage


@pytest.mark.parametrize("field", ["lineage", "model_config"])
def test_a_stored_value_too_deep_or_too_large_does_not_break_reads(
    app: FastAPI, client: TestClient, field: str
) -> None:
    """As an older registry could have stored: the reads answer, the value reported with a code."""
    make_release(client, version="1.0")
    make_release(client, version="2.0")
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    with app.state.session_factory() as session:
        session.execute(update(Release).where(Release.version == "1.0").values({field: {"x": deep}}))
        session.execute(update(Release).where(Release.version == "2.0").values({field: {"x": 10**3999}}))
        session.commit()
    listing = client.get("/v1/models/tiny/releases")
    assert listing.status_code == 200, listing.text[:300]
    for release in listing.json():
        assert release[field]["error"]["code"] == "STORED_VALUE_UNREADABLE", release[field]
    for version in ("1.0", "2.0"):
        detail = client.get(f"/v1/models/tiny/releases/{version}")
        assert detail.status_code == 200, detail.text[:300]
        assert detail.json()[field]["error"]["code"] == "STORED_VALUE_UNREADABLE"
        page = client.get(f"/ui/models/tiny/releases/{version}")
        assert page.status_code == 200, page.text[:300]
    assert client.get("/ui/models/tiny").status_code == 200


def test_an_artifact_runtime_stored_past_the_bounds_does_not_break_reads(app: FastAPI, client: TestClient) -> None:
    """An artifact's runtime as an older registry could have stored it: the release, the artifact, resolve and the
    release's page answer, the value reported with a code where it stood; the row is left as it was."""
    make_release(client, version="1.0")
    publish(client, "gguf-q8", {"model.gguf": b"weights"}, ["h100"])
    assert post_eval(client, "gguf-q8", "passed", metrics={}).status_code in (200, 201)
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    with app.state.session_factory() as session:
        session.execute(update(Artifact).where(Artifact.name == "gguf-q8").values(runtime={"x": deep}))
        session.commit()
    seal(client)
    assert promote(client).status_code == 200
    unreadable = "STORED_VALUE_UNREADABLE"
    release = client.get("/v1/models/tiny/releases/1.0")
    assert release.status_code == 200, release.text[:300]
    assert release.json()["artifacts"][0]["runtime"]["error"]["code"] == unreadable
    listing = client.get("/v1/models/tiny/releases/1.0/artifacts")
    assert listing.status_code == 200 and listing.json()[0]["runtime"]["error"]["code"] == unreadable
    detail = client.get("/v1/models/tiny/releases/1.0/artifacts/gguf-q8")
    assert detail.status_code == 200 and detail.json()["manifest"]["runtime"]["error"]["code"] == unreadable
    resolved = client.get("/v1/resolve", params={"model": "tiny", "hardware": "h100"})
    assert resolved.status_code == 200, resolved.text[:300]
    assert resolved.json()["artifact"]["runtime"]["error"]["code"] == unreadable
    assert client.get("/ui/models/tiny/releases/1.0").status_code == 200
    with app.state.session_factory() as session:
        assert session.scalars(select(Artifact.runtime)).one() == {"x": deep}
