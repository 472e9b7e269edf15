"""Liveness, readiness and metrics: what an orchestrator and a Prometheus server poll.

- `/healthz`: the process answers (no dependencies: a restart would not fix a database outage).
- `/readyz`: the database answers a query and the blob store answers a lookup; 503 with
  Retry-After otherwise, so a load balancer takes the worker out until they return.
- `/metrics`: Prometheus text format (requests, latencies, bytes served, publishes).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from sqlalchemy import text

from kiln.core.errors import KilnError, Unavailable
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.deps import BlobStoreDep, SessionDep

router = APIRouter(tags=["health"], route_class=SessionRoute)
_PROBE = "0" * 64  # a digest no blob has: looking it up exercises the store without reading data


class Health(BaseModel):
    status: str
    checks: dict[str, str] = {}


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> Health:
    # On the event loop, not in the thread pool: it answers while every thread waits on the database.
    return Health(status="ok")


@router.get("/readyz", summary="Readiness: database and blob store reachable", responses=error_responses(503))
def readyz(session: SessionDep, store: BlobStoreDep) -> Health:
    checks: dict[str, str] = {}
    try:
        session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready; the type names it
        checks["database"] = f"unavailable ({type(exc).__name__})"
    try:
        store.exists(_PROBE)
        checks["blob_store"] = "ok"
    except (KilnError, OSError) as exc:
        checks["blob_store"] = f"unavailable ({type(exc).__name__})"
    if any(v != "ok" for v in checks.values()):
        raise Unavailable("registry not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()), details=checks)
    return Health(status="ready", checks=checks)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(request: Request) -> Any:
    request.app.state.request_log.flush()  # this process's requests so far, not up to a flush behind
    body = request.app.state.metrics.exposition()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
