"""Listings a page at a time over HTTP (`registry.paging`): the URL of the next page, and the API's `Link` to it.

A page of the API answers its rows as the listing always did (a JSON array) and names the next page, when there
is one, in a `Link: <url>; rel="next"` header (RFC 8288), as the OCI tag listing does; a web page links to it.
The URL is the same path and query with `after` the page's last row: a client follows it as given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlencode

from fastapi import Request, Response
from fastapi.dependencies.models import Dependant

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.registry.paging import PAGE_LIMIT, Page

Row = TypeVar("Row")

NEXT_LINK_HEADERS: dict[str, Any] = {
    "Link": {
        "description": 'the next page, as `<URL>; rel="next"` (absent on the last page)',
        "schema": {"type": "string"},
    }
}
# OpenAPI `responses=` for a paged listing: its 200 may carry the `Link` header.
PAGED: dict[int | str, dict[str, Any]] = {200: {"headers": NEXT_LINK_HEADERS}}


def next_page_url(request: Request, after: str | int | None, limit: int, cursor_name: str = "after") -> str | None:
    """The root-relative URL of the page after this one (the same query, `cursor_name`, `after` by default, the
    cursor), or None on the last page."""
    if after is None:
        return None
    query = [(k, v) for k, v in request.query_params.multi_items() if k not in (cursor_name, "limit")]
    query += [(cursor_name, str(after))] + ([("limit", str(limit))] if limit != PAGE_LIMIT else [])
    root = str(request.scope.get("root_path", "")).rstrip("/")
    return f"{root}{request.url.path}?{urlencode(query)}"


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route declares, its dependencies' included."""
    return {p.alias for p in dependant.query_params}.union(*(_query_names(d) for d in dependant.dependencies))


def page_rows(
    request: Request,
    response: Response,
    page: Page[Row, Any],
    limit: int,
    cursor: Callable[[Any], str | int] = lambda after: after,
) -> list[Row]:
    """The page's rows; `response` gets the `Link` to the next page unless this is the last. `cursor` turns the
    page's cursor into the `after` of the next page's URL (a release: its version). A query parameter the route
    does not declare (an empty name too) is refused: the next page's URL would carry it on."""
    route = request.scope.get("route")
    if (dependant := getattr(route, "dependant", None)) is not None:
        declared = _query_names(dependant)
        if unknown := sorted(set(request.query_params) - declared):
            raise InvalidInput(
                f"unknown query parameter(s) {', '.join(map(repr, unknown))}; this listing takes {sorted(declared)}",
                code=Codes.INVALID_INPUT,
                details={"unknown": unknown, "known": sorted(declared)},
            )
    url = next_page_url(request, None if page.next is None else cursor(page.next), limit)
    if url is not None:
        response.headers["Link"] = f'<{url}>; rel="next"'
    return page.rows
