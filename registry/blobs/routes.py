"""HTTP routes for blobs: streamed, verified uploads and ranged downloads.

Reads by digest answer only for blobs the caller may read (`registry.releases.contents.check_blob_readable`, which
`create_app` hands these routes as `BlobReadable`): what a served release of its models holds, its models' open
releases for publishers, and its own uploads.
Anonymous callers, where anonymous read is on, read what served releases hold and nothing else. A
blob the caller may not read is a 404, as if it did not exist, on GET and HEAD alike. Uploading bytes
already stored is answered at once for a caller who may read them; anyone else sends the bytes,
which must hash to the digest (DIGEST_MISMATCH otherwise), and may read them from then on.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import anyio.from_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from fastapi import APIRouter, Depends, Request, Response
from sqlalchemy.orm import Session

from kiln.core.error_codes import Codes
from kiln.core.errors import DigestMismatch, InvalidInput, KilnError
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.params import Sha256
from kiln.registry.auth.principal import Principal
from kiln.registry.blobs import service
from kiln.registry.blobs.download import blob_response
from kiln.registry.blobs.models import Blob
from kiln.registry.blobs.references import BlobReadable
from kiln.registry.blobs.schemas import BlobOut
from kiln.registry.deps import BlobStoreDep, PrincipalDep, SessionDep, SettingsDep, WriteSessionDep, require, transact
from kiln.storage.store import DEFAULT_CHUNK, BlobNotFound, BlobStore

PUBLISH = require("publish")
router = APIRouter(prefix="/v1", tags=["blobs"], route_class=SessionRoute)


def _too_large(limit: int) -> InvalidInput:
    return InvalidInput(
        f"upload exceeds the registry's limit of {limit} bytes", code=Codes.PAYLOAD_TOO_LARGE, details={"limit": limit}
    )


# Blocks read ahead of the thread that hashes and writes them (the network and the disk work at once);
# with the block being gathered and the one being written, an upload holds at most 4 blocks (32 MiB).
READ_AHEAD_BLOCKS = 2


async def _read_blocks(
    stream: AsyncIterator[bytes], blocks: MemoryObjectSendStream[bytes | KilnError], limit: int, block: int
) -> None:
    """Gather the request body's ~64 KiB pieces into blocks of about `block` bytes and send them on;
    past `limit`, send PAYLOAD_TOO_LARGE instead and stop."""
    async with blocks:
        parts: list[bytes] = []
        size = total = 0
        try:
            async for piece in stream:
                parts.append(piece)
                size += len(piece)
                total += len(piece)
                if total > limit:
                    await blocks.send(_too_large(limit))
                    return
                if size >= block:
                    await blocks.send(b"".join(parts))
                    parts, size = [], 0
            if parts:
                await blocks.send(b"".join(parts))
        except anyio.BrokenResourceError:
            pass  # the writer stopped (a digest mismatch, a store error): it reports why


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _blocking_chunks(blocks: MemoryObjectReceiveStream[bytes | KilnError]) -> Iterator[bytes]:
    """The blocks `_read_blocks` sends, as a blocking iterator for the worker thread that stores them."""
    try:
        while True:
            try:
                data = anyio.from_thread.run(blocks.receive)
            except anyio.EndOfStream:
                return
            if isinstance(data, KilnError):
                raise data
            yield data
    finally:
        anyio.from_thread.run(blocks.aclose)


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
    session: WriteSessionDep,
    store: BlobStoreDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    readable: BlobReadableDep,
) -> BlobOut:
    limit = settings.max_upload_bytes
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(limit)
    # Each transaction begins and commits in one thread (`transact`); none is open while the body streams.
    existing = await transact(session, service.confirm_stored, session, store, sha256)  # kept from collection
    if existing is not None:
        # Bytes someone else stored: the caller reads them back only once it has sent the same bytes.
        if await transact(session, _may_read, readable, session, principal, sha256):
            async for _ in request.stream():  # read what was sent, so the connection stays usable
                pass
        else:
            await _check_digest(request, sha256, limit)
            await transact(session, service.record_upload, session, principal, sha256)
        response.status_code = 200
        return BlobOut(sha256=existing.sha256, size=existing.size, created_at=existing.created_at)
    send, receive = anyio.create_memory_object_stream[bytes | KilnError](max_buffer_size=READ_AHEAD_BLOCKS)
    try:
        async with anyio.create_task_group() as reading:
            reading.start_soon(_read_blocks, request.stream(), send, limit, DEFAULT_CHUNK)
            row, created = await transact(session, _store, session, store, principal, sha256, _blocking_chunks(receive))
    except BaseExceptionGroup as group:  # the task group wraps what the store or the reader raised
        raise _first(group) from None
    if not created:
        response.status_code = 200
    return BlobOut(sha256=row.sha256, size=row.size, created_at=row.created_at)


def _store(
    session: Session, store: BlobStore, principal: Principal, sha256: str, chunks: Iterator[bytes]
) -> tuple[Blob, bool]:
    """Store the streamed bytes and record the upload: its row and whether it is new (the caller commits)."""
    row, created = service.put_blob(session, store, sha256, chunks)
    service.record_upload(session, principal, row.sha256)
    return row, created


async def get_blob_readable(request: Request) -> BlobReadable:
    readable: BlobReadable = request.app.state.blob_readable
    return readable


BlobReadableDep = Annotated[BlobReadable, Depends(get_blob_readable)]


def _may_read(readable: BlobReadable, session: Session, principal: Principal, sha256: str) -> bool:
    try:
        readable(session, principal, sha256)
    except BlobNotFound:
        return False
    return True


async def _check_digest(request: Request, sha256: str, limit: int) -> None:
    """Hash the request body (up to `limit` bytes): DIGEST_MISMATCH unless it is the blob `sha256`."""
    digest = hashlib.sha256()
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise _too_large(limit)
        digest.update(piece)
    if digest.hexdigest() != sha256:
        raise DigestMismatch(
            f"content has sha256 {digest.hexdigest()}, not the claimed {sha256}",
            details={"expected": sha256, "actual": digest.hexdigest(), "size": size},
        )


BLOB_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "the blob"},
    206: {"description": "the requested byte range"},
    304: {"description": "not modified"},
    **error_responses(404, 416),
}


@router.head(
    "/blobs/{sha256}",
    summary="Is this blob stored (and readable by the caller)? Headers as for GET, Range and If-None-Match included",
    response_class=Response,
    responses=BLOB_RESPONSES,
)
@router.get(
    "/blobs/{sha256}",
    summary="Download a blob (Range, ETag, If-None-Match)",
    response_class=Response,
    responses=BLOB_RESPONSES,
)
def download_blob(
    sha256: Sha256,
    request: Request,
    session: SessionDep,
    store: BlobStoreDep,
    principal: PrincipalDep,
    readable: BlobReadableDep,
) -> Response:
    readable(session, principal, sha256)
    service.get_blob(session, store, sha256)  # the row and the bytes: a blob being collected is not served
    return blob_response(request, store, sha256)
