"""Liveness/readiness."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy import text

from registry.api.errors import error_responses
from registry.deps import SessionDep

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str


@router.get("/healthz", summary="Liveness and database reachability", responses=error_responses(503))
def healthz(session: SessionDep) -> Health:
    session.execute(text("SELECT 1"))
    return Health(status="ok")
