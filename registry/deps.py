"""Typed dependencies: the only way routes reach the database, the blob store, the settings and caches.

They are `async def` on purpose: FastAPI runs plain `def` dependencies in its thread pool, and
a thread hop per dependency per request is most of the cost of a fast route like resolve. So each
one keeps the event loop's rule (docs/registry.md, "The event loop"): it answers from memory on
the loop, and hands anything that waits on the database to the thread pool (`get_principal` on a
token the cache does not hold, closing a session that still has a transaction to roll back).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar

import anyio.to_thread
from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from kiln.core.error_codes import Codes
from kiln.core.errors import Unauthorized
from kiln.registry.auth.cache import Missing
from kiln.registry.auth.principal import ANONYMOUS, ANONYMOUS_READER, LOCAL, Principal, Scope
from kiln.registry.settings import RegistrySettings
from kiln.storage.store import BlobStore

T = TypeVar("T")

# Threads that end transactions, apart from the default pool's. A write transaction on SQLite holds the
# database's write lock, and under load every thread of the default pool may be waiting for that lock in
# SQLite's busy handler: a transaction that needed one of those threads to end would keep the lock until
# they time out (503s after 10 s, every writer behind them stalled). So a transaction never waits for a
# default thread while it is open: it begins, writes and commits in one thread (`transact`, or a plain
# `def` route, which runs whole in one), and one still open when the route returns (it raised) is rolled
# back on these threads. FastAPI ends plain `def` dependencies on a limiter of their own for the same reason.
ENDING_THREADS = 8


async def _close(request: Request, session: Session) -> None:
    # A session still in a transaction closes with a ROLLBACK, a round trip to the database: in a
    # thread, of the limiter kept for it. One without (committed, or never used) has nothing to say to it.
    if session.in_transaction():
        await anyio.to_thread.run_sync(session.close, limiter=request.app.state.ending_limiter)
    else:
        session.close()


async def transact(session: Session, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` and the commit after it in one thread (a rollback in the same thread if it raises), for
    an `async def` route: its write transaction never spans two thread hops (see ENDING_THREADS)."""

    def run() -> T:
        try:
            result = work(*args)
            session.commit()
        except BaseException:
            session.rollback()
            raise
        return result

    return await run_in_threadpool(run)


async def get_session(request: Request) -> AsyncIterator[Session]:
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        await _close(request, session)


async def get_write_session(request: Request) -> AsyncIterator[Session]:
    """A session for a request that changes something: the route commits it (services only flush), in the
    thread that wrote (`transact` for an `async def` route), and reads what it answers before the commit:
    on SQLite a read after it would take the write lock again."""
    session: Session = request.app.state.write_session_factory()
    try:
        yield session
    finally:
        await _close(request, session)


async def get_blob_store(request: Request) -> BlobStore:
    store: BlobStore = request.app.state.blob_store
    return store


async def get_settings(request: Request) -> RegistrySettings:
    settings: RegistrySettings = request.app.state.settings
    return settings


# scope="function": the session (and its pooled connection) is given back when the route returns,
# not after the response has been sent, so slow clients and long downloads hold no connection.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
WriteSessionDep = Annotated[Session, Depends(get_write_session, scope="function")]
BlobStoreDep = Annotated[BlobStore, Depends(get_blob_store)]
SettingsDep = Annotated[RegistrySettings, Depends(get_settings)]


def _credentials(request: Request) -> Principal | str:
    """The caller when the headers alone say who it is (auth off, no token); else the bearer token's secret."""
    settings: RegistrySettings = request.app.state.settings
    if not settings.auth_required:
        return LOCAL
    # The raw header list, not `request.headers`: resolve asks this on every request.
    header = next((v.decode("latin-1") for k, v in request.scope["headers"] if k == b"authorization"), None)
    if header is None:
        return ANONYMOUS_READER if settings.anonymous_read else ANONYMOUS
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("the Authorization header must be 'Bearer <token>'", code=Codes.INVALID_TOKEN)
    return secret.strip()


def _known(principal: Principal | None) -> Principal:
    if principal is None:
        raise Unauthorized("the token is unknown, revoked or expired", code=Codes.INVALID_TOKEN)
    return principal


def authenticate(request: Request) -> Principal:
    """The caller, from `Authorization: Bearer <token>`; anonymous without one; `local` when auth is off.

    Blocking (a token the cache does not hold is looked up in the database): for threads; on the
    event loop, `authenticate_async`."""
    found = _credentials(request)
    return found if isinstance(found, Principal) else _known(request.app.state.token_cache.lookup(found))


async def authenticate_async(request: Request) -> Principal:
    """`authenticate` for the event loop: from the token cache on the loop, from the database in a thread."""
    found = _credentials(request)
    if isinstance(found, Principal):
        return found
    cache = request.app.state.token_cache
    hit = cache.cached(found)
    return _known(await run_in_threadpool(cache.lookup, found) if isinstance(hit, Missing) else hit)


def check_access(request: Request, principal: Principal, scope: Scope) -> None:
    """Refuse (401/403) unless `principal` has `scope` for every model the request names, in its path
    (/models/{model}/...) or its query (?model=...)."""
    named = request.query_params.getlist("model")
    if "model" in request.path_params:
        named.append(request.path_params["model"])
    check_models(principal, scope, named)


def check_models(principal: Principal, scope: Scope, models: list[str]) -> None:
    """Refuse (401/403) unless `principal` has `scope`, for each of `models` (every one a request names)."""
    principal.require(scope)
    for model in models:  # every value: a repeated ?model= must not slip one past the check
        principal.require(scope, model)


async def get_principal(request: Request) -> Principal:
    return await authenticate_async(request)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


class Require:
    """The dependency `require(scope)` returns: the caller, once `check_access` allows it."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    async def __call__(self, request: Request, principal: PrincipalDep) -> Principal:
        check_access(request, principal, self.scope)
        return principal


def require(scope: Scope) -> Any:
    """A dependency refusing (401/403) callers without `scope`, and callers whose token does not cover
    the model a request names, in its path (/models/{model}/...) or its query (?model=...)."""
    return Depends(Require(scope))


def required_scope(dependency: Any) -> Scope | None:
    """The scope a `require()` dependency checks; None for any other dependency."""
    return dependency.scope if isinstance(dependency, Require) else None
