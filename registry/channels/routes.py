"""HTTP routes for channels: promotion and history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from sqlalchemy.orm import Session

from registry.api.errors import error_responses
from registry.api.params import ChannelName, ModelName
from registry.auth.principal import Principal
from registry.channels import service
from registry.channels.schemas import ChannelDetail, ChannelEventOut, ChannelOut, PromoteRequest
from registry.deps import PrincipalDep, SessionDep, SettingsDep, WriteSessionDep

router = APIRouter(prefix="/v1", tags=["channels"])


def _detail(session: Session, model: str, channel: str) -> ChannelDetail:
    row, version, history = service.get_channel(session, model, channel)
    return ChannelDetail(
        model=model,
        name=row.name,
        version=version,
        updated_at=row.updated_at,
        history=[
            ChannelEventOut(
                from_version=e.from_version,
                to_version=e.to_version,
                forced=e.forced,
                reason=e.reason,
                actor=e.actor,
                at=e.at,
            )
            for e in history
        ],
    )


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
    principal: Annotated[Principal, Depends(may_promote)],
) -> ChannelDetail:
    # Who is recorded: the token; a name the client gives (a CI job, a person) is kept beside it.
    if principal.name != "local":
        actor = f"{principal.name} ({request.actor})" if request.actor else principal.name
        request = request.model_copy(update={"actor": actor[:128]})
    service.promote(session, model, channel, request)
    session.commit()
    return _detail(session, model, channel)


@router.get("/models/{model}/channels", summary="A model's channels", responses=error_responses(404))
def list_channels(model: ModelName, session: SessionDep) -> list[ChannelOut]:
    return [
        ChannelOut(model=model, name=c.name, version=v, updated_at=c.updated_at)
        for c, v in service.list_channels(session, model)
    ]


@router.get(
    "/models/{model}/channels/{channel}",
    summary="A channel: its current release and promotion history",
    responses=error_responses(404),
)
def get_channel(model: ModelName, channel: ChannelName, session: SessionDep) -> ChannelDetail:
    return _detail(session, model, channel)
