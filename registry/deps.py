"""Typed dependencies: the only way routes reach the database, the blob store, the settings and caches.

They are `async def` on purpose: FastAPI runs plain `def` dependencies in its thread pool, and
a thread hop per dependency per request is most of the cost of a fast route like resolve.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from kiln.errors import Unauthorized
from registry.auth.principal import ANONYMOUS, ANONYMOUS_READER, LOCAL, Principal, Scope
from registry.blobs.store import BlobStore
from registry.resolve.service import ResolveCache
from registry.settings import RegistrySettings


async def get_session(request: Request) -> AsyncIterator[Session]:
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.close()


async def get_blob_store(request: Request) -> BlobStore:
    store: BlobStore = request.app.state.blob_store
    return store


async def get_settings(request: Request) -> RegistrySettings:
    settings: RegistrySettings = request.app.state.settings
    return settings


async def get_resolve_cache(request: Request) -> ResolveCache:
    cache: ResolveCache = request.app.state.resolve_cache
    return cache


# scope="function": the session (and its pooled connection) is given back when the route returns,
# not after the response has been sent, so slow clients and long downloads hold no connection.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
BlobStoreDep = Annotated[BlobStore, Depends(get_blob_store)]
SettingsDep = Annotated[RegistrySettings, Depends(get_settings)]
ResolveCacheDep = Annotated[ResolveCache, Depends(get_resolve_cache)]


async def get_principal(request: Request) -> Principal:
    """The caller, from `Authorization: Bearer <token>`; anonymous without one; `local` when auth is off."""
    settings: RegistrySettings = request.app.state.settings
    if not settings.auth_required:
        return LOCAL
    header = request.headers.get("authorization")
    if header is None:
        return ANONYMOUS_READER if settings.anonymous_read else ANONYMOUS
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("the Authorization header must be 'Bearer <token>'", code="INVALID_TOKEN")
    principal: Principal | None = request.app.state.token_cache.lookup(secret.strip())
    if principal is None:
        raise Unauthorized("the token is unknown or revoked", code="INVALID_TOKEN")
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require(scope: Scope) -> Any:
    """A dependency refusing (401/403) callers without `scope` (and, for /models/{model}/..., that model)."""

    async def check(request: Request, principal: PrincipalDep) -> Principal:
        principal.require(scope, request.path_params.get("model"))
        return principal

    return Depends(check)
