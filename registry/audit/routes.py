"""HTTP routes for the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from registry.api.params import MODEL_NAME_PATTERN
from registry.audit import service
from registry.audit.schemas import AuditEventOut
from registry.deps import PrincipalDep, SessionDep

router = APIRouter(prefix="/v1", tags=["audit"])


@router.get(
    "/audit",
    summary="Audit events about the models the caller may read (an admin of all models: every event)",
)
def list_audit_events(
    session: SessionDep,
    principal: PrincipalDep,
    model: Annotated[str | None, Query(pattern=MODEL_NAME_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[AuditEventOut]:
    return [AuditEventOut.of(e) for e in service.list_events(session, principal, model, limit)]
