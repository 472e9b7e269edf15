"""HTTP routes for measured performance records (publish scope to post, read to list)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from kiln.core.performance import PerformanceCreate, PerformanceOut
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterId, ArtifactName, ModelName, PageLimit, Version
from kiln.registry.deps import PrincipalDep, SessionDep, WriteSessionDep, require
from kiln.registry.paging import PAGE_LIMIT
from kiln.registry.performance import service
from kiln.registry.performance.models import PerformanceRecord

router = APIRouter(prefix="/v1", tags=["performance"], route_class=SessionRoute)
PATH = "/models/{model}/releases/{version}/artifacts/{name}/performance"


def _out(row: PerformanceRecord, artifact: str) -> PerformanceOut:
    fields = {name: getattr(row, name) for name in PerformanceOut.model_fields if name != "artifact"}
    return PerformanceOut(**fields, artifact=artifact)


@router.post(
    PATH,
    dependencies=[require("publish")],
    status_code=201,
    summary="Record a measured serving performance of an artifact on one SKU (resolve prefers it to estimates)",
    responses=error_responses(404, 409, 422),
)
def post_performance(
    model: ModelName,
    version: Version,
    name: ArtifactName,
    spec: PerformanceCreate,
    session: WriteSessionDep,
    principal: PrincipalDep,
) -> PerformanceOut:
    row = service.post_record(session, model, version, name, spec, principal.name)
    session.commit()
    return _out(row, name)


@router.get(
    PATH,
    summary="An artifact's measured performance records, newest first, a page at a time",
    responses={**PAGED, **error_responses(404)},
)
def list_performance(
    model: ModelName,
    version: Version,
    name: ArtifactName,
    request: Request,
    response: Response,
    session: SessionDep,
    after: AfterId = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[PerformanceOut]:
    page = service.records_page(session, model, version, name, after, limit)
    return [_out(r, name) for r in page_rows(request, response, page, limit)]
