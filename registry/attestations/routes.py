"""HTTP routes for the trusted publisher keys attestations are verified against (admin). An artifact's
attestations are addressed through its release (`registry.releases.attestation_routes`).

A key belongs to the models its pattern matches. An admin limited to model patterns trusts and revokes
only keys whose pattern lies within its own (`tiny-*` within `tiny-*`, never `*`); callers limited to
model patterns see only the keys whose pattern matches some model of theirs, and a revoke of a key they
cannot see is answered as if it did not exist.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from kiln.core.access import TrustedKeyOut
from kiln.core.errors import Forbidden, NotFound
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterKey, PageLimit
from kiln.registry.attestations import service
from kiln.registry.attestations.schemas import KeyRevoke, TrustedKeyCreate
from kiln.registry.auth.principal import Principal
from kiln.registry.deps import PrincipalDep, SessionDep, WriteSessionDep, require
from kiln.registry.paging import PAGE_LIMIT

router = APIRouter(prefix="/v1", tags=["attestations"], route_class=SessionRoute)
Admin = Annotated[Principal, require("admin")]
KeyId = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="sha256 of the public key's DER")]


@router.post(
    "/keys",
    status_code=201,
    summary="Trust a publisher key for a model pattern (admin, audited)",
    responses={200: {"model": TrustedKeyOut}, **error_responses(409, 422)},
)
def add_key(spec: TrustedKeyCreate, session: WriteSessionDep, principal: Admin, response: Response) -> TrustedKeyOut:
    _check_key_pattern(principal, spec.model_pattern)
    row, created = service.add_key(session, spec, principal.name)
    session.commit()
    if not created:
        response.status_code = 200
    return TrustedKeyOut.of(row)


@router.get(
    "/keys",
    summary="Trusted publisher keys for models the caller may read, revoked ones included, oldest first, a page at "
    "a time",
    responses=PAGED,
)
def list_keys(
    request: Request,
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
    after: AfterKey = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[TrustedKeyOut]:
    page = service.keys_page(session, principal, after, limit)
    return [TrustedKeyOut.of(k) for k in page_rows(request, response, page, limit, lambda k: k.key_id)]


@router.post("/keys/{key_id}/revoke", summary="Revoke a trusted key (admin, audited)", responses=error_responses(404))
def revoke_key(
    key_id: KeyId, session: WriteSessionDep, principal: Admin, body: KeyRevoke | None = None
) -> TrustedKeyOut:
    key = service.find_key(session, key_id)
    if key is not None and not principal.sees_pattern(key.model_pattern):
        raise NotFound(f"no trusted key {key_id}", details={"key_id": key_id})
    if key is not None:
        _check_key_pattern(principal, key.model_pattern)
    row = service.revoke_key(session, key_id, principal.name, body.reason if body else None)
    session.commit()
    return TrustedKeyOut.of(row)


def _check_key_pattern(principal: Principal, pattern: str) -> None:
    """Forbidden unless `principal` may trust or revoke keys for every model `pattern` matches."""
    if not principal.covers_patterns([pattern]):
        raise Forbidden(
            f"token {principal.name!r} is limited to {', '.join(principal.models)} and cannot change keys "
            f"for {pattern!r}",
            details={"model_pattern": pattern, "limited_to": list(principal.models), "token": principal.name},
        )
