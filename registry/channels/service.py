"""Channels and promotion: where the eval gate is enforced and forced promotions are audited."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from core.errors import Conflict, GateFailed, NotFound
from registry.artifacts.models import Artifact, eval_status
from registry.audit import service as audit
from registry.channels.models import Channel, ChannelEvent
from registry.channels.schemas import PromoteRequest
from registry.db import lock_row, utcnow
from registry.models.models import Model
from registry.models.service import get_model
from registry.releases.models import Release
from registry.releases.service import lock_release


def _find_channel(session: Session, model_id: int, name: str) -> Channel | None:
    query = select(Channel).where(Channel.model_id == model_id, Channel.name == name)
    return session.scalars(query.options(selectinload(Channel.release))).one_or_none()


def list_channels(session: Session, model: str) -> list[tuple[Channel, str]]:
    """(channel, version) pairs of a model, by name."""
    model_row = get_model(session, model)
    query = (
        select(Channel, Release.version)
        .join(Channel.release)
        .where(Channel.model_id == model_row.id)
        .order_by(Channel.name)
    )
    return [(c, v) for c, v in session.execute(query)]


def get_channel(session: Session, model: str, name: str) -> tuple[Channel, str, list[ChannelEvent]]:
    """A channel, the version it points at, and its history (newest first)."""
    model_row = get_model(session, model)
    channel = _find_channel(session, model_row.id, name)
    if channel is None:
        raise NotFound(f"model {model!r} has no channel {name!r}", details={"model": model, "channel": name})
    history = session.scalars(
        select(ChannelEvent).where(ChannelEvent.channel_id == channel.id).order_by(ChannelEvent.id.desc())
    )
    return channel, channel.release.version, list(history)


def promote(session: Session, model: str, name: str, request: PromoteRequest) -> None:
    """Point channel `name` of `model` at the sealed release `request.version`.

    Promotions of a model's channels are serialised (a row lock on the model; SQLite's write lock),
    so history is a true chain of from -> to. Refused for a release that is not sealed
    (RELEASE_NOT_SEALED), yanked (RELEASE_YANKED), and (EVAL_GATE_FAILED) while any artifact has a
    failed eval, unless forced with a reason. The channel remembers the newest eval it was judged
    with: evals posted later change what it serves only through another promotion. Every
    promotion is recorded in the channel history and the audit log, a forced one with its reason
    and the failures it overrode.
    """
    model_row = get_model(session, model)
    lock_row(session, Model.id, model_row.id)
    release = lock_release(session, model, request.version, shared=False)
    if release.yanked_at is not None:
        raise Conflict(
            f"release {model}@{request.version} is yanked ({release.yank_reason}); promote another release",
            code="RELEASE_YANKED",
            details={"model": model, "version": request.version},
        )
    if release.status != "sealed":
        raise Conflict(
            f"release {model}@{request.version} is {release.status}, not sealed: only a sealed (complete) "
            "release can be promoted",
            code="RELEASE_NOT_SEALED",
            details={"model": model, "version": request.version, "status": release.status},
        )
    artifacts = list(
        session.scalars(select(Artifact).where(Artifact.release_id == release.id).options(selectinload(Artifact.evals)))
    )
    failed = [a for a in artifacts if eval_status(a.evals) == "failed"]
    failing = [
        {
            "artifact": a.name,
            "failed": [{"runtime": e.runtime, "reason": e.reason} for e in a.evals if e.status == "failed"],
        }
        for a in failed
    ]
    if failing and not request.force:
        names = ", ".join(a.name for a in failed)
        raise GateFailed(
            f"release {model}@{request.version} has artifacts that failed their eval gates: {names}; "
            "promote with force and a reason to override",
            details={"model": model, "version": request.version, "failing": failing},
        )
    evals_through = max((e.id for a in artifacts for e in a.evals), default=0)

    channel = _find_channel(session, release.model_id, name)
    before = channel.release.version if channel is not None else None
    if channel is None:
        channel = Channel(model_id=release.model_id, name=name, release_id=release.id, evals_through=evals_through)
        session.add(channel)
    else:
        channel.release_id = release.id
        channel.evals_through = evals_through
        channel.updated_at = utcnow()
    session.flush()
    session.add(
        ChannelEvent(
            channel_id=channel.id,
            from_version=before,
            to_version=release.version,
            forced=request.force,
            reason=request.reason,
            actor=request.actor,
        )
    )
    audit.record(
        session,
        action="channel.promote.forced" if request.force else "channel.promote",
        target=f"{model}/{name}",
        model=model,
        actor=request.actor,
        reason=request.reason,
        details={
            "before": {"version": before},
            "after": {"version": release.version, "evals_through": evals_through},
            "overridden_failures": failing,
        },
    )
    session.flush()


def model_channel_versions(session: Session, model_id: int) -> dict[str, str]:
    query = select(Channel.name, Release.version).join(Channel.release).where(Channel.model_id == model_id)
    return {name: version for name, version in session.execute(query)}


def channels_of_release(session: Session, release_id: int) -> list[str]:
    query = select(Channel.name).where(Channel.release_id == release_id).order_by(Channel.name)
    return list(session.scalars(query))
