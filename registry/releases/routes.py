"""HTTP routes for releases."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Response
from sqlalchemy.orm import selectinload

from registry.api.errors import error_responses
from registry.api.params import ModelName, Version
from registry.artifacts.models import Artifact
from registry.artifacts.schemas import ArtifactSummary
from registry.auth.principal import Principal
from registry.channels.service import channels_of_release
from registry.deps import SessionDep, require
from registry.releases import service
from registry.releases.models import Release
from registry.releases.schemas import ReleaseCreate, ReleaseDetail, ReleaseOut, YankRequest

PUBLISH = require("publish")
router = APIRouter(prefix="/v1", tags=["releases"])


def _fields(row: Release, model: str) -> dict[str, object]:
    return {
        "model": model,
        "version": row.version,
        "source_digest": row.source_digest,
        "lineage": row.lineage,
        "model_config": row.model_config,
        "created_at": row.created_at,
        "yanked_at": row.yanked_at,
        "yank_reason": row.yank_reason,
    }


@router.post(
    "/models/{model}/releases",
    dependencies=[PUBLISH],
    status_code=201,
    summary="Create a release (200 if identical; 409 if the version exists with other content)",
    responses={
        200: {"model": ReleaseOut, "description": "an identical release already existed"},
        **error_responses(404, 409, 422),
    },
)
def create_release(model: ModelName, spec: ReleaseCreate, session: SessionDep, response: Response) -> ReleaseOut:
    row, created = service.create_release(session, model, spec)
    if not created:
        response.status_code = 200
    return ReleaseOut.model_validate(_fields(row, model))


@router.get("/models/{model}/releases", summary="List a model's releases, newest first", responses=error_responses(404))
def list_releases(model: ModelName, session: SessionDep) -> list[ReleaseOut]:
    return [ReleaseOut.model_validate(_fields(r, model)) for r in service.list_releases(session, model)]


@router.get(
    "/models/{model}/releases/{version}",
    summary="A release with its artifacts, their eval results and gate status",
    responses=error_responses(404),
)
def get_release(model: ModelName, version: Version, session: SessionDep) -> ReleaseDetail:
    row = service.get_release(session, model, version, selectinload(Release.artifacts).selectinload(Artifact.evals))
    return ReleaseDetail.model_validate(
        {
            **_fields(row, model),
            "artifacts": [ArtifactSummary.from_row(a) for a in row.artifacts],
            "channels": channels_of_release(session, row.id),
        }
    )


@router.post(
    "/models/{model}/releases/{version}/yank",
    summary="Yank a release: kept, but never resolved, downloaded by revision or promoted again",
    responses=error_responses(404, 422),
)
def yank_release(
    model: ModelName,
    version: Version,
    body: YankRequest,
    session: SessionDep,
    principal: Annotated[Principal, require("promote")],
) -> ReleaseOut:
    row = service.yank_release(session, model, version, body.reason, principal.name)
    return ReleaseOut.model_validate(_fields(row, model))
