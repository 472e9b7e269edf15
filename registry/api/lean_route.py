"""The lean lane: hot routes declared like any other, answered in front of FastAPI's per-request machinery.

FastAPI documents and validates a route from its endpoint's signature. Answering a request it
matches the path against every route of every included router, passes the request through its
own middleware (error telemetry, body limits, exception handling, an exit stack), solves the
dependency graph (each dependency an awaited call with its own bookkeeping), validates every
parameter one by one, and serialises the answer. For a route whose own work is a dict lookup (a
warm resolve, asked by every router on every failover) that is most of the cost.

A `LeanRoute` keeps the declaration: the OpenAPI operation and the parameter definitions come from
the endpoint as usual, and FastAPI documents it. `LeanLane`, a middleware inside the app's own
(request ids, metrics, access log, security headers), answers the lean routes it is given by exact
path and method, with only what such an endpoint needs:

- the query parameters are validated against the endpoint's declared fields in one call (the same
  rules, the same 422); a query asked before is not validated again (routers ask the same few
  questions over and over). What is kept is keyed on the declared parameters' values, so parameters
  the route does not declare are neither kept nor able to make a query look new, and a query string
  longer than `MAX_QUERY_BYTES` is refused (QUERY_TOO_LONG) before it is parsed: what the lane keeps
  is bounded by `_MAX_QUERIES` x `MAX_QUERY_BYTES`;
- the route's dependencies (its own and its router's) must be `require(scope)` checks, which run
  as `authenticate_async` and `check_models` on the query's models, the calls the dependency itself
  makes; any other dependency is refused when the lane is built, so no check is ever skipped.
  Dependencies given to `include_router` do not reach the lane: a lean router declares its own;
- the endpoint is `async`, takes `request` and query parameters only, and returns a Response;
- an error is answered by the app's exception handlers for its class, as any route's is; an
  unexpected one propagates to the server-error middleware, as any route's does.

Everything else (other methods, other paths) goes on to FastAPI unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError, create_model
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.auth.principal import Scope
from kiln.registry.deps import authenticate_async, check_models, required_scope

Handler = Callable[[Request], Awaitable[Response]]
_MAX_QUERIES = 4096  # distinct valid queries kept per lean route (dropped all at once when full)
# Resolve's longest valid query (1,000 characters of pools, a 256-character key, names) percent-encoded
# is under 4 KiB; twice that leaves room for encodings without letting junk be kept.
MAX_QUERY_BYTES = 8 * 1024


class LeanRoute(SessionRoute):
    """An API route `LeanLane` answers. FastAPI still documents it (and answers it where no lane runs)."""

    def lean_handler(self) -> Handler:
        """The request -> response call the lane makes: authorize, validate the query, call the endpoint."""
        dependant = self.dependant
        scopes = [required_scope(d.call) for d in dependant.dependencies]
        others = [f.name for f in (*dependant.path_params, *dependant.header_params, *dependant.body_params)]
        if None in scopes or others or dependant.request_param_name != "request":
            raise TypeError(
                f"LeanRoute {self.path}: the endpoint must take `request` and query parameters only, "
                "and its dependencies must be require() checks"
            )
        required: list[Scope] = [s for s in scopes if s is not None]
        query = _query_model(self.name, dependant.query_params)
        endpoint = self.endpoint
        declared = tuple(f.alias for f in dependant.query_params)
        # the declared parameters' values -> their validated values; only valid queries are kept
        seen: dict[tuple[tuple[str, ...], ...], dict[str, Any]] = {}

        async def handle(request: Request) -> Response:
            raw: bytes = request.scope["query_string"]
            if len(raw) > MAX_QUERY_BYTES:
                raise InvalidInput(
                    f"the query string is {len(raw)} bytes; at most {MAX_QUERY_BYTES}",
                    code=Codes.QUERY_TOO_LONG,
                    details={"max_bytes": MAX_QUERY_BYTES},
                )
            params = request.query_params
            asked = tuple(tuple(params.getlist(name)) for name in declared)
            known = seen.get(asked)
            models = params.getlist("model")
            if required:
                principal = await authenticate_async(request)
                for scope in required:
                    check_models(principal, scope, models)
            if known is None:
                try:
                    values = query.model_validate(dict(params)).__dict__
                except ValidationError as exc:
                    raise RequestValidationError(
                        [{**e, "loc": ("query", *e["loc"])} for e in exc.errors(include_url=False)]
                    ) from None
                if len(seen) >= _MAX_QUERIES:
                    seen.clear()
                known = seen[asked] = values
            response: Response = await endpoint(request=request, **known)
            return response

        return handle


class LeanLane:
    """ASGI middleware answering `routes` (LeanRoutes) by exact method and path; the rest goes to `app`."""

    def __init__(self, app: Any, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self._routes: dict[tuple[str, str], tuple[LeanRoute, Handler]] = {}
        for route in routes:
            if not isinstance(route, LeanRoute) or route.param_convertors:
                raise TypeError(f"LeanLane answers LeanRoutes without path parameters, not {route!r}")
            handle = route.lean_handler()
            for method in route.methods or ():
                self._routes[(method, route.path)] = (route, handle)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path, root = scope["path"], scope.get("root_path", "")
            hit = self._routes.get((scope["method"], path[len(root) :] if root and path.startswith(root) else path))
            if hit is not None:
                route, handle = hit
                scope["route"] = route  # what the metrics and the access log name it by
                request = Request(scope, receive)
                try:
                    response = await handle(request)
                except Exception as exc:
                    handler = _handler_for(scope["app"], exc)
                    if handler is None:
                        raise
                    response = await handler(request, exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _handler_for(app: Any, exc: Exception) -> Any:
    """The app's exception handler for `exc`'s class or its nearest base, as Starlette looks it up; None
    for a handler of `Exception` itself (the server-error middleware's) or none at all."""
    handlers = app.exception_handlers
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return handlers[cls]
    return None


def _query_model(name: str, fields: Sequence[Any]) -> type[BaseModel]:
    """One model of the declared query parameters (their types, constraints, defaults and aliases):
    validating a request's query is then one call, not one per parameter."""
    definitions: dict[str, Any] = {f.name: (f.field_info.annotation, f.field_info) for f in fields}
    return create_model(f"{name}_query", **definitions)
