"""HTTP downloads of blobs: ETag, conditional requests and single byte ranges, in one place.

Both `GET /v1/blobs/{sha256}` and artifact file downloads answer through `blob_response`. A store
that hands out direct URLs (S3 with KILN_REGISTRY_S3_DOWNLOADS=redirect) gets a 307 to a presigned
URL instead of a stream; the client then sends its Range to S3 itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.storage.store import BlobStore

_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
# A position with more digits than this is past any blob (and int() of thousands of digits is slow).
_MAX_DIGITS = 18


def _position(digits: str) -> int:
    """A byte position from a Range header; absurdly long numbers become "past the end"."""
    significant = digits.lstrip("0")
    return 2**63 if len(significant) > _MAX_DIGITS else int(significant or "0")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive byte range `(first, last)` a `Range` header asks for, or None for the whole blob.

    Supports one range: `bytes=a-b`, `bytes=a-`, `bytes=-n`. Headers we do not understand
    (other units, several ranges, bad syntax) are ignored, as RFC 9110 allows; a well-formed
    range outside the blob raises RANGE_NOT_SATISFIABLE.
    """
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first_s, last_s = match.groups()
    if first_s == "" and last_s == "":
        return None
    if first_s == "":  # suffix: the last n bytes
        n = _position(last_s)
        if n == 0 or size == 0:
            raise _unsatisfiable(header, size)
        return max(0, size - n), size - 1
    first = _position(first_s)
    last = size - 1 if last_s == "" else _position(last_s)
    if last_s != "" and last < first:
        return None  # syntactically invalid: ignore
    if first >= size:
        raise _unsatisfiable(header, size)
    return first, min(last, size - 1)


def _unsatisfiable(header: str, size: int) -> InvalidInput:
    return InvalidInput(
        f"range {header[:100]!r} is outside the {size}-byte content",
        code=Codes.RANGE_NOT_SATISFIABLE,
        details={"range": header[:100], "size": size},
    )


def _etag_matches(header: str, etag: str) -> bool:
    candidates = [c.strip() for c in header.split(",")]
    return any(c == "*" or c.removeprefix("W/") == etag for c in candidates)


def blob_response(
    request: Request,
    store: BlobStore,
    sha256: str,
    media_type: str | None = None,
    *,
    redirect_head: bool = False,
) -> Response:
    """Answer GET/HEAD for a blob: 200, 206 (Range), 304 (If-None-Match) or 416; streamed in large chunks.

    When the store gives a direct URL, a GET is answered with a 307 to it. A HEAD is answered here
    (a presigned URL is signed for GET only) unless `redirect_head`: Hub clients read a HEAD's
    redirect for the download location and do not follow it off this host.
    """
    size = store.size(sha256)  # BlobNotFound → 404 before anything is sent
    etag = f'"{sha256}"'
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        # Content-addressed: the bytes behind this URL never change.
        "Cache-Control": "public, max-age=31536000, immutable",
    }
    if_none_match = request.headers.get("if-none-match")
    if if_none_match is not None and _etag_matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)

    if request.method != "HEAD" or redirect_head:
        url = store.download_url(sha256)
        if url is not None:
            # The redirect itself must not outlive the presigned URL in any cache.
            return Response(status_code=307, headers={"Location": url, "ETag": etag, "Cache-Control": "no-store"})

    return ranged_response(request, size, etag, partial(store.open_range, sha256), media_type, headers)


def ranged_response(
    request: Request,
    size: int,
    etag: str,
    read: Callable[[int, int], Iterator[bytes]],
    media_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """GET/HEAD of `size` bytes that `read(start, stop)` streams: 200, 206 (Range, If-Range) or 416.

    The one place byte ranges are answered: stored blobs, and content the registry derives (OCI
    documents, a model car's tar layers)."""
    headers = {"ETag": etag, "Accept-Ranges": "bytes", **(headers or {})}
    range_header = request.headers.get("range")
    if_range = request.headers.get("if-range")
    if if_range is not None and if_range.strip() != etag:
        range_header = None  # the client's copy is stale: send the whole thing
    byte_range = parse_range(range_header, size)
    if byte_range is None:
        status, first, last = 200, 0, size - 1
    else:
        first, last = byte_range
        status = 206
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"
    headers["Content-Length"] = str(last - first + 1)
    media_type = media_type or "application/octet-stream"
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers, media_type=media_type)
    return StreamingResponse(read(first, last + 1), status_code=status, headers=headers, media_type=media_type)
