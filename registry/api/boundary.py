"""The request boundary: every request body is bounded and every JSON body is strict; every response
carries the security headers browsers act on.

One pure-ASGI middleware, in front of the routes:
- A body (other than a blob upload, which streams to the store under its own limit) may be at
  most `max_body_bytes`: a larger `Content-Length`, or a chunked body that grows past it, is
  answered 413 PAYLOAD_TOO_LARGE before the route runs.
- A JSON body is parsed once by `core.untrusted.loads_json` (no NaN, no out-of-range numbers, no NUL or
  unpaired surrogates, no duplicate keys, bounded nesting) and refused with 422 INVALID_JSON
  otherwise; the route then reads the same bytes. So no route and no database column ever sees
  a value it cannot store, whatever the route's own schema says.
- Responses get `X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY`, `Referrer-Policy`
  and, on HTML pages, a Content-Security-Policy that allows nothing but the page's own stylesheet
  (`add_security_headers`, which the app's outermost middleware applies to every response, this
  one's refusals included: one wrapper of `send` per request instead of one per middleware).
"""

from __future__ import annotations

import re
from typing import Any

from core.errors import InvalidInput, KilnError
from core.untrusted import loads_json
from registry.api.errors import error_response

# Blob uploads stream their bodies to the store (limited by settings.max_upload_bytes there).
_STREAMED_BODY = re.compile(r"^/v1/blobs/[^/]+$")
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
        code="PAYLOAD_TOO_LARGE",
        details={"limit": limit},
    )


def add_security_headers(headers: list[tuple[bytes, bytes]]) -> None:
    """Add the security headers to a response's `headers` (its `http.response.start` message's)."""
    headers.extend(SECURITY_HEADERS)
    content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    if content_type.startswith(b"text/html"):
        headers.append((b"content-security-policy", PAGE_CSP))


class RequestBoundaryMiddleware:
    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        if scope["method"] in ("GET", "HEAD", "OPTIONS") or _STREAMED_BODY.fullmatch(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(scope, receive)
            if body and _is_json(scope):
                loads_json(body, what="request body")
        except KilnError as exc:
            await error_response(exc)(scope, _replay(b""), send)
            return
        await self.app(scope, _replay(body), send)

    async def _read_body(self, scope: Any, receive: Any) -> bytes:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and (len(value) > 18 or int(value) > limit):
                raise _too_large(limit)
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
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(parts)


def _is_json(scope: Any) -> bool:
    """Bodies FastAPI would parse as JSON: a JSON content type, or none at all."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True


def _replay(body: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive
