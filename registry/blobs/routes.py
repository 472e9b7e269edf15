"""HTTP routes for blobs: streamed, verified uploads and ranged downloads."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anyio.from_thread
import anyio.to_thread
from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from kiln.errors import InvalidInput
from registry.api.errors import error_responses
from registry.api.params import Sha256
from registry.blobs import service
from registry.blobs.download import blob_response
from registry.blobs.schemas import BlobOut
from registry.blobs.store import DEFAULT_CHUNK
from registry.deps import BlobStoreDep, SessionDep, SettingsDep, require

PUBLISH = require("publish")
router = APIRouter(prefix="/v1", tags=["blobs"])


def _too_large(limit: int) -> InvalidInput:
    return InvalidInput(
        f"upload exceeds the registry's limit of {limit} bytes", code="PAYLOAD_TOO_LARGE", details={"limit": limit}
    )


def _blocking_chunks(stream: AsyncIterator[bytes], limit: int, block: int = DEFAULT_CHUNK) -> Iterator[bytes]:
    """The request body as a blocking iterator for a worker thread, in blocks of about `block` bytes.

    The server hands us ~64 KiB pieces; gathering them on the event loop side keeps the thread
    hops (one per block) rare. Raises PAYLOAD_TOO_LARGE as soon as the body passes `limit`.
    """

    async def next_block() -> bytes | None:
        parts: list[bytes] = []
        size = 0
        async for piece in stream:
            parts.append(piece)
            size += len(piece)
            if size >= block:
                break
        return b"".join(parts) if parts else None

    total = 0
    while (data := anyio.from_thread.run(next_block)) is not None:
        total += len(data)
        if total > limit:
            raise _too_large(limit)
        yield data


@router.put(
    "/blobs/{sha256}",
    dependencies=[PUBLISH],
    status_code=201,
    summary="Upload a blob as the raw request body; stored only if its sha256 matches",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    responses={
        200: {"model": BlobOut, "description": "the blob was already stored"},
        **error_responses(413, 422),
    },
)
async def upload_blob(
    sha256: Sha256,
    request: Request,
    response: Response,
    session: SessionDep,
    store: BlobStoreDep,
    settings: SettingsDep,
) -> BlobOut:
    limit = settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    existing = await run_in_threadpool(service.confirm_stored, session, store, sha256)
    if existing is not None:
        async for _ in request.stream():  # read what was sent, so the connection stays usable
            pass
        response.status_code = 200
        return BlobOut(sha256=existing.sha256, size=existing.size, created_at=existing.created_at)
    chunks = _blocking_chunks(request.stream(), limit)
    row, created = await anyio.to_thread.run_sync(service.put_blob, session, store, sha256, chunks)
    if not created:
        response.status_code = 200
    return BlobOut(sha256=row.sha256, size=row.size, created_at=row.created_at)


@router.head(
    "/blobs/{sha256}",
    summary="Is this blob stored? 200 with Content-Length, or 404",
    response_class=Response,
    responses={200: {"description": "stored"}, 404: {"description": "not stored"}},
)
def blob_exists(sha256: Sha256, session: SessionDep, store: BlobStoreDep) -> Response:
    row = service.get_blob(session, store, sha256)
    return Response(
        status_code=200,
        headers={"Content-Length": str(row.size), "ETag": f'"{row.sha256}"', "Accept-Ranges": "bytes"},
    )


@router.get(
    "/blobs/{sha256}",
    summary="Download a blob (Range, ETag, If-None-Match)",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the blob"},
        206: {"description": "the requested byte range"},
        304: {"description": "not modified"},
        **error_responses(404, 416),
    },
)
def download_blob(sha256: Sha256, request: Request, store: BlobStoreDep) -> Response:
    return blob_response(request, store, sha256)
