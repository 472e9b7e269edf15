"""HTTP routes for models."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Response

from registry.api.errors import error_responses
from registry.api.params import ModelName
from registry.auth.principal import Principal
from registry.channels.service import model_channel_versions
from registry.deps import PrincipalDep, SessionDep, WriteSessionDep, require
from registry.models import service
from registry.models.schemas import ModelCreate, ModelDetail, ModelOut
from registry.releases.service import list_releases

PUBLISH = require("publish")
router = APIRouter(prefix="/v1", tags=["models"])


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


@router.get("/models", summary="List the models the caller may read")
def list_models(session: SessionDep, principal: PrincipalDep) -> list[ModelOut]:
    return [ModelOut.of(m) for m in service.list_models(session, principal)]


@router.get("/models/{model}", summary="A model with its releases and channels", responses=error_responses(404))
def get_model(model: ModelName, session: SessionDep) -> ModelDetail:
    row = service.get_model(session, model)
    return ModelDetail.of(
        row,
        releases=[r.version for r in list_releases(session, model)],
        channels=model_channel_versions(session, row.id),
    )
