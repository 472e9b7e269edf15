"""The OCI distribution spec v1.1 pull endpoints at /v2/, for oras, skopeo, crane, containerd and KServe.

Errors here have the spec's shape, `{"errors": [{"code", "message", "detail"}]}`, with its codes: the
routes of this router render the kiln errors they raise through `OciRoute` (the rest of the API keeps
kiln's own shape). A 401 carries the token challenge clients follow: `GET /v2/token` with Basic auth
(any user name, a kiln token as the password) answers that same token as the bearer, so every read
is checked with kiln's own scopes (`read` on the model).

The routes are left out of the OpenAPI document: the OCI spec is their contract, in its error shape.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError, NotFound, Unauthorized, Unavailable
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.urls import base_url
from kiln.registry.blobs import service as blobs
from kiln.registry.blobs.download import blob_response, ranged_response
from kiln.registry.deps import BlobStoreDep, PrincipalDep, SessionDep, SettingsDep
from kiln.registry.oci import media_types as mt
from kiln.registry.oci import modelcar, service
from kiln.registry.oci.documents import Document, Served
from kiln.registry.oci.models import TarLayer
from kiln.registry.paging import MAX_PAGE_LIMIT
from kiln.registry.settings import RegistrySettings
from kiln.storage.local import read_file

API_VERSION = {"Docker-Distribution-API-Version": "registry/2.0"}
SERVICE = "kiln"


def _challenge(request: Request, settings: RegistrySettings) -> str:
    realm = f"{base_url(request, settings)}/v2/token"
    challenge = f'Bearer realm="{realm}",service="{SERVICE}"'
    name = request.path_params.get("name")
    if name:
        challenge += f',scope="repository:{name}:pull"'
    return challenge


def oci_error(request: Request, error: KilnError) -> Response:
    """A kiln error in the spec's error shape; an unmapped one keeps kiln's shape (it is not the spec's)."""
    code, status = mt.OCI_ERROR_BY_KILN_CODE.get(error.code, (None, 0))
    if code is None:
        raise error
    headers = dict(API_VERSION)
    if status == 401:
        headers["WWW-Authenticate"] = _challenge(request, request.app.state.settings)
    if status == 416 and "size" in error.details:
        headers["Content-Range"] = f"bytes */{error.details['size']}"
    body = {"errors": [{"code": code, "message": error.message, "detail": error.details}]}
    # HEAD too: the same status and headers as the GET (the server sends no body for a HEAD).
    return JSONResponse(body, status_code=status, headers=headers)


class OciRoute(SessionRoute):
    """A route whose kiln errors (its dependencies' included) are answered in the spec's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except KilnError as error:
                return oci_error(request, error)
            except RequestValidationError as error:
                message = "; ".join(str(e.get("msg", "")) for e in error.errors())
                return oci_error(request, InvalidInput(f"invalid request: {message}"))

        return route


router = APIRouter(prefix="/v2", route_class=OciRoute, include_in_schema=False)


def _derived(
    request: Request, digest: str, size: int, read: Callable[[int, int], Iterator[bytes]], media_type: str | None = None
) -> Response:
    """Content the registry derives or holds outside the blob store, by digest: GET or HEAD, with Range."""
    headers = {**API_VERSION, "Docker-Content-Digest": digest}
    return ranged_response(request, size, f'"{digest}"', read, media_type, headers)


def _document(request: Request, document: Document, *, digest_header: bool = True) -> Response:
    """A derived document: GET or HEAD, with its digest, type and length (and a byte range, for blobs)."""
    body = document.body
    response = _derived(request, document.digest, len(body), lambda a, b: iter((body[a:b],)), document.media_type)
    if not digest_header:
        del response.headers["Docker-Content-Digest"]
    return response


@router.get("/")
def version_check(principal: PrincipalDep) -> Response:
    """200 when the caller may read (the spec's end-1); 401 with the token challenge otherwise."""
    if not principal.has("read"):
        raise Unauthorized("this registry needs a token: log in with a kiln token as the password")
    return JSONResponse({}, headers=API_VERSION)


@router.get("/token")
def token(request: Request, settings: SettingsDep) -> Response:
    """The token endpoint of the challenge: Basic auth (any user, a kiln token as password) or a Bearer
    kiln token, answered with that token as the bearer (it is already a hashed, revocable secret)."""
    header = request.headers.get("authorization", "")
    scheme, _, credentials = header.partition(" ")
    secret = ""
    if scheme.lower() == "basic":
        try:
            secret = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            secret = ""
    elif scheme.lower() == "bearer":
        secret = credentials.strip()
    if not settings.auth_required or (not secret and settings.anonymous_read):
        # Nothing to check: reads are open. An empty token makes clients send no Authorization at all.
        return JSONResponse({"token": "", "access_token": ""}, headers=API_VERSION)
    if not secret or request.app.state.token_cache.lookup(secret) is None:
        raise Unauthorized("send a kiln token as the password (Basic) or as a Bearer token", code=Codes.INVALID_TOKEN)
    return JSONResponse({"token": secret, "access_token": secret, "expires_in": 3600}, headers=API_VERSION)


def _index(request: Request) -> service.DigestIndex:
    """The app's index of derived digests, made on first use (it is this router's own cache)."""
    index: service.DigestIndex | None = getattr(request.app.state, "oci_digests", None)
    if index is None:
        index = request.app.state.oci_digests = service.DigestIndex()
    return index


def _repository(request: Request, session: SessionDep, principal: PrincipalDep, name: str) -> service.Repository:
    principal.require("read", service.model_name(name))
    return service.find_repository(session, name, request.app.state.modelcar)


@router.api_route("/{name:path}/manifests/{reference}", methods=["GET", "HEAD"])
def get_manifest(
    name: str, reference: str, request: Request, session: SessionDep, store: BlobStoreDep, principal: PrincipalDep
) -> Response:
    """A manifest by tag or digest (end-3): `Docker-Content-Digest`, its media type and length."""
    repo = _repository(request, session, principal, name)

    def record_layers(served: Served) -> modelcar.LayerMap:
        return modelcar.served_layers(session, request.app.state.write_session_factory, store, served)

    return _document(request, service.resolve_manifest(session, repo, _index(request), reference, record_layers))


@router.api_route("/{name:path}/blobs/{digest}", methods=["GET", "HEAD"])
def get_blob(
    name: str, digest: str, request: Request, session: SessionDep, store: BlobStoreDep, principal: PrincipalDep
) -> Response:
    """A blob by digest (end-2), with Range: an artifact file or attestation (the stored blob), or a config;
    for a model car, also a base image layer (from its layout) or a file's tar layer (streamed from the blob)."""
    repo = _repository(request, session, principal, name)
    found = service.find_blob(session, repo, _index(request), digest)
    if isinstance(found, Document):
        return _document(request, found)
    if isinstance(found, service.BaseLayer):
        path = found.car.blob_path(found.sha256)
        if not path.is_file() or path.stat().st_size != found.size:
            raise Unavailable(
                f"the model car base image's layer {digest} changed on disk since the registry started",
                code=Codes.MODELCAR_BASE_CHANGED,
                details={"layout": str(found.car.layout), "digest": digest},
            )
        return _derived(request, digest, found.size, lambda a, b: read_file(path, a, b))
    if isinstance(found, TarLayer):
        for member in found.members:  # the rows and the bytes: blobs being collected are not served
            blobs.get_blob(session, store, member["sha256"])
        layer = found
        return _derived(request, digest, layer.size, lambda a, b: modelcar.read_layer(store, layer, a, b))
    blobs.get_blob(session, store, found.sha256)  # the row and the bytes: a blob being collected is not served
    response = blob_response(request, store, found.sha256)
    response.headers.update({**API_VERSION, "Docker-Content-Digest": digest})
    return response


@router.get("/{name:path}/tags/list")
def list_tags(
    name: str,
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    n: int | None = Query(default=None, ge=0, le=10_000),
    last: str | None = None,
) -> Response:
    """The repository's tags in lexical order (end-8), `n` at a time after `last` (without `n`, a page of
    `MAX_PAGE_LIMIT`, which the spec lets a registry answer), with a `Link` to the next."""
    repo = _repository(request, session, principal, name)
    n = MAX_PAGE_LIMIT if n is None else n
    tags, more = service.tags_page(list(service.tag_table(session, repo.model)), n, last)
    headers = dict(API_VERSION)
    if more and tags:
        headers["Link"] = f'</v2/{name}/tags/list?n={n}&last={tags[-1]}>; rel="next"'
    return JSONResponse({"name": name, "tags": tags}, headers=headers)


@router.get("/{name:path}/referrers/{digest}")
def list_referrers(
    name: str,
    digest: str,
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    artifact_type: str | None = Query(default=None, alias="artifactType"),
) -> Response:
    """The manifests whose subject is `digest` (end-12): the artifact's signature and provenance."""
    repo = _repository(request, session, principal, name)
    index = service.referrers_index(session, repo, _index(request), digest, artifact_type)
    response = _document(request, index, digest_header=False)
    if artifact_type is not None:
        response.headers["OCI-Filters-Applied"] = "artifactType"
    return response


@router.api_route("/{path:path}", methods=["GET", "HEAD"])
def unknown_endpoint(path: str) -> Response:
    """Any other read under /v2/ (an empty reference, a made-up endpoint): the spec's error shape, not kiln's."""
    raise NotFound(
        f"no OCI endpoint at /v2/{path[:200]}: this registry answers manifests/, blobs/, tags/list and referrers/",
        code=Codes.OCI_ENDPOINT_UNKNOWN,
        details={"path": f"/v2/{path[:200]}"},
    )


@router.api_route("/{path:path}", methods=["POST", "PUT", "PATCH", "DELETE"])
def refuse_push(path: str) -> Response:
    """Pushing through OCI is not offered: artifacts are published (and sealed) with `kiln publish`."""
    raise InvalidInput(
        "this registry is pull-only over OCI: publish artifacts with `kiln publish`",
        code=Codes.OCI_PUSH_UNSUPPORTED,
        details={"path": f"/v2/{path}"},
    )
