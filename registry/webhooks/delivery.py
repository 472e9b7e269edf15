"""The sender: a background task in each server process that POSTs due deliveries, signed, and records
each attempt.

Every request carries `X-Kiln-Event`, `X-Kiln-Delivery` (the delivery's id), `X-Kiln-Timestamp` (Unix
seconds) and `X-Kiln-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<body>" keyed with the
webhook's secret>`. A 2xx answer delivers; anything else (another status, a refused connection, a
timeout) is retried after an exponential backoff, until the last attempt marks the delivery failed.
Database work runs in threads, off the event loop; nothing here runs inside a registry request.

Each attempt checks its URL again (`destinations`): the host is resolved, every address checked, and the
POST goes to a checked address, with the name in the Host header and as the TLS server name. Redirects
are not followed. An attempt's error is recorded as one of `ERROR_CLASSES`, never as the network's own
text: the delivery log must not tell an admin more about the network than whether a receiver answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import httpx2
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from kiln.core.errors import InvalidInput
from kiln.registry.db import create_db_engine, create_session_factory, utcnow
from kiln.registry.settings import RegistrySettings
from kiln.registry.webhooks import outbox
from kiln.registry.webhooks.destinations import (
    Destination,
    DestinationForbidden,
    DestinationPolicy,
    DestinationUnresolvable,
)
from kiln.registry.webhooks.outbox import AttemptResult, Claim, RetryPolicy

T = TypeVar("T")
LOG = logging.getLogger("kiln.registry.webhooks")
# Deliveries claimed per poll; the rest wait for the next one (or another process).
CLAIM_BATCH = 20
# How much longer than an attempt's time limit a claim is held: the attempt, then recording it.
LEASE_MARGIN_S = 60.0

# What an attempt's `error` says when it did not deliver: one of these names, nothing else.
ERROR_CLASSES: dict[str, str] = {
    "destination_forbidden": "the URL is (or now resolves to) an address webhooks may not reach; nothing was sent",
    "dns": "the host name did not resolve",
    "refused": "the connection was refused",
    "timeout": "no answer within the attempt's time limit (webhook_timeout_s)",
    "tls": "the TLS handshake failed (certificate, name or protocol)",
    "connection": "the connection failed or broke (unreachable, reset, closed)",
    "protocol": "the answer was not HTTP",
    "http_status": "the receiver answered with a status other than 2xx (in status_code); redirects are not followed",
    "internal": "the attempt failed inside the registry (its log says why)",
}


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The `X-Kiln-Signature` value: `sha256=` and the hex HMAC-SHA256 of `<timestamp>.<body>`."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def encode_body(payload: dict[str, object]) -> bytes:
    """The bytes POSTed (and signed): canonical JSON, so the same event is the same body on every attempt."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class DeliveryWorker:
    """Polls for due deliveries every `webhook_poll_interval_s`, sends them concurrently, settles each.

    Several processes (server workers, hosts) may each run one on the same database: claims are
    leased (`outbox.claim_due`), so a delivery is sent by one of them at a time. It has an engine of
    its own, with a small pool: requests and deliveries never wait for each other's connections.
    """

    def __init__(
        self, database_url: str, settings: RegistrySettings, destinations: DestinationPolicy | None = None
    ) -> None:
        self._database_url = database_url
        self._destinations = destinations or DestinationPolicy.from_settings(settings)
        self._engine: Engine | None = None
        self._read_sessions: sessionmaker[Session] | None = None
        self._write_sessions: sessionmaker[Session] | None = None
        self._policy = RetryPolicy.from_settings(settings)
        self._timeout_s = settings.webhook_timeout_s
        self._poll_s = settings.webhook_poll_interval_s
        self._lease_s = settings.webhook_timeout_s + LEASE_MARGIN_S
        self._task: asyncio.Task[None] | None = None
        self._http: httpx2.AsyncClient | None = None
        # The database work's own threads: `stop` waits for them before it disposes of the engine.
        self._threads: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start polling on the running event loop."""
        # No redirects: the configured URL is the receiver, and a 3xx is not a delivery. No proxies from
        # the environment: the connection goes to the checked address. No kept connections: one made for
        # one name must not carry another name's request to the same address.
        self._http = httpx2.AsyncClient(
            timeout=self._timeout_s,
            follow_redirects=False,
            trust_env=False,
            limits=httpx2.Limits(max_keepalive_connections=0),
        )
        self._engine = create_db_engine(self._database_url, pool_size=2, max_overflow=2)
        self._read_sessions = create_session_factory(self._engine)
        self._write_sessions = create_session_factory(self._engine, write=True)
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kiln-webhooks")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kiln-webhook-delivery")

    async def stop(self) -> None:
        """Stop at once: a POST under way is abandoned (its lease expires and it is sent again later);
        database work under way is finished."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._threads is not None:
            await asyncio.to_thread(self._threads.shutdown)
            self._threads = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _in_thread(self, work: Callable[..., T], *args: object) -> T:
        assert self._threads is not None, "start() the worker first"
        return await asyncio.get_running_loop().run_in_executor(self._threads, work, *args)

    async def _run(self) -> None:
        while True:
            try:
                sent = await self.run_once()
            except Exception:  # a database outage: log it and keep polling; it passes
                LOG.exception("webhook delivery: cannot claim or settle deliveries")
                sent = 0
            if sent < CLAIM_BATCH:  # a full batch: more may be due now
                await asyncio.sleep(self._poll_s)

    async def run_once(self) -> int:
        """Claim the due deliveries (up to a batch), send them, settle them; returns how many were sent."""
        claims = await self._in_thread(self._claim)
        outcomes = await asyncio.gather(*(self._deliver(claim) for claim in claims), return_exceptions=True)
        for claim, outcome in zip(claims, outcomes, strict=True):
            if isinstance(outcome, Exception):  # not settled: its lease expires and it is sent again
                LOG.error("webhook delivery %s: cannot record its attempt", claim.delivery_id, exc_info=outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
        return len(claims)

    def _claim(self) -> list[Claim]:
        assert self._read_sessions is not None and self._write_sessions is not None, "start() the worker first"
        now = utcnow()
        with self._read_sessions() as session:  # most polls find nothing: ask without the write lock
            if not outbox.has_due(session, now):
                return []
        with self._write_sessions() as session:
            claims = outbox.claim_due(session, now=utcnow(), lease_s=self._lease_s, limit=CLAIM_BATCH)
            session.commit()
        return claims

    def _settle(self, claim: Claim, result: AttemptResult) -> None:
        assert self._write_sessions is not None, "start() the worker first"
        with self._write_sessions() as session:
            state = outbox.settle(session, claim, result, self._policy)
            session.commit()
        if state is None:
            LOG.warning(
                "webhook delivery %s: lease lost before attempt %s was recorded", claim.delivery_id, claim.attempt
            )
        elif state == "failed":
            LOG.warning(
                "webhook delivery %s failed after %s attempts: %s", claim.delivery_id, claim.attempt, result.error
            )

    async def _deliver(self, claim: Claim) -> None:
        result = await self._post(claim)
        await self._in_thread(self._settle, claim, result)

    async def _post(self, claim: Claim) -> AttemptResult:
        assert self._http is not None, "start() the worker first"
        body = encode_body(claim.payload)
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "kiln-registry-webhooks/1",
            "X-Kiln-Event": claim.event,
            "X-Kiln-Delivery": str(claim.delivery_id),
            "X-Kiln-Timestamp": timestamp,
            "X-Kiln-Signature": sign(claim.secret, timestamp, body),
        }
        at = utcnow()
        started = time.perf_counter()
        status: int | None = None
        error: str | None = None
        try:
            # The whole attempt is bounded, resolving included: a receiver trickling bytes cannot hold it.
            async with asyncio.timeout(self._timeout_s):
                destination = await asyncio.to_thread(self._destinations.check, claim.url)
                status = await self._send(destination, body, headers)
            if not 200 <= status < 300:
                error = "http_status"
        except DestinationForbidden:
            error = "destination_forbidden"
        except DestinationUnresolvable:
            error = "dns"
        except InvalidInput:  # a URL stored before today's rules refuse it
            error = "destination_forbidden"
        except Exception as exc:  # whatever the receiver or the network does is a failed attempt, never a crash
            error = error_class(exc)
            if error == "internal":
                LOG.exception("webhook delivery %s: attempt %s failed", claim.delivery_id, claim.attempt)
        duration_ms = round((time.perf_counter() - started) * 1000)
        return AttemptResult(at=at, status_code=status, error=error, duration_ms=duration_ms)

    async def _send(self, destination: Destination, body: bytes, headers: dict[str, str]) -> int:
        """POST to the destination's first address that takes the connection; the answer's status."""
        assert self._http is not None, "start() the worker first"
        url = destination.url
        headers = {**headers, "Host": url.host_header}
        # Certificates are checked against the name, as if the URL's host had been connected to.
        extensions = {"sni_hostname": url.host} if url.scheme == "https" and url.address is None else {}
        for n, address in enumerate(destination.addresses, 1):
            try:
                # Streamed and never read: the answer's status is all that counts, whatever its body's size.
                async with self._http.stream(
                    "POST", url.url_to(address), content=body, headers=headers, extensions=extensions
                ) as response:
                    return response.status_code
            except httpx2.ConnectError as exc:
                if n == len(destination.addresses) or error_class(exc) == "tls":
                    raise
        raise AssertionError("a destination has at least one address")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, what caused it, and what those grouped, depth first."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)
        stack.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def error_class(exc: BaseException) -> str:
    """The `ERROR_CLASSES` name of an exception an attempt raised."""
    causes = list(_causes(exc))
    if any(isinstance(c, ssl.SSLError | ssl.CertificateError) for c in causes):
        return "tls"
    if any(isinstance(c, ConnectionRefusedError) for c in causes):
        return "refused"
    if any(isinstance(c, TimeoutError | httpx2.TimeoutException) for c in causes):
        return "timeout"
    if any(isinstance(c, socket.gaierror) for c in causes):
        return "dns"
    if isinstance(exc, httpx2.ProtocolError):
        return "protocol"
    if isinstance(exc, httpx2.TransportError | OSError):
        return "connection"
    return "internal"
