"""`create_app(settings)`: the registry as a FastAPI application.

Run it with uvicorn (uvloop + httptools; plain asyncio adds a ~40 ms floor per request):

    uvicorn --factory kiln.registry.app:create_app --loop uvloop --http httptools

Schema: the embedded default (no `database_url`: SQLite in `data_dir`) is migrated to head on
startup, so `kiln publish` into a fresh directory just works. Any explicit `database_url` is
never migrated implicitly: if it is not at head, `create_app` raises `Unavailable` with code
`DB_NOT_MIGRATED` and says how to migrate it.
"""

from __future__ import annotations

import fcntl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.to_thread
from fastapi import FastAPI
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from kiln.core.error_codes import Codes
from kiln.core.errors import Unavailable
from kiln.registry import migrate
from kiln.registry.api.boundary import RequestBoundaryMiddleware, add_security_headers
from kiln.registry.api.errors import error_responses, install_error_handlers
from kiln.registry.api.head import answer_head_like_get
from kiln.registry.api.health import router as health_router
from kiln.registry.api.lean_route import LeanLane
from kiln.registry.artifacts.service import ArtifactFileBlobs
from kiln.registry.attestations.routes import router as keys_router
from kiln.registry.attestations.service import AttestationBlobs
from kiln.registry.audit.routes import router as audit_router
from kiln.registry.auth.cache import TokenCache
from kiln.registry.auth.routes import router as auth_router
from kiln.registry.blobs.references import BlobReferences
from kiln.registry.blobs.routes import router as blobs_router
from kiln.registry.blobs.stores import open_blob_store
from kiln.registry.channels.routes import router as channels_router
from kiln.registry.channels.service import channels_of_release, drop_from_splits
from kiln.registry.db import create_db_engine, create_session_factory
from kiln.registry.deps import ENDING_THREADS, require
from kiln.registry.hardware.routes import router as hardware_router
from kiln.registry.hf_compat.routes import router as hf_compat_router
from kiln.registry.models.routes import router as models_router
from kiln.registry.oci.base_image import load_base_image
from kiln.registry.oci.modelcar import record_release_layers
from kiln.registry.oci.routes import router as oci_router
from kiln.registry.oci.service import ModelCarLayerBlobs
from kiln.registry.ops.metrics import RegistryMetrics
from kiln.registry.ops.middleware import ObservabilityMiddleware, RequestLog
from kiln.registry.performance.routes import router as performance_router
from kiln.registry.releases.artifact_routes import router as artifacts_router
from kiln.registry.releases.attestation_routes import router as attestations_router
from kiln.registry.releases.contents import check_blob_readable
from kiln.registry.releases.followers import ReleaseFollowers
from kiln.registry.releases.routes import router as releases_router
from kiln.registry.resolve.cache import ChannelFingerprints, ResolveCache
from kiln.registry.resolve.routes import router as resolve_router
from kiln.registry.settings import RegistrySettings
from kiln.registry.web.routes import not_found_router as web_not_found_router
from kiln.registry.web.routes import router as web_router
from kiln.registry.webhooks.delivery import DeliveryWorker
from kiln.registry.webhooks.destinations import DestinationPolicy, Resolver
from kiln.registry.webhooks.outbox import subscribe_to_audit
from kiln.registry.webhooks.routes import router as webhooks_router
from kiln.storage.store import BlobStore

OPENAPI_TAGS = [
    {"name": "models", "description": "Named models."},
    {"name": "releases", "description": "Immutable versions of a model."},
    {"name": "artifacts", "description": "Built artifacts of a release, their files and eval results."},
    {"name": "blobs", "description": "Content-addressed uploads and downloads."},
    {"name": "attestations", "description": "Artifact signatures and provenance, verified on upload; trusted keys."},
    {"name": "channels", "description": "dev/staging/prod aliases; promotion is gated on evals."},
    {"name": "resolve", "description": "What a pool of some hardware should load, on how many devices, and why."},
    {"name": "hardware", "description": "The hardware catalog resolve sizes replicas with (changes: admin)."},
    {"name": "performance", "description": "Measured serving performance per artifact and SKU."},
    {"name": "audit", "description": "Audit log."},
    {"name": "tokens", "description": "API tokens with scopes (admin)."},
    {"name": "webhooks", "description": "Registry events POSTed, signed, to subscribers; the delivery log (admin)."},
    {"name": "health", "description": "Liveness, readiness and Prometheus metrics."},
    {"name": "hf-compat", "description": "Hugging Face Hub-compatible downloads (HF_ENDPOINT=<registry>)."},
]


def _check_schema(engine: Engine, settings: RegistrySettings) -> None:
    try:
        current = migrate.current_revision(engine)
    except OperationalError as exc:
        raise Unavailable(f"cannot connect to the registry database: {exc.orig}") from None
    head = migrate.head_revision()
    if current != head:
        state = "has no registry schema" if current is None else f"is at revision {current}"
        raise Unavailable(
            f"the registry database {state}, this code needs {head}; run `kiln db upgrade` "
            "(or `python -m kiln.registry.migrate upgrade`) with the same KILN_REGISTRY_DATABASE_URL",
            code=Codes.DB_NOT_MIGRATED,
            details={"current": current, "head": head},
        )


# The domains whose rows reference blobs, which garbage collection asks (registry.blobs.references).
BLOB_REFERENCES: tuple[BlobReferences, ...] = (ArtifactFileBlobs(), AttestationBlobs(), ModelCarLayerBlobs())

READ = require("read")
# What any route may answer besides its own statuses: no or a refused token, a body over the limit
# or malformed, a backend outage.
COMMON_ERRORS = error_responses(401, 403, 413, 422, 503)


@dataclass(frozen=True)
class Storage:
    """What the registry stores into: its database (migrated where embedded, schema checked) and its blob store."""

    engine: Engine
    blob_store: BlobStore
    blob_references: tuple[BlobReferences, ...] = BLOB_REFERENCES  # what holds blobs, for collection

    def sessions(self, *, write: bool = False) -> Callable[[], Session]:
        return create_session_factory(self.engine, write=write)


def open_storage(settings: RegistrySettings) -> Storage:
    """The database and blob store of `settings`, as the server opens them (the CLI's `gc` too): an embedded
    directory is created and migrated under a lock (several processes may open a new one at once); a server
    database must already be at this code's schema."""
    database_url = settings.effective_database_url()
    if settings.is_embedded:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        with open(settings.data_dir / ".migrate.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            migrate.upgrade(database_url)
    engine = create_db_engine(database_url)
    try:
        _check_schema(engine, settings)
        return Storage(engine, open_blob_store(settings.effective_blob_url(), settings))
    except BaseException:
        engine.dispose()
        raise


def create_app(settings: RegistrySettings | None = None, *, webhook_resolver: Resolver | None = None) -> FastAPI:
    """Build the registry app: engine, session factory and blob store from `settings` (env if None).

    `webhook_resolver` resolves webhook host names (default: the system's resolver)."""
    settings = settings or RegistrySettings()
    database_url = settings.effective_database_url()
    storage = open_storage(settings)
    subscribe_to_audit()  # the registry events the audit log records are queued for webhooks
    engine = storage.engine
    try:
        modelcar_base = (
            load_base_image(settings.modelcar_base, settings.modelcar_platform) if settings.modelcar_base else None
        )
    except BaseException:
        engine.dispose()
        raise

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.request_threads
        webhooks = DeliveryWorker(database_url, settings, app.state.webhook_destinations)
        if settings.webhook_delivery:
            webhooks.start()
        try:
            yield
        finally:
            await webhooks.stop()
            app.state.request_log.flush()
            app.state.resolve_cache.fingerprints.close()
            engine.dispose()

    app = FastAPI(
        title="kiln registry",
        summary="Verified, hardware-specific LLM artifacts, and which one each node should load.",
        version="1",
        openapi_tags=OPENAPI_TAGS,
        lifespan=lifespan,
        # Prometheus (`/metrics`) and the access line are the registry's own; FastAPI's OpenTelemetry
        # instrumentation otherwise asks the global providers on every request whether one is configured.
        telemetry=None if settings.opentelemetry else {"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = storage.sessions()
    app.state.write_session_factory = storage.sessions(write=True)
    app.state.ending_limiter = anyio.CapacityLimiter(ENDING_THREADS)
    app.state.blob_store = storage.blob_store
    app.state.blob_references = storage.blob_references
    app.state.blob_readable = check_blob_readable  # registry.blobs.references.BlobReadable
    app.state.modelcar = modelcar_base
    app.state.release_followers = ReleaseFollowers(
        serving=channels_of_release,
        yanked=drop_from_splits,
        sealed=record_release_layers if modelcar_base is not None else None,
    )
    app.state.webhook_destinations = DestinationPolicy.from_settings(settings, webhook_resolver)
    app.state.resolve_cache = ResolveCache(ChannelFingerprints(engine))
    app.state.token_cache = TokenCache(app.state.session_factory)
    app.state.metrics = RegistryMetrics()
    # Resolve, the hot path, is answered here, inside the boundary and observability middleware and in
    # front of FastAPI's routing; FastAPI documents it (included below). registry.api.lean_route.
    app.add_middleware(LeanLane, routes=resolve_router.routes)
    app.add_middleware(RequestBoundaryMiddleware, max_body_bytes=settings.max_body_bytes)
    # Outermost: sees every answer, and adds the request id and the security headers to each.
    app.state.request_log = RequestLog(app.state.metrics)
    app.add_middleware(ObservabilityMiddleware, log=app.state.request_log, response_headers=add_security_headers)
    install_error_handlers(app)
    for router in (
        models_router,
        releases_router,
        artifacts_router,
        attestations_router,
        keys_router,
        blobs_router,
        channels_router,
        audit_router,
        auth_router,
        webhooks_router,
        hardware_router,
        performance_router,
    ):
        # Every API route needs at least `read` (anonymous when settings.anonymous_read); routes
        # that change anything add their own scope.
        app.include_router(router, dependencies=[READ], responses=COMMON_ERRORS)  # each router has its /v1 prefix
    app.include_router(resolve_router, responses=COMMON_ERRORS)  # its READ is its own: the lane runs it
    app.include_router(health_router, responses=error_responses(503))
    # /v2/: the OCI distribution API (its own error shape; each read checks `read` on the repository's model).
    app.include_router(oci_router)
    # The web pages read through the same services, under the same READ rule, as the API.
    app.include_router(web_router, dependencies=[READ])
    # Last: its /{repo}/resolve/... patterns are the most general.
    app.include_router(
        hf_compat_router, dependencies=[READ], responses={**COMMON_ERRORS, **error_responses(400, 404, 416)}
    )
    # After those: any other /ui/ URL is an HTML 404 page.
    app.include_router(web_not_found_router, dependencies=[READ])
    answer_head_like_get(app)  # every GET route answers HEAD the same way, without the body
    return app
