"""The request boundary: every request body is bounded and every JSON body is strict; every response
carries the security headers browsers act on.

One pure-ASGI middleware, in front of the routes:
- Each route takes bodies up to its own limit, looked up by method and route template before any
  byte is read: a larger `Content-Length`, or a chunked body that grows past it, is answered 413
  PAYLOAD_TOO_LARGE before the route runs (and before authentication). The limits are data,
  `ROUTE_BODY_LIMITS`; every route not named there, and any unknown path, takes at most
  `JSON_BODY_BYTES` (64 KiB: a route's longest free text, 10,000 characters, fits as UTF-8 or with
  each character escaped as `\\uXXXX`, bar astral ones). Only documents that grow with the model
  take more:
    - `POST /v1/models/{model}/releases/{version}/artifacts`, an artifact manifest (up to 100,000
      files), and `POST /v1/models/{model}/releases`, whose lineage lists every source file: the
      operator's `max_body_bytes` (4 MiB by default);
    - `POST .../artifacts/{name}/evals`: 256 KiB (metrics, gate and a reason of up to 10,000 characters).
  Past 64 KiB, such a body is read only from a caller whose token has the route's scope (`publish`),
  checked before the rest is read (401/403), so an anonymous client makes the registry read and parse
  at most 64 KiB a request. `max_body_bytes` also caps every other limit. Signature and provenance
  bundles are blobs: a blob upload (`PUT /v1/blobs/{sha256}`) streams to the store under its own
  limit (`max_upload_bytes`) and is not read here.
- Every body read here is JSON, whatever its `Content-Type` says (`parses_body`): it is parsed once by
  `core.untrusted.loads_json` (no NaN, no out-of-range numbers, no NUL or unpaired surrogates, no
  duplicate keys, bounded nesting) and refused with 422 INVALID_JSON otherwise; the route then reads
  the same bytes. The header is not consulted because two readers of it disagree: FastAPI decides
  whether to `json.loads` a body from the header as `str.strip()` cuts it (which also strips U+0085
  and U+00A0), so any reading of the header here that differed by one character would let a body
  reach `json.loads` unchecked. Deciding without the header leaves FastAPI's parse only text this
  parser accepted, which both parse to the same value (`loads_json` takes UTF-8 JSON only: no BOM,
  no other encoding `json.loads` would guess); a body FastAPI does not take as JSON is then refused
  by the route's schema. So no route and no database column ever sees a value it cannot store,
  whatever the route's own schema says (and `core.untrusted.JSONObject` bounds the free-form ones at
  the model layer as well). The routes under /v2/ (OCI: pulls) take no body; a push there is
  answered by its route, in the spec's error shape. The parse is linear in the body's
  size; a body over `INLINE_PARSE_BYTES` is parsed in a thread of its own (`PARSE_THREADS`), so the
  event loop keeps answering other requests (`/healthz` among them) meanwhile and a flood of large
  bodies queues there instead of taking the threads the routes run in.
- Responses get `X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY`, `Referrer-Policy`
  and, on HTML pages, a Content-Security-Policy that allows nothing but the page's own stylesheet
  (`add_security_headers`, which the app's outermost middleware applies to every response, this
  one's refusals included: one wrapper of `send` per request instead of one per middleware).
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from starlette.requests import Request

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError
from kiln.core.untrusted import loads_json
from kiln.registry.api.errors import error_response
from kiln.registry.auth.principal import Scope
from kiln.registry.deps import authenticate_async

# Blob uploads stream their bodies to the store (limited by settings.max_upload_bytes there).
STREAMED_BODY = re.compile(r"^/v1/blobs/[^/]+$")
# Methods whose bodies no route reads (and the boundary passes on unread).
BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The OCI routes take no body: a push is refused by its route, in the spec's error shape.
_NO_BODY = re.compile(r"^/v2(/.*)?$")
JSON_BODY_BYTES: Final = 64 * 1024


@dataclass(frozen=True)
class BodyLimit:
    """A route's largest body: `max_bytes` (None: the operator's max_body_bytes), read past
    JSON_BODY_BYTES only from a caller with `scope`."""

    max_bytes: int | None
    scope: Scope


# (method, route template) -> its limit, for routes whose documents grow with the model.
ROUTE_BODY_LIMITS: Final[dict[tuple[str, str], BodyLimit]] = {
    # an artifact manifest: up to 100,000 files
    ("POST", "/v1/models/{model}/releases/{version}/artifacts"): BodyLimit(None, "publish"),
    # a release: its lineage lists every source file
    ("POST", "/v1/models/{model}/releases"): BodyLimit(None, "publish"),
    # an eval result: metrics, gate and a reason of up to 10,000 characters
    ("POST", "/v1/models/{model}/releases/{version}/artifacts/{name}/evals"): BodyLimit(256 * 1024, "publish"),
}
# Smaller bodies parse inline (a millisecond at most); larger ones in a thread of their own, one at a
# time (a second thread would parse no faster, the interpreter lock being one, and take the lock from the
# event loop more often).
INLINE_PARSE_BYTES: Final = 16 * 1024
PARSE_THREADS: Final = 1
_PARSERS = ThreadPoolExecutor(max_workers=PARSE_THREADS, thread_name_prefix="request-body-json")


def _template_pattern(template: str) -> re.Pattern[str]:
    """`/v1/models/{model}` as a pattern: each `{name}` one path segment, the rest literal."""
    parts = re.split(r"\{[^/{}]+\}", template)
    return re.compile("[^/]+".join(re.escape(part) for part in parts))


_ROUTE_LIMITS = [
    (method, _template_pattern(template), limit) for (method, template), limit in ROUTE_BODY_LIMITS.items()
]
SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]
PAGE_CSP = (
    b"default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
    b"frame-ancestors 'none'; base-uri 'none'"
)


def _too_large(limit: int) -> KilnError:
    return InvalidInput(
        f"request body exceeds the registry's limit of {limit} bytes for this route",
        code=Codes.PAYLOAD_TOO_LARGE,
        details={"limit": limit},
    )


def add_security_headers(headers: list[tuple[bytes, bytes]]) -> None:
    """Add the security headers to a response's `headers` (its `http.response.start` message's)."""
    headers.extend(SECURITY_HEADERS)
    content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    if content_type.startswith(b"text/html"):
        headers.append((b"content-security-policy", PAGE_CSP))


def body_limit(method: str, path: str, max_body_bytes: int) -> tuple[int, Scope | None]:
    """The largest body `method` on `path` takes (`ROUTE_BODY_LIMITS`, else `JSON_BODY_BYTES`; at most
    `max_body_bytes`), and the scope a caller needs to send more than `JSON_BODY_BYTES` of it (None: no
    more is taken)."""
    limit = next((lim for m, pattern, lim in _ROUTE_LIMITS if m == method and pattern.fullmatch(path)), None)
    if limit is None:
        return min(JSON_BODY_BYTES, max_body_bytes), None
    largest = min(max_body_bytes if limit.max_bytes is None else limit.max_bytes, max_body_bytes)
    return largest, (limit.scope if largest > JSON_BODY_BYTES else None)


class RequestBoundaryMiddleware:
    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        if scope["method"] in BODILESS_METHODS or STREAMED_BODY.fullmatch(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(scope, receive)
            if body and parses_body(scope["method"], scope["path"]):
                await _check_json(body)
        except KilnError as exc:
            await error_response(exc)(scope, _replay(b""), send)
            return
        await self.app(scope, _replay(body), send)

    async def _read_body(self, scope: Any, receive: Any) -> bytes:
        limit, large_scope = body_limit(scope["method"], scope["path"], self.max_body_bytes)
        unchecked = large_scope is not None  # more than JSON_BODY_BYTES only once the caller is known
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                declared = int(value) if len(value) <= 18 else limit + 1
                if declared > limit:
                    raise _too_large(limit)
                if declared > JSON_BODY_BYTES and large_scope is not None and unchecked:
                    await _authorize(scope, large_scope)
                    unchecked = False
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            if size > JSON_BODY_BYTES and large_scope is not None and unchecked:
                await _authorize(scope, large_scope)
                unchecked = False
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(parts)


async def _authorize(scope: Any, needed: Scope) -> None:
    """Refuse (401/403) a body over JSON_BODY_BYTES unless the caller's token has `needed`: anonymous
    clients make the registry read at most that much of a request. The token is looked up as routes do
    (a cache, else the database: in a thread)."""
    principal = await authenticate_async(Request(scope))
    principal.require(needed)


async def _check_json(body: bytes) -> None:
    """`loads_json` of a request body: inline when small, else in the parser thread."""
    if len(body) <= INLINE_PARSE_BYTES:
        loads_json(body, what="request body")
    else:
        await asyncio.get_running_loop().run_in_executor(_PARSERS, _parse_request_body, body)


def _parse_request_body(body: bytes) -> None:
    loads_json(body, what="request body")


def parses_body(method: str, path: str) -> bool:
    """Whether a body sent with `method` to `path` is parsed here as JSON: every body read here, whatever its
    Content-Type, bar the OCI routes' (which take none). Every route that takes a body must answer True."""
    return method not in BODILESS_METHODS and not STREAMED_BODY.fullmatch(path) and not _NO_BODY.fullmatch(path)


def _replay(body: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive
