"""`LeanRoute`: an API route declared like any other, answered without FastAPI's per-request machinery.

FastAPI documents and validates a route from its endpoint's signature. Answering a request it solves
the dependency graph (each dependency an awaited call with its own bookkeeping), validates every
parameter, and serialises the answer; for a route whose own work is a dict lookup (a warm resolve)
that is most of the cost. A `LeanRoute` keeps the declaration — the OpenAPI operation and the
parameter definitions come from the endpoint as usual — and answers with only what such an
endpoint needs:

- the query parameters are validated against the endpoint's own declared fields (the same rules,
  the same 422);
- the route's dependencies, its own and those its router was included with, must be
  `require(scope)` checks, which run as `authorize` (what the dependency itself calls); any other
  dependency is refused when the handler is built, so no check is ever skipped;
- the endpoint is `async`, takes `request` and query parameters only, and returns a Response.

Errors reach the app's exception handlers like any route's.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastapi import routing
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError, create_model
from starlette.requests import Request
from starlette.responses import Response

from registry.auth.principal import Scope
from registry.deps import authorize, required_scope


class LeanRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        # An included route is built per inclusion, its dependant holding the router's dependencies
        # too; FastAPI hands that context to this hook through a context variable.
        context = routing._effective_route_context_var.get()
        dependant = (context if context is not None and context.original_route is self else self).dependant
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

        async def handle(request: Request) -> Response:
            for scope in required:
                authorize(request, scope)
            try:
                values = query.model_validate(dict(request.query_params))
            except ValidationError as exc:
                raise RequestValidationError(
                    [{**e, "loc": ("query", *e["loc"])} for e in exc.errors(include_url=False)]
                ) from None
            response: Response = await endpoint(request=request, **dict(values))
            return response

        return handle


def _query_model(name: str, fields: Sequence[Any]) -> type[BaseModel]:
    """One model of the declared query parameters (their types, constraints, defaults and aliases):
    validating a request's query is then one call, not one per parameter."""
    definitions: dict[str, Any] = {f.name: (f.field_info.annotation, f.field_info) for f in fields}
    return create_model(f"{name}_query", **definitions)
