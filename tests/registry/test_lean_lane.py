"""The lean lane answers resolve in front of FastAPI's stack: with the same checks, errors and
documentation as a FastAPI route, and it refuses to carry a route whose checks it cannot run."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from starlette.testclient import TestClient

from kiln.registry.api.lean_route import MAX_QUERY_BYTES, LeanLane, LeanRoute
from kiln.registry.app import create_app
from kiln.registry.deps import require
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error
from tests.registry.test_api_resolve import seed


def test_resolve_is_answered_by_the_lane_and_counted_under_its_route(client: TestClient) -> None:
    seed(client)
    answer = client.get("/v1/resolve", params={"model": "tiny", "hardware": "h100"})
    assert answer.status_code == 200, answer.text
    # The app's own middleware still wraps it: request id, security headers, metrics, access log.
    assert answer.headers["x-request-id"] and answer.headers["x-content-type-options"] == "nosniff"
    metrics = client.get("/metrics").text
    assert 'route="/v1/resolve",status="200"' in metrics


def test_the_lane_answers_errors_like_any_route(client: TestClient) -> None:
    seed(client)
    invalid = client.get("/v1/resolve", params={"model": "tiny", "hardware": "h100", "context": "-1"})
    assert_error(invalid, 422, "INVALID_INPUT")
    assert invalid.json()["error"]["details"]["errors"][0]["loc"] == ["query", "context"]
    assert_error(client.get("/v1/resolve", params={"hardware": "h100"}), 422, "INVALID_INPUT")
    assert_error(client.get("/v1/resolve", params={"model": "nope", "hardware": "h100"}), 404, "NOT_FOUND")
    # Other methods and paths go on to FastAPI.
    assert client.post("/v1/resolve", params={"model": "tiny", "hardware": "h100"}).status_code == 405
    assert client.get("/v1/resolve/").status_code in (307, 404)


def test_the_lane_runs_the_read_check_and_the_model_pattern(settings: RegistrySettings) -> None:
    app = create_app(settings.model_copy(update={"anonymous_read": False}))
    with TestClient(app) as client:
        admin = make_token(app, ["admin"], name="admin")
        seed(TestClient(app, headers={"Authorization": f"Bearer {admin}"}))
        params = {"model": "tiny", "hardware": "h100"}
        assert_error(client.get("/v1/resolve", params=params), 401, "UNAUTHORIZED")
        other = make_token(app, ["read"], models=["other-*"], name="other")
        refused = client.get("/v1/resolve", params=params, headers={"Authorization": f"Bearer {other}"})
        assert_error(refused, 403, "FORBIDDEN")
        # A repeated ?model= cannot slip a second model past the check.
        both = client.get(
            "/v1/resolve?model=other-x&model=tiny&hardware=h100", headers={"Authorization": f"Bearer {other}"}
        )
        assert both.status_code == 403, both.text
        reader = make_token(app, ["read"], models=["tiny"], name="reader")
        allowed = client.get("/v1/resolve", params=params, headers={"Authorization": f"Bearer {reader}"})
        assert allowed.status_code == 200, allowed.text
        # The lane keeps a valid query string's parse, never its verdict: the same query is checked again.
        again = client.get("/v1/resolve", params=params, headers={"Authorization": f"Bearer {other}"})
        assert_error(again, 403, "FORBIDDEN")
        assert_error(client.get("/v1/resolve", params=params), 401, "UNAUTHORIZED")
        invalid = {**params, "context": "0"}
        for _ in range(2):  # an invalid query is refused each time, after the read check
            assert_error(client.get("/v1/resolve", params=invalid), 401, "UNAUTHORIZED")
            refused = client.get("/v1/resolve", params=invalid, headers={"Authorization": f"Bearer {reader}"})
            assert_error(refused, 422, "INVALID_INPUT")


def test_resolve_is_documented_with_its_errors(client: TestClient) -> None:
    operation = client.get("/openapi.json").json()["paths"]["/v1/resolve"]["get"]
    assert {"200", "401", "403", "404", "422"} <= set(operation["responses"])
    assert {p["name"] for p in operation["parameters"]} >= {"model", "hardware", "channel", "context"}


def _lean_router(*dependencies: Any) -> APIRouter:
    router = APIRouter(route_class=LeanRoute, dependencies=list(dependencies))

    @router.get("/hot")
    async def hot(request: Request, n: Annotated[int, Query(ge=1)] = 1) -> Response:
        return Response(str(n))

    return router


async def _other_check(request: Request) -> None:
    return None


def test_the_lane_refuses_routes_whose_checks_it_cannot_run() -> None:
    app = FastAPI()
    with pytest.raises(TypeError, match="require"):
        LeanLane(app, _lean_router(Depends(_other_check)).routes)
    plain = APIRouter()

    @plain.get("/plain")
    async def plain_route() -> None:
        return None

    with pytest.raises(TypeError, match="LeanRoutes"):
        LeanLane(app, plain.routes)
    with_path = APIRouter(route_class=LeanRoute)

    @with_path.get("/hot/{name}")
    async def hot(request: Request, name: str) -> Response:
        return Response(name)

    with pytest.raises(TypeError, match="path parameters"):
        LeanLane(app, with_path.routes)
    LeanLane(app, _lean_router(require("read")).routes)  # require() checks are what it runs


def test_the_lane_strips_the_root_path() -> None:
    app = FastAPI()
    router = _lean_router()  # not included: only the lane can answer it
    app.add_middleware(LeanLane, routes=router.routes)
    with TestClient(app, root_path="/registry") as client:
        assert client.get("/hot", params={"n": 3}).text == "3"


def test_the_lane_keeps_queries_by_what_they_ask_and_refuses_long_ones(client: TestClient) -> None:
    """4,000 resolves with distinct 60 KiB junk parameters grew a server from 174 to 400 MiB: the lane
    kept every query string. It now keeps the declared parameters' values, and refuses a query string
    over `MAX_QUERY_BYTES`."""
    seed(client)
    base = "/v1/resolve?model=tiny&hardware=h100"
    long = client.get(f"{base}&junk={'j' * (60 * 1024)}")
    assert assert_error(long, 422, "QUERY_TOO_LONG")["details"] == {"max_bytes": MAX_QUERY_BYTES}
    first = client.get(base)
    assert first.status_code == 200, first.text
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(300):  # junk just under the limit, different each time: 2 MiB if it were kept
            junk = client.get(f"{base}&junk{i}={'j' * (MAX_QUERY_BYTES - 100)}")
            assert junk.status_code == 200 and junk.content == first.content
        gc.collect()
        grown = tracemalloc.take_snapshot().compare_to(before, "filename")
    finally:
        tracemalloc.stop()
    kept = sum(s.size_diff for s in grown)
    assert kept < 512 * 1024, kept
