"""Typed dependencies: the only way routes reach the database, the blob store, the settings and caches.

They are `async def` on purpose: FastAPI runs plain `def` dependencies in its thread pool, and
a thread hop per dependency per request is most of the cost of a fast route like resolve.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

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
