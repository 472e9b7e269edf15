"""HTTP routes for an artifact's attestations: attached by publishers (verified against the trusted keys on
upload), listed, and downloaded from a served release. The keys are the attestations domain's own routes
(`registry.attestations.routes`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from kiln.core.access import AttestationKind, AttestationOut
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.params import ArtifactName, ModelName, Version
from kiln.registry.api.urls import base_url
from kiln.registry.attestations.schemas import AttestationCreate
from kiln.registry.attestations.service import Attestation
from kiln.registry.blobs.download import blob_response
from kiln.registry.deps import BlobStoreDep, SessionDep, SettingsDep, WriteSessionDep, require
from kiln.registry.releases import contents

router = APIRouter(prefix="/v1", tags=["attestations"], route_class=SessionRoute)
ATTESTATIONS = "/models/{model}/releases/{version}/artifacts/{name}/attestations"


def _out(
    request: Request, settings: SettingsDep, model: str, version: str, name: str, row: Attestation
) -> AttestationOut:
    url = f"{base_url(request, settings)}/v1{ATTESTATIONS.format(model=model, version=version, name=name)}/{row.kind}"
    return AttestationOut.of(row, url=url)


@router.post(
    ATTESTATIONS,
    dependencies=[require("publish")],
    status_code=201,
    summary="Attach an uploaded signature or provenance bundle to an artifact, verified against the trusted keys",
    responses={
        200: {"model": AttestationOut, "description": "an identical one was attached"},
        **error_responses(404, 409, 422),
    },
)
def attach_attestation(
    model: ModelName,
    version: Version,
    name: ArtifactName,
    spec: AttestationCreate,
    request: Request,
    response: Response,
    session: WriteSessionDep,
    store: BlobStoreDep,
    settings: SettingsDep,
) -> AttestationOut:
    row, created = contents.attach_attestation(session, store, model, version, name, spec)
    session.commit()
    if not created:
        response.status_code = 200
    return _out(request, settings, model, version, name, row)


@router.get(ATTESTATIONS, summary="An artifact's attestations", responses=error_responses(404))
def list_attestations(
    model: ModelName, version: Version, name: ArtifactName, request: Request, session: SessionDep, settings: SettingsDep
) -> list[AttestationOut]:
    return [
        _out(request, settings, model, version, name, r)
        for r in contents.list_attestations(session, model, version, name)
    ]


@router.get(
    ATTESTATIONS + "/{kind}",
    summary="Download an attestation (a Sigstore bundle) of an artifact of a sealed release",
    response_class=Response,
    responses={
        200: {"content": {"application/vnd.dev.sigstore.bundle.v0.3+json": {}}},
        **error_responses(404, 409, 410),
    },
)
def download_attestation(
    model: ModelName,
    version: Version,
    name: ArtifactName,
    kind: AttestationKind,
    request: Request,
    session: SessionDep,
    store: BlobStoreDep,
) -> Response:
    row = contents.get_attestation(session, model, version, name, kind)
    return blob_response(request, store, row.sha256, row.media_type)
