"""The Hub endpoints `huggingface_hub` calls: revision info, tree listing, and HEAD/GET resolve with Range.

Revisions such as `prod/gguf-q4_k_m` reach us percent-encoded in one path segment
(`prod%2Fgguf-q4_k_m`); routing sees the decoded path, so the segments are read from the raw
path. An unencoded `prod/gguf-q4_k_m` (typed by hand) is accepted too.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

from fastapi import APIRouter, Query, Request, Response

from kiln.core.errors import NotFound
from kiln.core.manifest import MAX_PATH_CHARS
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.pages import PAGED, next_page_url
from kiln.registry.api.params import PageLimit
from kiln.registry.blobs.download import blob_response
from kiln.registry.deps import BlobStoreDep, PrincipalDep, SessionDep
from kiln.registry.hf_compat import service
from kiln.registry.hf_compat.service import COMMIT, Resolved
from kiln.registry.paging import MAX_PAGE_LIMIT

router = APIRouter(tags=["hf-compat"], route_class=SessionRoute)


def _raw_segments(request: Request) -> list[str]:
    """Path segments as sent, still percent-encoded (so an encoded '/' stays inside its segment)."""
    raw: bytes = request.scope.get("raw_path") or request.url.path.encode()
    return raw.decode("latin-1").split("?", 1)[0].strip("/").split("/")


def _split(segments: list[str], keyword: str, start: int) -> tuple[str, str, list[str]]:
    """(repo id, revision, remaining segments) around `keyword` (`revision`, `tree`, `resolve`)."""
    for at in (start + 1, start + 2):
        if len(segments) > at + 1 and segments[at] == keyword:
            repo = "/".join(unquote(s) for s in segments[start:at])
            rest = segments[at + 1 :]
            revision = unquote(rest[0])
            # `prod/gguf-q4_k_m` sent without encoding its '/': the next segment is part of the revision.
            if "/" not in revision and not COMMIT.fullmatch(revision) and len(rest) > 1:
                revision, rest = f"{revision}/{unquote(rest[1])}", rest[1:]
            return repo, revision, [unquote(s) for s in rest[1:]]
    raise NotFound(f"no such Hub endpoint: /{'/'.join(segments)}", details={"path": "/" + "/".join(segments)})


def _hub_time(when: datetime) -> str:
    """The Hub's timestamp format (the client parses exactly `%Y-%m-%dT%H:%M:%S.%fZ`)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _revision_info(resolved: Resolved) -> dict[str, Any]:
    a = resolved.artifact
    return {
        "_id": resolved.commit,
        "id": resolved.repo_id,
        "modelId": resolved.repo_id,
        "sha": resolved.commit,
        "private": False,
        "gated": False,
        "disabled": False,
        "createdAt": _hub_time(a.created_at),
        "lastModified": _hub_time(a.created_at),
        "tags": ["kiln", a.target, a.quant, a.format],
        "library_name": a.target,
        "siblings": [{"rfilename": f.path, "size": f.size} for f in a.files],
        "kiln": {"model": resolved.model, "version": resolved.version, "artifact": a.name, "hardware": a.hardware},
    }


@router.get(
    "/api/models/{path:path}",
    summary="Hub API: revision info and tree listing of an artifact (the tree a page at a time)",
    responses=PAGED,
)
def hub_api(
    path: str,
    request: Request,
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
    recursive: bool = False,
    cursor: str | None = Query(default=None, max_length=MAX_PATH_CHARS, description="the last path of the page before"),
    limit: PageLimit = MAX_PAGE_LIMIT,
) -> Any:
    segments = _raw_segments(request)  # ["api", "models", ...]
    keyword = "tree" if "tree" in segments[3:5] else "revision"
    repo, revision, rest = _split(segments, keyword, 2)
    principal.require("read", service.model_name(repo))
    resolved = service.resolve_revision(session, repo, revision)
    if keyword == "revision":
        if rest:
            raise NotFound(f"no such Hub endpoint: {request.url.path}", details={"path": request.url.path})
        return _revision_info(resolved)
    entries, more = service.tree_page(
        service.tree_entries(resolved, "/".join(rest), recursive=recursive), cursor, limit
    )
    if more:  # as the Hub pages a tree: huggingface_hub follows the Link as given
        url = next_page_url(request, str(entries[-1]["path"]), limit, cursor_name="cursor")
        response.headers["Link"] = f'<{url}>; rel="next"'
    return entries


def _resolve_file(request: Request, session: SessionDep, store: BlobStoreDep, principal: PrincipalDep) -> Response:
    repo, revision, rest = _split(_raw_segments(request), "resolve", 0)
    principal.require("read", service.model_name(repo))
    resolved = service.resolve_revision(session, repo, revision)
    entry = service.find_file(resolved, "/".join(rest))
    # A HEAD may be a redirect (S3 presigned downloads): the client takes its location and these headers.
    response = blob_response(request, store, entry.sha256, redirect_head=True)
    # What the client's HEAD reads: the commit its cache is keyed by, and the file's own digest and size.
    response.headers["X-Repo-Commit"] = resolved.commit
    response.headers["X-Linked-Etag"] = f'"{entry.sha256}"'
    response.headers["X-Linked-Size"] = str(entry.size)
    return response


for _pattern, _where in (("/{repo}/resolve/{path:path}", ""), ("/{namespace}/{repo}/resolve/{path:path}", "_ns")):
    for _method in ("GET", "HEAD"):
        router.add_api_route(
            _pattern,
            _resolve_file,
            methods=[_method],
            operation_id=f"hub_resolve{_where}_{_method.lower()}",
            summary="Hub API: download one file of an artifact (Range, ETag, X-Repo-Commit)",
            response_class=Response,
        )
