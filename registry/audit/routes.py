"""HTTP routes for the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from kiln.core.access import AuditEventOut
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import MODEL_NAME_PATTERN, AfterId, PageLimit
from kiln.registry.audit import service
from kiln.registry.deps import PrincipalDep, SessionDep
from kiln.registry.paging import PAGE_LIMIT

router = APIRouter(prefix="/v1", tags=["audit"], route_class=SessionRoute)


@router.get(
    "/audit",
    summary="Audit events about the models the caller may read (an admin of all models: every event), newest "
    "first, a page at a time",
    responses=PAGED,
)
def list_audit_events(
    request: Request,
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
    model: Annotated[str | None, Query(pattern=MODEL_NAME_PATTERN)] = None,
    after: AfterId = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[AuditEventOut]:
    page = service.events_page(session, principal, model, after, limit)
    return [AuditEventOut.of(e) for e in page_rows(request, response, page, limit)]
