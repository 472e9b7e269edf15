"""HTTP routes for the hardware catalog: read by anyone who may read, changed by admins (audited).

The catalog serves every model, so only an admin not limited to model patterns changes it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Request, Response

from kiln.core.hardware import HARDWARE_NAME_PATTERN, HardwareOut
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterHardware, PageLimit
from kiln.registry.deps import PrincipalDep, SessionDep, WriteSessionDep, require
from kiln.registry.hardware import service
from kiln.registry.hardware.schemas import entry_request_schema
from kiln.registry.paging import PAGE_LIMIT

router = APIRouter(prefix="/v1", tags=["hardware"], route_class=SessionRoute)

HardwareName = Annotated[str, Path(pattern=HARDWARE_NAME_PATTERN, description="SKU name, e.g. h100")]


@router.get(
    "/hardware", summary="The hardware catalog resolve sizes replicas with, by name, a page at a time", responses=PAGED
)
def list_hardware(
    request: Request,
    response: Response,
    session: SessionDep,
    after: AfterHardware = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[HardwareOut]:
    page = service.catalog_page(session, after, limit)
    return [HardwareOut(**p.model_dump(), source=source) for p, source in page_rows(request, response, page, limit)]  # type: ignore[arg-type]


@router.get("/hardware/{name}", summary="One SKU of the hardware catalog", responses=error_responses(404))
def get_hardware(name: HardwareName, session: SessionDep) -> HardwareOut:
    profile, source = service.get_entry(session, name)
    return HardwareOut.of(profile, source)


@router.put(
    "/hardware/{name}",
    summary="Add an SKU to the catalog, or replace (override) its entry; admin, audited",
    responses=error_responses(422),
    dependencies=[require("admin")],
    openapi_extra=entry_request_schema(),
)
def put_hardware(
    name: HardwareName,
    session: WriteSessionDep,
    principal: PrincipalDep,
    entry: Annotated[dict[str, Any], Body(description="a catalog entry, as GET /v1/hardware/{name} shows one")],
) -> HardwareOut:
    principal.require_unlimited_admin("changing the hardware catalog")
    profile = service.put_entry(session, name, entry, principal.name)
    session.commit()
    # What was committed, not a read-back: a DELETE committed in between must not turn this 200 into a 404.
    return HardwareOut.of(profile, service.registry_source(name))


@router.delete(
    "/hardware/{name}",
    summary="Remove the registry's entry for an SKU (a built-in one returns to its default); admin, audited",
    responses=error_responses(404),
    dependencies=[require("admin")],
    status_code=204,
)
def delete_hardware(name: HardwareName, session: WriteSessionDep, principal: PrincipalDep) -> None:
    principal.require_unlimited_admin("changing the hardware catalog")
    service.delete_entry(session, name, principal.name)
    session.commit()
