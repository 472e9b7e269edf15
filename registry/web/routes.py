"""HTML routes: the registry's pages, rendered on the server from the same services as the API.

`create_app` includes `router` with the API's READ dependency, so a page is readable exactly when
the API behind it is (anonymous by default; a token limited to model patterns sees those models
only). Errors, the READ check's 401/403 included, render as HTML pages by `HTMLErrorRoute`.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from core.errors import KilnError, NotFound
from registry.api.errors import http_status
from registry.api.params import MODEL_NAME_PATTERN, ChannelName, ModelName, Version
from registry.api.urls import artifact_file_url, base_url
from registry.artifacts.service import WITH_FILES_AND_EVALS
from registry.audit import service as audit_service
from registry.channels import service as channels_service
from registry.deps import PrincipalDep, SessionDep, SettingsDep
from registry.models import service as models_service
from registry.releases import service as releases_service
from registry.web.units import human_size
from registry.web.views import (
    METRIC_COLUMNS,
    NO_EVAL_REASON,
    audit_row,
    compact_json,
    flat_rows,
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


class HTMLErrorRoute(APIRoute):
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
                return error_page(request, 422, "INVALID_INPUT", f"invalid request: {problems}")

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
def models_page(request: Request, session: SessionDep, principal: PrincipalDep) -> HTMLResponse:
    """The models the caller may read, each with its newest release and where its channels point."""
    rows = []
    for model in models_service.list_models(session, principal):
        releases = releases_service.list_releases(session, model.name)
        channels = channels_service.model_channel_versions(session, model.id)
        rows.append(
            {
                "model": model,
                # The newest sealed release (what is served), else the newest of any state.
                "latest": next((r for r in releases if r.status == "sealed"), releases[0] if releases else None),
                "releases": len(releases),
                "channels": sorted(channels.items()),
            }
        )
    return render(request, "models.html", title="Models", rows=rows)


@router.get("/ui/models/{model}")
def model_page(model: ModelName, request: Request, session: SessionDep) -> HTMLResponse:
    """A model: its releases (newest first, yanked ones marked) and its channels with their versions."""
    row = models_service.get_model(session, model)
    releases = releases_service.list_releases(session, model)
    channels = channels_service.list_channels(session, model)
    pointed: dict[str, list[str]] = {}
    for channel, version in channels:
        pointed.setdefault(version, []).append(channel.name)
    return render(request, "model.html", title=model, model=row, releases=releases, channels=channels, pointed=pointed)


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


@router.get("/ui/models/{model}/channels/{channel}")
def channel_page(model: ModelName, channel: ChannelName, request: Request, session: SessionDep) -> HTMLResponse:
    """A channel's current release and its promotion history: who, when, from → to, forced and why."""
    row, version, history = channels_service.get_channel(session, model, channel)
    return render(
        request, "channel.html", title=f"{model}/{channel}", model=model, channel=row, version=version, history=history
    )


@router.get("/ui/audit")
def audit_page(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    model: Annotated[str | None, Query(pattern=MODEL_NAME_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> HTMLResponse:
    """The audit log, newest first: who did what, when, why, and the state before and after."""
    events = [audit_row(e) for e in audit_service.list_events(session, principal, model, limit)]
    return render(request, "audit.html", title="Audit log", events=events, model=model, limit=limit)


@not_found_router.get("/ui/{path:path}")
def no_such_page(path: str, request: Request) -> HTMLResponse:
    """Any other /ui/ URL: the HTML 404 page."""
    raise NotFound(f"no page at {request.url.path}", details={"path": path})
