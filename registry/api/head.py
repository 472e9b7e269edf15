"""HEAD answers as GET does, on every route: the same status and headers, without the body.

FastAPI routes answer only the methods they name, so a GET-only route would leave HEAD to whatever
matches next (a 405, or a catch-all's 404: OCI clients probe with HEAD). `answer_head_like_get` gives
each GET-only route a twin for HEAD, placed right after it in its router so it wins exactly where the
GET would; the twin shares the route's handler and dependencies (its access checks included) and
stays out of the OpenAPI schema. The server sends no body for a HEAD.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute


def answer_head_like_get(app: FastAPI) -> None:
    """Add a HEAD twin after every route of `app` (and of the routers it includes) that answers GET and
    not HEAD. Idempotent: routers are module-level objects shared by every app built in a process."""
    _add_twins(app.router.routes)


def _add_twins(routes: list[Any]) -> None:
    index = 0
    while index < len(routes):
        route = routes[index]
        index += 1
        included = getattr(route, "original_router", None)  # an included router: its own routes
        if included is not None:
            _add_twins(included.routes)
            continue
        if not isinstance(route, APIRoute) or "GET" not in (route.methods or ()) or "HEAD" in (route.methods or ()):
            continue
        if index < len(routes) and getattr(routes[index], "head_twin_of", None) is route:
            index += 1
            continue
        twin = copy.copy(route)
        twin.methods = {"HEAD"}
        twin.include_in_schema = False
        twin.head_twin_of = route  # type: ignore[attr-defined]
        routes.insert(index, twin)
        index += 1
