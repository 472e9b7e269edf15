"""HTTP routes for models."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request, Response

from kiln.core.releases import ModelDetail, ModelOut
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterModel, AfterVersion, ModelName, PageLimit
from kiln.registry.auth.principal import Principal
from kiln.registry.channels.service import model_channel_versions
from kiln.registry.deps import PrincipalDep, SessionDep, WriteSessionDep, require
from kiln.registry.models import service
from kiln.registry.models.schemas import ModelCreate
from kiln.registry.paging import PAGE_LIMIT
from kiln.registry.releases.service import releases_page

PUBLISH = require("publish")
router = APIRouter(prefix="/v1", tags=["models"], route_class=SessionRoute)


@router.post(
    "/models",
    status_code=201,
    summary="Create a model (200 if an identical one exists)",
    responses={200: {"model": ModelOut, "description": "the model already existed"}, **error_responses(409, 422)},
)
def create_model(
    spec: ModelCreate, session: WriteSessionDep, response: Response, principal: Annotated[Principal, PUBLISH]
) -> ModelOut:
    principal.require("publish", spec.name)  # a token limited to model patterns creates only those
    row, created = service.create_model(session, spec)
    session.commit()
    if not created:
        response.status_code = 200
    return ModelOut.of(row)


@router.get("/models", summary="List the models the caller may read, by name, a page at a time", responses=PAGED)
def list_models(
    request: Request,
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
    after: AfterModel = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[ModelOut]:
    page = service.models_page(session, principal, after, limit)
    return [ModelOut.of(m) for m in page_rows(request, response, page, limit)]


@router.get(
    "/models/{model}",
    summary="A model with its channels and its releases' versions, newest first, a page at a time",
    responses={**PAGED, **error_responses(404)},
)
def get_model(
    model: ModelName,
    request: Request,
    response: Response,
    session: SessionDep,
    after: AfterVersion = None,
    limit: PageLimit = PAGE_LIMIT,
) -> ModelDetail:
    row = service.get_model(session, model)
    page = releases_page(session, model, after, limit)
    return ModelDetail.of(
        row,
        releases=[r.version for r in page_rows(request, response, page, limit, lambda r: r.version)],
        channels=model_channel_versions(session, row.id),
    )
