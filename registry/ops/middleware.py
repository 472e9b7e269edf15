"""One pure-ASGI middleware for every request: request id, timing, metrics, a JSON access log line, and
the headers every response carries.

Pure ASGI (not BaseHTTPMiddleware) so streamed downloads pass through untouched and the cost per
request stays a few microseconds. The request id is the caller's `X-Request-ID` when it sends a sane
one, else a new one; it is echoed in the response and in the log line. This is the one middleware
that wraps `send`: each wrapper is a coroutine call per message on every request.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from registry.ops.logs import ACCESS_LOGGER, AccessLineHandler
from registry.ops.metrics import RegistryMetrics

ACCESS_LOG = logging.getLogger(ACCESS_LOGGER)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class RequestIds:
    """Unique request ids, cheaply: a random prefix per process (drawn again after a fork) and a counter."""

    def __init__(self) -> None:
        self._renew()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._prefix = secrets.token_hex(10)
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):012x}"


_IDS = RequestIds()


class ObservabilityMiddleware:
    """The app's outermost middleware. `response_headers` adds what every response carries besides the
    request id (the security headers, `registry.api.boundary.add_security_headers`)."""

    def __init__(
        self, app: Any, metrics: RegistryMetrics, response_headers: Callable[[list[tuple[bytes, bytes]]], None]
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.response_headers = response_headers
        # The labelled series per (method, route, status): a lookup here is cheaper than `labels()`.
        # Bounded: routes are templates ("unmatched" for the rest) and methods the server's parser knows.
        self._children: dict[tuple[str, str, int], tuple[Any, Any, Any]] = {}

    def _series(self, method: str, route: str, status: int) -> tuple[Any, Any, Any]:
        key = (method, route, status)
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = (
                self.metrics.requests.labels(method, route, str(status)),
                self.metrics.latency.labels(method, route),
                self.metrics.bytes_served.labels(route),
            )
        return series

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        incoming = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID.fullmatch(incoming) else _IDS.next()
        scope.setdefault("state", {})["request_id"] = request_id
        status, sent = 500, 0

        async def send_wrapper(message: Any) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.setdefault("headers", [])
                headers.append((b"x-request-id", request_id.encode()))
                self.response_headers(headers)
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"]
            count, latency, served = self._series(method, route, status)
            count.inc()
            latency.observe(elapsed)
            if sent:
                served.inc(sent)
            if ACCESS_LOG.isEnabledFor(logging.INFO):
                access = {
                    "request_id": request_id,
                    "method": method,
                    "path": scope["path"],
                    "route": route,
                    "status": status,
                    "bytes": sent,
                    "duration_ms": round(elapsed * 1000, 3),
                    "client": (scope.get("client") or ("", 0))[0],
                }
                emit_access(access)


def emit_access(access: dict[str, Any]) -> None:
    """Log one request's access line: straight to the server's `AccessLineHandler` when it is the access
    log's only handler (`kiln serve`), else as a record every handler can take (tests, embedding apps)."""
    handlers = ACCESS_LOG.handlers
    if (
        not ACCESS_LOG.propagate
        and len(handlers) == 1
        and type(handlers[0]) is AccessLineHandler
        and handlers[0].level <= logging.INFO
    ):
        handlers[0].write_access(access)
        return
    # Fields travel as the record's `access` attribute: the JSON formatter serialises them once. The
    # record goes to the handlers directly: `info()` would also walk the stack for the caller's file
    # and line, which the line never shows.
    args = (access["method"], access["path"], access["status"])
    record = ACCESS_LOG.makeRecord(ACCESS_LOG.name, logging.INFO, "", 0, "%s %s %s", args, None)
    record.access = access
    ACCESS_LOG.handle(record)
