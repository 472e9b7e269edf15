"""HTTP routes for the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from registry.api.params import MODEL_NAME_PATTERN, PageLimit
from registry.audit import service
from registry.audit.schemas import AuditEventOut
from registry.deps import PrincipalDep, SessionDep
from registry.paging import PAGE_LIMIT

router = APIRouter(prefix="/v1", tags=["audit"])


@router.get(
    "/audit",
    summary="Audit events about the models the caller may read (an admin of all models: every event)",
)
def list_audit_events(
    session: SessionDep,
    principal: PrincipalDep,
    model: Annotated[str | None, Query(pattern=MODEL_NAME_PATTERN)] = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[AuditEventOut]:
    return [AuditEventOut.of(e) for e in service.list_events(session, principal, model, limit)]
