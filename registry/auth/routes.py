"""/v1/tokens: create, list and revoke API tokens (admin scope); every change is audited."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Request, Response

from kiln.core.access import TokenCreated, TokenOut
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterId, PageLimit, RowId
from kiln.registry.auth import service
from kiln.registry.auth.principal import Principal
from kiln.registry.auth.schemas import TokenCreate, TokenRevoke
from kiln.registry.deps import SessionDep, SettingsDep, WriteSessionDep, require
from kiln.registry.paging import PAGE_LIMIT

router = APIRouter(prefix="/v1", tags=["tokens"], route_class=SessionRoute)
Admin = Annotated[Principal, require("admin")]


@router.post("/tokens", status_code=201, summary="Create an API token (its secret is returned once)")
def create_token(spec: TokenCreate, session: WriteSessionDep, settings: SettingsDep, principal: Admin) -> TokenCreated:
    days = settings.token_max_lifetime_days
    token, secret = service.create_token(
        session,
        spec.name,
        list(spec.scopes),
        spec.models,
        principal,
        expires_at=spec.expires_at,
        max_lifetime=None if days is None else timedelta(days=days),
    )
    session.commit()
    return TokenCreated.of(token, token=secret)


@router.get("/tokens", summary="List API tokens (never their secrets), oldest first, a page at a time", responses=PAGED)
def list_tokens(
    request: Request,
    response: Response,
    session: SessionDep,
    principal: Admin,
    after: AfterId = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[TokenOut]:
    page = service.tokens_page(session, principal, after, limit)
    return [TokenOut.of(t) for t in page_rows(request, response, page, limit)]


@router.post("/tokens/{token_id}/revoke", summary="Revoke an API token", responses=error_responses(404))
def revoke_token(
    token_id: RowId,
    session: WriteSessionDep,
    request: Request,
    principal: Admin,
    body: TokenRevoke | None = None,
) -> TokenOut:
    token = service.revoke_token(session, token_id, principal, body.reason if body else None)
    session.commit()
    request.app.state.token_cache.clear()
    return TokenOut.of(token)
