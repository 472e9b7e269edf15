"""One pure-ASGI middleware for every request: request id, timing, metrics, a JSON access log line, and
the headers every response carries.

Pure ASGI (not BaseHTTPMiddleware) so streamed downloads pass through untouched and the cost per
request stays a few microseconds. The request id is the caller's `X-Request-ID` when it sends a sane
one, else a new one; it is echoed in the response and in the log line. This is the one middleware
that wraps `send`: each wrapper is a coroutine call per message on every request.

What a request leaves behind (its metrics and its access line) is one tuple in a `RequestLog`, handed
on in batches: with `kiln serve`'s workers each Prometheus value is a shared-memory write behind a
lock and a pid check, and each JSON line an encoder call, which per request cost about what a cached
resolve does.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kiln.registry.ops.logs import ACCESS_LOGGER, AccessLineHandler, access_fields
from kiln.registry.ops.metrics import RegistryMetrics

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


# What `RequestLog` keeps of one request: when it ended (time.time()), its id, method, path, route
# template, status, body bytes sent, seconds taken, and the client's address.
Entry = tuple[float, str, str, str, str, int, int, float, str]


class RequestLog:
    """Each answered request's metrics and access line, kept in memory and handed on in batches.

    `add` appends one `Entry`; the batch goes out `FLUSH_S` after its first entry (a timer on the event
    loop), when `MAX_PENDING` wait, off an event loop at once, and before `/metrics` is read (so a
    process's own exposition is never behind) and at shutdown. Metrics are added up per series first:
    a counter gets one increment per batch, the latency histogram one per bucket that moved. Like
    nginx's `access_log ... buffer= flush=`, a worker killed outright loses at most its last `FLUSH_S`.

    The access line is written by `kiln serve`'s `AccessLineHandler` in the batch; where the access log
    has other handlers (tests, an embedding app) each request's line is a record, logged at once."""

    FLUSH_S = 0.1
    MAX_PENDING = 256

    def __init__(self, metrics: RegistryMetrics) -> None:
        self.metrics = metrics
        self._pending: list[Entry] = []
        self._lock = threading.Lock()  # /metrics is answered in a thread; the rest on the event loop
        self._timer: asyncio.TimerHandle | None = None
        # The labelled series per (method, route, status): a lookup here is cheaper than `labels()`.
        # Bounded: routes are templates ("unmatched" for the rest) and methods the server's parser knows.
        self._children: dict[tuple[str, str, int], tuple[Any, Any, Any]] = {}

    def add(self, entry: Entry) -> None:
        handler = access_handler()
        if handler is None and ACCESS_LOG.isEnabledFor(logging.INFO):
            log_access(entry)
        with self._lock:
            self._pending.append(entry)
            if len(self._pending) < self.MAX_PENDING and self._timer is None:
                try:
                    self._timer = asyncio.get_running_loop().call_later(self.FLUSH_S, self.flush)
                    return
                except RuntimeError:  # not on an event loop: nothing would come back to flush it
                    pass
            elif len(self._pending) < self.MAX_PENDING:
                return
        self.flush()

    def flush(self) -> None:
        """Hand on what is pending: metrics to Prometheus, lines to `kiln serve`'s access handler."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            entries, self._pending = self._pending, []
        if not entries:
            return
        self._count(entries)
        handler = access_handler()
        if handler is not None:
            handler.write_lines(entries)

    def _count(self, entries: Sequence[Entry]) -> None:
        totals: dict[tuple[str, str, int], tuple[int, int, list[float]]] = {}
        for entry in entries:
            key = (entry[2], entry[4], entry[5])
            count, sent, latencies = totals.get(key) or (0, 0, [])
            latencies.append(entry[7])
            totals[key] = (count + 1, sent + entry[6], latencies)
        for (method, route, status), (count, sent, latencies) in totals.items():
            requests, latency, served = self._series(method, route, status)
            requests.inc(count)
            observe_all(latency, latencies)
            if sent:
                served.inc(sent)

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


def observe_all(histogram: Any, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for each of `values`, as one increment per bucket that moved and one of the
    sum, where the client's histogram is the one this was written against (its `_upper_bounds`,
    `_buckets` and `_sum`; the test checks the exposition equals one `observe` per value)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    moved = [0] * len(bounds)
    for value in values:
        moved[bisect.bisect_left(bounds, value)] += 1  # the first bound >= value, as `observe` picks
    total.inc(sum(values))
    for i, n in enumerate(moved):
        if n:
            buckets[i].inc(n)


class ObservabilityMiddleware:
    """The app's outermost middleware. `response_headers` adds what every response carries besides the
    request id (the security headers, `registry.api.boundary.add_security_headers`); `log` takes what each
    request leaves behind."""

    def __init__(
        self, app: Any, log: RequestLog, response_headers: Callable[[list[tuple[bytes, bytes]]], None]
    ) -> None:
        self.app = app
        self.log = log
        self.response_headers = response_headers

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
            client = (scope.get("client") or ("", 0))[0]
            self.log.add(
                (time.time(), request_id, scope["method"], scope["path"], route, status, sent, elapsed, client)
            )


def access_handler() -> AccessLineHandler | None:
    """`kiln serve`'s access handler when it is the access log's only one and takes INFO, else None."""
    handlers = ACCESS_LOG.handlers
    if (
        not ACCESS_LOG.propagate
        and len(handlers) == 1
        and type(handlers[0]) is AccessLineHandler
        and handlers[0].level <= logging.INFO
        and ACCESS_LOG.isEnabledFor(logging.INFO)
    ):
        return handlers[0]
    return None


def log_access(entry: Entry) -> None:
    """One request's access line as a record every handler can take (tests, embedding apps). Its fields
    travel as the record's `access` attribute: `JsonFormatter` serialises them once. The record goes to
    the handlers directly: `info()` would also walk the stack for the caller's file and line, which the
    line never shows."""
    access = access_fields(entry)
    args = (access["method"], access["path"], access["status"])
    record = ACCESS_LOG.makeRecord(ACCESS_LOG.name, logging.INFO, "", 0, "%s %s %s", args, None)
    record.created = entry[0]
    record.access = access
    ACCESS_LOG.handle(record)
