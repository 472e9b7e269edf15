"""HTTP routes for channels: promotion and history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from sqlalchemy.orm import Session

from kiln.core.channels import ChannelDetail, ChannelEventOut, ChannelOut
from kiln.registry.api.endpoint import SessionRoute
from kiln.registry.api.errors import error_responses
from kiln.registry.api.pages import PAGED, page_rows
from kiln.registry.api.params import AfterChannel, AfterId, ChannelName, ModelName, PageLimit
from kiln.registry.auth.principal import Principal
from kiln.registry.channels import service
from kiln.registry.channels.models import Channel, ChannelEvent
from kiln.registry.channels.schemas import PromoteRequest, SplitRequest
from kiln.registry.deps import PrincipalDep, SessionDep, SettingsDep, WriteSessionDep
from kiln.registry.paging import PAGE_LIMIT

router = APIRouter(prefix="/v1", tags=["channels"], route_class=SessionRoute)


def _detail(model: str, row: Channel, version: str, history: list[ChannelEvent]) -> ChannelDetail:
    """The channel, the version it points at and `history`, a page of its history."""
    return ChannelDetail(
        model=model,
        name=row.name,
        version=version,
        split=service.public_split(row.split) if row.split else None,  # type: ignore[arg-type]
        updated_at=row.updated_at,
        history=[
            ChannelEventOut(
                from_version=e.from_version,
                to_version=e.to_version,
                forced=e.forced,
                split=e.split,  # type: ignore[arg-type]
                reason=e.reason,
                actor=e.actor,
                at=e.at,
            )
            for e in history
        ],
    )


def _newest(session: Session, model: str, channel: str) -> ChannelDetail:
    """The channel with the newest page of its history: what a change of it answers."""
    row, version, page = service.channel_history_page(session, model, channel, None, PAGE_LIMIT)
    return _detail(model, row, version, page.rows)


async def may_promote(request: Request, principal: PrincipalDep, settings: SettingsDep) -> Principal:
    """Protected channels (default: prod) need `promote`; the others are part of publishing.

    A dependency, so a caller without the scope is refused before the body is even read."""
    channel, model = request.path_params["channel"], request.path_params["model"]
    principal.require("promote" if channel in settings.protected_channels else "publish", model)
    return principal


@router.post(
    "/models/{model}/channels/{channel}",
    summary="Promote a release to a channel (refused while an artifact failed its eval, unless forced)",
    responses=error_responses(404, 409, 422),
)
def promote(
    model: ModelName,
    channel: ChannelName,
    request: PromoteRequest,
    session: WriteSessionDep,
    settings: SettingsDep,
    principal: Annotated[Principal, Depends(may_promote)],
) -> ChannelDetail:
    request = request.model_copy(update={"actor": _actor(principal, request.actor)})
    service.promote(session, model, channel, request, signed_only=channel in settings.signed_channels)
    detail = _newest(session, model, channel)  # before the commit: what it committed (see get_write_session)
    session.commit()
    return detail


def _actor(principal: Principal, given: str | None) -> str | None:
    """Who is recorded: the token; a name the client gives (a CI job, a person) is kept beside it."""
    if principal.name == "local":
        return given
    return (f"{principal.name} ({given})" if given else principal.name)[:128]


@router.put(
    "/models/{model}/channels/{channel}/split",
    summary="Split a channel's traffic over releases with weights (canary); each release passes the promotion gates",
    responses=error_responses(404, 409, 422),
)
def set_split(
    model: ModelName,
    channel: ChannelName,
    request: SplitRequest,
    session: WriteSessionDep,
    settings: SettingsDep,
    principal: Annotated[Principal, Depends(may_promote)],
) -> ChannelDetail:
    request = request.model_copy(update={"actor": _actor(principal, request.actor)})
    service.set_split(session, model, channel, request, signed_only=channel in settings.signed_channels)
    detail = _newest(session, model, channel)
    session.commit()
    return detail


@router.get(
    "/models/{model}/channels",
    summary="A model's channels, by name, a page at a time",
    responses={**PAGED, **error_responses(404)},
)
def list_channels(
    model: ModelName,
    request: Request,
    response: Response,
    session: SessionDep,
    after: AfterChannel = None,
    limit: PageLimit = PAGE_LIMIT,
) -> list[ChannelOut]:
    page = service.channels_page(session, model, after, limit)
    return [
        ChannelOut(
            model=model,
            name=c.name,
            version=v,
            split=service.public_split(c.split) if c.split else None,  # type: ignore[arg-type]
            updated_at=c.updated_at,
        )
        for c, v in page_rows(request, response, page, limit)
    ]


@router.get(
    "/models/{model}/channels/{channel}",
    summary="A channel: its current release and its promotion history, newest first, a page at a time",
    responses={**PAGED, **error_responses(404)},
)
def get_channel(
    model: ModelName,
    channel: ChannelName,
    request: Request,
    response: Response,
    session: SessionDep,
    after: AfterId = None,
    limit: PageLimit = PAGE_LIMIT,
) -> ChannelDetail:
    row, version, page = service.channel_history_page(session, model, channel, after, limit)
    return _detail(model, row, version, page_rows(request, response, page, limit))
