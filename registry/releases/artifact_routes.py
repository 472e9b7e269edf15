"""HTTP routes for a release's artifacts, their file downloads and eval results: what a release holds is
addressed, published and read through it (`registry.releases.contents`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from sqlalchemy.orm import Session

from kiln.core.evals import RecordedEval
from kiln.core.manifest import ArtifactManifest, FileOut
from kiln.core.releases import ArtifactDetail, ArtifactSummary
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterArtifact, ArtifactName, ModelName, PageLimit, Version
from kiln.registry.api.urls import artifact_file_url, base_url
from kiln.registry.artifacts import service
from kiln.registry.artifacts.schemas import EvalCreate
from kiln.registry.blobs.download import blob_response
from kiln.registry.deps import BlobStoreDep, SessionDep, SettingsDep, WriteSessionDep, require
from kiln.registry.paging import PAGE_LIMIT
from kiln.registry.releases import contents
from kiln.registry.settings import RegistrySettings

PUBLISH = require("publish")
router = APIRouter(prefix="/v1", tags=["artifacts"], route_class=SessionRoute)

ARTIFACTS = "/models/{model}/releases/{version}/artifacts"


def _detail(
    request: Request, settings: RegistrySettings, session: Session, model: str, version: str, name: str
) -> ArtifactDetail:
    row = contents.get_artifact(session, model, version, name)
    base = base_url(request, settings)
    files = [
        FileOut(path=f.path, sha256=f.sha256, size=f.size, url=artifact_file_url(base, model, version, name, f.path))
        for f in row.files
    ]
    return ArtifactDetail.of(row, model=model, version=version, manifest=service.manifest_of(row), files=files)


@router.post(
    ARTIFACTS,
    dependencies=[PUBLISH],
    status_code=201,
    summary="Publish an artifact manifest whose blobs are uploaded (200 if identical, 409 if different)",
    responses={
        200: {"model": ArtifactDetail, "description": "an identical artifact already existed"},
        **error_responses(404, 409, 422),
    },
)
def publish_artifact(
    model: ModelName,
    version: Version,
    manifest: ArtifactManifest,
    request: Request,
    response: Response,
    session: WriteSessionDep,
    settings: SettingsDep,
) -> ArtifactDetail:
    _row, created = contents.publish_artifact(session, model, version, manifest)
    detail = _detail(request, settings, session, model, version, manifest.name)  # before the commit
    session.commit()
    if created:
        request.app.state.metrics.publishes.labels(manifest.target).inc()
    else:
        response.status_code = 200
    return detail


@router.get(
    ARTIFACTS,
    summary="List a release's artifacts with their eval status, by name, a page at a time",
    responses={**PAGED, **error_responses(404)},
)
def list_artifacts(
    model: ModelName,
    version: Version,
    request: Request,
    response: Response,
    session: SessionDep,
    after: AfterArtifact = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[ArtifactSummary]:
    page = contents.artifacts_page(session, model, version, after, limit)
    return [ArtifactSummary.of(a) for a in page_rows(request, response, page, limit)]


@router.get(
    ARTIFACTS + "/{name}",
    summary="An artifact: manifest, download URL per file, eval results",
    responses=error_responses(404),
)
def get_artifact(
    model: ModelName, version: Version, name: ArtifactName, request: Request, session: SessionDep, settings: SettingsDep
) -> ArtifactDetail:
    return _detail(request, settings, session, model, version, name)


FILE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "the file"},
    206: {"description": "the requested byte range"},
    304: {"description": "not modified"},
    **error_responses(404, 409, 410, 416, 422),
}


@router.head(
    ARTIFACTS + "/{name}/files/{path:path}",
    summary="Headers of one file of an artifact",
    response_class=Response,
    responses=FILE_RESPONSES,
)
@router.get(
    ARTIFACTS + "/{name}/files/{path:path}",
    summary="Download one file of an artifact (Range, ETag, If-None-Match)",
    response_class=Response,
    responses=FILE_RESPONSES,
)
def download_file(
    model: ModelName,
    version: Version,
    name: ArtifactName,
    path: str,
    request: Request,
    session: SessionDep,
    store: BlobStoreDep,
) -> Response:
    row = contents.get_artifact_file(session, model, version, name, path)
    return blob_response(request, store, row.sha256)


@router.post(
    ARTIFACTS + "/{name}/evals",
    dependencies=[PUBLISH],
    status_code=201,
    summary="Record one runtime's eval result (200 if identical, 409 if different)",
    responses={
        200: {"model": RecordedEval, "description": "an identical result existed"},
        **error_responses(404, 409, 422),
    },
)
def post_eval(
    model: ModelName,
    version: Version,
    name: ArtifactName,
    spec: EvalCreate,
    session: WriteSessionDep,
    response: Response,
) -> RecordedEval:
    row, created = contents.post_eval(session, model, version, name, spec)
    session.commit()
    if not created:
        response.status_code = 200
    return RecordedEval.model_validate(row)
