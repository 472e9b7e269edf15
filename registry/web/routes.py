"""HTML routes: the registry's pages, rendered on the server from the same services as the API.

`create_app` includes `router` with the API's READ dependency, so a page is readable exactly when
the API behind it is (anonymous by default; a token limited to model patterns sees those models
only). Errors, the READ check's 401/403 included, render as HTML pages by `HTMLErrorRoute`.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from pydantic import BeforeValidator, Field

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError, NotFound
from kiln.core.hardware import HardwareCatalog
from kiln.core.performance import MAX_CONCURRENCY, MAX_CONTEXT, TOKENS_PER_S, TTFT_MS
from kiln.placement.fit import MEMORY_UTILIZATION
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import http_status
from kiln.registry.api.pages import next_page_url
from kiln.registry.api.params import (
    MODEL_NAME_PATTERN,
    AfterId,
    AfterModel,
    AfterVersion,
    ChannelName,
    ModelName,
    PageLimit,
    Version,
)
from kiln.registry.api.urls import artifact_file_url, base_url
from kiln.registry.artifacts.service import WITH_FILES_AND_EVALS
from kiln.registry.audit import service as audit_service
from kiln.registry.channels import service as channels_service
from kiln.registry.deps import PrincipalDep, SessionDep, SettingsDep
from kiln.registry.hardware.service import effective_catalog
from kiln.registry.models import service as models_service
from kiln.registry.paging import PAGE_LIMIT
from kiln.registry.releases import service as releases_service
from kiln.registry.resolve.query import MAX_POOLS, ResolveQuery
from kiln.registry.resolve.ranking import rank_release
from kiln.registry.resolve.snapshots import load_release_view, release_snapshot
from kiln.registry.resolve.views import ReleaseView
from kiln.registry.web.units import human_size
from kiln.registry.web.views import (
    METRIC_COLUMNS,
    NO_EVAL_REASON,
    audit_row,
    compact_json,
    fit_page,
    flat_rows,
    form_number,
    release_matrix,
    timestamp,
)

HERE = Path(__file__).parent
STYLESHEET = HERE / "static" / "kiln.css"

# autoescape everywhere: names, descriptions and reasons are user input. StrictUndefined: a typo
# in a template is an error in the tests, not an empty cell in production.
_templates = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_templates.filters["timestamp"] = timestamp
_templates.filters["json"] = compact_json
_templates.filters["size"] = human_size
_templates.filters["number"] = form_number

HTTP_REASONS = {401: "Unauthorized", 403: "Forbidden", 404: "Not found", 409: "Conflict", 422: "Invalid request"}


class PageLinks:
    """Root-relative URLs of the pages, under the app's root_path (a proxy's path prefix)."""

    def __init__(self, request: Request) -> None:
        self.root = str(request.scope.get("root_path", "")).rstrip("/")

    def page(self, *segments: str) -> str:
        return f"{self.root}/ui/" + "/".join(quote(s, safe="") for s in segments)

    def model(self, model: str) -> str:
        return self.page("models", model)

    def release(self, model: str, version: str) -> str:
        return self.page("models", model, "releases", version)

    def fit(self, model: str, version: str, query: str = "") -> str:
        return self.page("models", model, "releases", version, "fit") + (f"?{query}" if query else "")

    def channel(self, model: str, channel: str) -> str:
        return self.page("models", model, "channels", channel)

    def audit(self, model: str | None = None) -> str:
        return self.page("audit") + (f"?model={quote(model, safe='')}" if model else "")

    def api(self, path: str) -> str:
        return f"{self.root}{path}"


def render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """Render `template` with `context` and the page links."""
    html = _templates.get_template(template).render(links=PageLinks(request), **context)
    return HTMLResponse(html, status_code=status_code)


def error_page(request: Request, status: int, code: str, message: str) -> HTMLResponse:
    """The small HTML page every failed page request gets: status, stable code, message."""
    title = f"{status} {HTTP_REASONS.get(status, 'Error')}"
    return render(request, "error.html", status_code=status, title=title, code=code, message=message)


class HTMLErrorRoute(SessionRoute):
    """A route whose errors (from the route or its dependencies, READ included) render as HTML pages."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except KilnError as exc:
                return error_page(request, http_status(exc), exc.code, exc.message)
            except RequestValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()
                )
                return error_page(request, 422, Codes.INVALID_INPUT, f"invalid request: {problems}")

        return handle


router = APIRouter(route_class=HTMLErrorRoute, include_in_schema=False, default_response_class=HTMLResponse)
# Included after the Hub-compatible routes, so /ui/resolve/... still downloads from a model named "ui".
not_found_router = APIRouter(route_class=HTMLErrorRoute, include_in_schema=False)


@cache
def _stylesheet() -> bytes:
    return STYLESHEET.read_bytes()


@router.get("/")
def home(request: Request) -> RedirectResponse:
    """The registry's front page is the models list."""
    return RedirectResponse(PageLinks(request).page(), status_code=307)


@router.get("/ui/static/kiln.css", response_class=Response)
def stylesheet() -> Response:
    """The one stylesheet of the pages."""
    return Response(_stylesheet(), media_type="text/css", headers={"Cache-Control": "public, max-age=3600"})


@router.get("/ui/")
def models_page(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    after: AfterModel = None,
    limit: PageLimit = PAGE_LIMIT,
) -> HTMLResponse:
    """The models the caller may read, a page at a time by name, each with its newest release and where its
    channels point: three queries a page, whatever the number of models."""
    page = models_service.models_page(session, principal, after, limit)
    ids = [m.id for m in page.rows]
    summaries = releases_service.release_summaries(session, ids)
    channels = channels_service.channel_versions_of(session, ids)
    rows = [
        {
            "model": model,
            # The newest sealed release (what is served), else the newest of any state.
            "latest": summaries[model.id][0] if model.id in summaries else None,
            "releases": summaries[model.id][1] if model.id in summaries else 0,
            "channels": channels.get(model.id, []),
        }
        for model in page.rows
    ]
    return render(request, "models.html", title="Models", rows=rows, next=next_page_url(request, page.next, limit))


@router.get("/ui/models/{model}")
def model_page(
    model: ModelName,
    request: Request,
    session: SessionDep,
    after: AfterVersion = None,
    limit: PageLimit = PAGE_LIMIT,
) -> HTMLResponse:
    """A model: its releases a page at a time (newest first, yanked ones marked) and its channels with their
    versions."""
    row = models_service.get_model(session, model)
    page = releases_service.releases_page(session, model, after, limit)
    channels = channels_service.list_channels(session, model)
    pointed: dict[str, list[str]] = {}
    for channel, version in channels:
        pointed.setdefault(version, []).append(channel.name)
    last = page.next.version if page.next is not None else None
    return render(
        request,
        "model.html",
        title=model,
        model=row,
        releases=page.rows,
        channels=channels,
        pointed=pointed,
        next=next_page_url(request, last, limit),
    )


@router.get("/ui/models/{model}/releases/{version}")
def release_page(
    model: ModelName, version: Version, request: Request, session: SessionDep, settings: SettingsDep
) -> HTMLResponse:
    """A release: the artifact × runtime matrix with pass/fail per gate, quality against size, each
    artifact's files and provenance, and the release's lineage."""
    release = releases_service.get_release(
        session, model, version, releases_service.with_artifacts(*WITH_FILES_AND_EVALS)
    )
    matrix = release_matrix(release.artifacts, partial(artifact_file_url, base_url(request, settings), model, version))
    return render(
        request,
        "release.html",
        title=f"{model}@{version}",
        model=model,
        release=release,
        matrix=matrix,
        columns=METRIC_COLUMNS,
        no_eval_reason=NO_EVAL_REASON,
        lineage=flat_rows(release.lineage or {}, ("source_files",)),
        channels=channels_service.channels_of_release(session, release.id),
        missing=releases_service.missing_artifacts(release),
        # Download links only where downloads are answered: a sealed release that is not yanked.
        served=release.status == "sealed" and release.yanked_at is None,
    )


def _blank_is_none(value: Any) -> Any:
    """An empty form field (a GET form sends every field) is the parameter left out."""
    return None if value == "" else value


MAX_POOLS_TEXT = 1000  # as resolve's `hardware`
# resolve's SLO bounds, on the number itself: an empty field is None, which has no bounds.
TokensPerS = Annotated[float, Field(ge=TOKENS_PER_S[0], le=TOKENS_PER_S[1], allow_inf_nan=False)]
TtftMs = Annotated[float, Field(ge=TTFT_MS[0], le=TTFT_MS[1], allow_inf_nan=False)]


def default_pools(view: ReleaseView, catalog: HardwareCatalog) -> list[str]:
    """The SKUs the release's artifacts are built for that the catalog knows, in the catalog's order."""
    built = {h for a in view.artifacts for h in a.identity.hardware}
    return [p.name for p in catalog if p.name in built][:MAX_POOLS]


@router.get("/ui/models/{model}/releases/{version}/fit")
def fit_explorer(
    model: ModelName,
    version: Version,
    request: Request,
    session: SessionDep,
    pool: Annotated[
        list[str] | None, Query(description="a pool: an SKU, optionally with its free devices (h100:8)")
    ] = None,
    context: Annotated[int, Query(ge=1, le=MAX_CONTEXT)] = 4096,
    concurrency: Annotated[int, Query(ge=1, le=MAX_CONCURRENCY)] = 1,
    policy: Literal["latency", "cost", "quality"] = "latency",
    kv_cache_dtype: Literal["bf16", "fp8"] = "bf16",
    min_tokens_per_s: Annotated[TokensPerS | None, BeforeValidator(_blank_is_none), Query()] = None,
    max_ttft_ms: Annotated[TtftMs | None, BeforeValidator(_blank_is_none), Query()] = None,
) -> HTMLResponse:
    """Which artifact of a release resolve would load on the pools asked for, and why: every candidate with its
    memory per device, decode and TTFT figures (measured or from the catalog's peaks), cost and TP, and why each
    other one lost or does not fit. The release is judged by all its evals, as if a channel pointed at it now."""
    release = releases_service.get_release(session, model, version)
    catalog = effective_catalog(session)
    view = load_release_view(session, model, release_snapshot(session, model, version))
    asked = [p.strip() for p in pool or () if p.strip()]
    pools = ",".join(asked) if asked else ",".join(default_pools(view, catalog))
    if len(pools) > MAX_POOLS_TEXT:
        raise InvalidInput(f"the pools are over {MAX_POOLS_TEXT} characters", code=Codes.RESOLVE_POOLS_INVALID)
    query = ResolveQuery(pools, policy, context, concurrency, kv_cache_dtype, min_tokens_per_s, max_ttft_ms)
    parsed = query.pools if pools else ()  # a bad pool is refused here, an unknown SKU by the ranking
    content = fit_page(rank_release(view, catalog, query, f"{model}@{version}"), query) if parsed else None
    pool_texts = [f"{p.hardware}:{p.free_devices}" if p.free_devices is not None else p.hardware for p in parsed]
    # The same query on the model's other releases (without the pools when they were this release's defaults).
    slo = (("min_tokens_per_s", min_tokens_per_s), ("max_ttft_ms", max_ttft_ms))
    same = urlencode(
        [("pool", text) for text in (pool_texts if asked else ())]
        + [("context", context), ("concurrency", concurrency), ("policy", policy), ("kv_cache_dtype", kv_cache_dtype)]
        + [(name, form_number(value)) for name, value in slo if value is not None]
    )
    return render(
        request,
        "fit.html",
        title=f"Fit of {model}@{version}",
        model=model,
        release=release,
        releases=[
            r.version for r in releases_service.releases_page(session, model, None, PAGE_LIMIT).rows
        ],  # the newest
        query=query,
        pools=pool_texts,
        skus=[p.name for p in catalog],
        same=same,
        page=content,
        defaulted=not asked,
        usable_share=MEMORY_UTILIZATION,
    )


@router.get("/ui/models/{model}/channels/{channel}")
def channel_page(
    model: ModelName,
    channel: ChannelName,
    request: Request,
    session: SessionDep,
    after: AfterId = None,
    limit: PageLimit = PAGE_LIMIT,
) -> HTMLResponse:
    """A channel's current release and its promotion history, a page at a time: who, when, from → to, forced
    and why."""
    row, version, page = channels_service.channel_history_page(session, model, channel, after, limit)
    return render(
        request,
        "channel.html",
        title=f"{model}/{channel}",
        model=model,
        channel=row,
        version=version,
        history=page.rows,
        next=next_page_url(request, page.next, limit),
    )


@router.get("/ui/audit")
def audit_page(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    model: Annotated[str | None, Query(pattern=MODEL_NAME_PATTERN)] = None,
    after: AfterId = None,
    limit: PageLimit = PAGE_LIMIT,
) -> HTMLResponse:
    """The audit log, newest first, a page at a time: who did what, when, why, and the state before and after."""
    page = audit_service.events_page(session, principal, model, after, limit)
    events = [audit_row(e) for e in page.rows]
    return render(
        request,
        "audit.html",
        title="Audit log",
        events=events,
        model=model,
        limit=limit,
        next=next_page_url(request, page.next, limit),
    )


@not_found_router.get("/ui/{path:path}")
def no_such_page(path: str, request: Request) -> HTMLResponse:
    """Any other /ui/ URL: the HTML 404 page."""
    raise NotFound(f"no page at {request.url.path}", details={"path": path})
