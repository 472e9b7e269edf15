"""HTTP routes for releases: open, seal, abandon, yank, and read them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Depends, Request, Response

from kiln.core.releases import ArtifactSummary, ReleaseDetail, ReleaseOut
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterVersion, ModelName, PageLimit, Version
from kiln.registry.artifacts.service import WITH_EVALS
from kiln.registry.auth.principal import Principal
from kiln.registry.deps import BlobStoreDep, SessionDep, WriteSessionDep, require
from kiln.registry.paging import PAGE_LIMIT
from kiln.registry.releases import service
from kiln.registry.releases.followers import ReleaseFollowers
from kiln.registry.releases.models import Release
from kiln.registry.releases.schemas import ReasonRequest, ReleaseCreate

PUBLISH = require("publish")
router = APIRouter(prefix="/v1", tags=["releases"], route_class=SessionRoute)
RELEASE = "/models/{model}/releases/{version}"


async def get_followers(request: Request) -> ReleaseFollowers:
    followers: ReleaseFollowers = request.app.state.release_followers
    return followers


FollowersDep = Annotated[ReleaseFollowers, Depends(get_followers)]


def _fields(row: Release, model: str) -> dict[str, object]:
    return {
        "model": model,
        "version": row.version,
        "status": row.status,
        "source_digest": row.source_digest,
        "planned_artifacts": row.planned_artifacts,
        "lineage": row.lineage,
        "model_config": row.model_config,
        "created_at": row.created_at,
        "sealed_at": row.sealed_at,
        "abandoned_at": row.abandoned_at,
        "abandon_reason": row.abandon_reason,
        "yanked_at": row.yanked_at,
        "yank_reason": row.yank_reason,
    }


def _out(row: Release, model: str) -> ReleaseOut:
    return ReleaseOut.model_validate(_fields(row, model))


@router.post(
    "/models/{model}/releases",
    dependencies=[PUBLISH],
    status_code=201,
    summary="Open a release (200 if identical; 409 if the version exists with other content)",
    responses={
        200: {"model": ReleaseOut, "description": "an identical release already existed"},
        **error_responses(404, 409, 422),
    },
)
def create_release(model: ModelName, spec: ReleaseCreate, session: WriteSessionDep, response: Response) -> ReleaseOut:
    row, created = service.create_release(session, model, spec)
    session.commit()
    if not created:
        response.status_code = 200
    return _out(row, model)


@router.get(
    "/models/{model}/releases",
    summary="List a model's releases, newest first, a page at a time",
    responses={**PAGED, **error_responses(404)},
)
def list_releases(
    model: ModelName,
    request: Request,
    response: Response,
    session: SessionDep,
    after: AfterVersion = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[ReleaseOut]:
    page = service.releases_page(session, model, after, limit)
    return [_out(r, model) for r in page_rows(request, response, page, limit, lambda r: r.version)]


@router.get(
    RELEASE,
    summary="A release with its artifacts, their eval results and gate status",
    responses=error_responses(404),
)
def get_release(model: ModelName, version: Version, session: SessionDep, followers: FollowersDep) -> ReleaseDetail:
    row = service.get_release(session, model, version, service.with_artifacts(*WITH_EVALS))
    return ReleaseDetail.model_validate(
        {
            **_fields(row, model),
            "artifacts": [ArtifactSummary.of(a) for a in row.artifacts],
            "missing": service.missing_artifacts(row),
            "channels": followers.serving(session, row.id),
        }
    )


@router.post(
    RELEASE + "/seal",
    summary="Seal an open release once every planned artifact arrived with an eval (200 if already sealed)",
    status_code=201,
    responses={200: {"model": ReleaseOut, "description": "it was already sealed"}, **error_responses(404, 409, 422)},
)
def seal_release(
    model: ModelName,
    version: Version,
    session: WriteSessionDep,
    store: BlobStoreDep,
    request: Request,
    response: Response,
    background: BackgroundTasks,
    principal: Annotated[Principal, PUBLISH],
    followers: FollowersDep,
) -> ReleaseOut:
    """Seal the release. What follows a seal (where the registry offers model cars, hashing their file layers,
    so the first pull of a model car finds them recorded) runs in the background, after the answer."""
    row, sealed_now = service.seal_release(session, model, version, principal.name)
    session.commit()
    if not sealed_now:
        response.status_code = 200
    elif followers.sealed is not None:
        background.add_task(followers.sealed, request.app.state.write_session_factory, store, row.id)
    return _out(row, model)


@router.post(
    RELEASE + "/abandon",
    summary="Abandon an open release: it is never sealed, and its artifacts are dropped",
    responses=error_responses(404, 409, 422),
)
def abandon_release(
    model: ModelName,
    version: Version,
    body: ReasonRequest,
    session: WriteSessionDep,
    principal: Annotated[Principal, PUBLISH],
) -> ReleaseOut:
    row = service.abandon_release(session, model, version, body.reason, principal.name)
    session.commit()
    return _out(row, model)


@router.post(
    RELEASE + "/yank",
    summary="Yank a sealed release: kept, but never resolved, downloaded or promoted again",
    responses=error_responses(404, 409, 422),
)
def yank_release(
    model: ModelName,
    version: Version,
    body: ReasonRequest,
    session: WriteSessionDep,
    principal: Annotated[Principal, require("promote")],
    followers: FollowersDep,
) -> ReleaseOut:
    release = service.get_release(session, model, version)
    channels = followers.serving(session, release.id)
    row = service.yank_release(session, model, version, body.reason, principal.name, channels)
    followers.yanked(session, model, release.id, version, principal.name)
    session.commit()
    return _out(row, model)
