"""Channels and promotion: where the eval gate is enforced and forced promotions are audited."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload, selectinload

from kiln.core.error_codes import Codes
from kiln.core.errors import Conflict, GateFailed, NotFound
from kiln.core.evals import eval_status
from kiln.registry.artifacts.service import WITH_EVALS, release_artifacts
from kiln.registry.attestations.policy import unsigned_artifacts
from kiln.registry.audit import service as audit
from kiln.registry.channels import buckets
from kiln.registry.channels.models import Channel, ChannelEvent
from kiln.registry.channels.schemas import PromoteRequest, SplitRequest
from kiln.registry.db import utcnow
from kiln.registry.models.service import get_model, lock_model
from kiln.registry.paging import Page, keyset_page
from kiln.registry.releases.service import Release, lock_release, model_id_of_release


def find_channel(session: Session, model_id: int, name: str) -> Channel | None:
    """The model's channel `name`, with the release it points at loaded."""
    query = select(Channel).where(Channel.model_id == model_id, Channel.name == name)
    return session.scalars(query.options(selectinload(Channel.release))).one_or_none()


def list_channels(session: Session, model: str) -> list[tuple[Channel, str]]:
    """(channel, version) pairs of a model, by name."""
    model_row = get_model(session, model)
    query = (
        select(Channel)
        .where(Channel.model_id == model_row.id)
        .order_by(Channel.name)
        .options(joinedload(Channel.release, innerjoin=True))
    )
    return [(c, c.release.version) for c in session.scalars(query)]


def channels_page(session: Session, model: str, after: str | None, limit: int) -> Page[tuple[Channel, str], str]:
    """Up to `limit` (channel, version) pairs of a model, by name past `after`."""
    model_row = get_model(session, model)

    def fetch(past: str | None, n: int) -> list[tuple[Channel, str]]:
        query = select(Channel).where(Channel.model_id == model_row.id)
        query = query if past is None else query.where(Channel.name > past)
        query = query.order_by(Channel.name).limit(n).options(joinedload(Channel.release, innerjoin=True))
        return [(c, c.release.version) for c in session.scalars(query)]

    return keyset_page(fetch, lambda pair: pair[0].name, after, limit)


def channel_history_page(
    session: Session, model: str, name: str, after: int | None, limit: int
) -> tuple[Channel, str, Page[ChannelEvent, int]]:
    """A channel, the version it points at, and up to `limit` of its history's events, newest first, older
    than the event `after`."""
    channel = _channel(session, model, name)

    def fetch(past: int | None, n: int) -> list[ChannelEvent]:
        query = select(ChannelEvent).where(ChannelEvent.channel_id == channel.id)
        query = query if past is None else query.where(ChannelEvent.id < past)
        return list(session.scalars(query.order_by(ChannelEvent.id.desc()).limit(n)))

    return channel, channel.release.version, keyset_page(fetch, lambda e: e.id, after, limit)


def _channel(session: Session, model: str, name: str) -> Channel:
    model_row = get_model(session, model)
    channel = find_channel(session, model_row.id, name)
    if channel is None:
        raise NotFound(f"model {model!r} has no channel {name!r}", details={"model": model, "channel": name})
    return channel


def _gated_release(
    session: Session, model: str, version: str, force: bool, signed_only: bool = False
) -> tuple[Release, int, list[dict[str, Any]]]:
    """A release a channel may point at: sealed, not yanked, signed where the model has trusted keys (or
    the channel is one of the registry's `signed_channels`), every artifact past its eval gate unless
    forced. Returns it, the newest eval it is judged with, and the failures a force overrides."""
    release = lock_release(session, model, version, shared=False)
    if release.yanked_at is not None:
        raise Conflict(
            f"release {model}@{version} is yanked ({release.yank_reason}); promote another release",
            code=Codes.RELEASE_YANKED,
            details={"model": model, "version": version},
        )
    if release.status != "sealed":
        raise Conflict(
            f"release {model}@{version} is {release.status}, not sealed: only a sealed (complete) "
            "release can be promoted",
            code=Codes.RELEASE_NOT_SEALED,
            details={"model": model, "version": version, "status": release.status},
        )
    artifacts = release_artifacts(session, release.id, *WITH_EVALS)
    # Not overridable by force: a model with trusted keys is served only from signed artifacts.
    unsigned = unsigned_artifacts(session, model, [(a.id, a.name) for a in artifacts], required=signed_only)
    if unsigned:
        where = " (the channel serves only signed artifacts)" if signed_only else ""
        raise Conflict(
            f"release {model}@{version} has artifacts without a signature by an active key trusted for "
            f"{model!r}{where}: {', '.join(unsigned)}",
            code=Codes.ARTIFACT_UNSIGNED,
            details={"model": model, "version": version, "unsigned": unsigned},
        )
    failed = [a for a in artifacts if eval_status(a.evals) == "failed"]
    failing = [
        {
            "artifact": a.name,
            "failed": [{"runtime": e.runtime, "reason": e.reason} for e in a.evals if e.status == "failed"],
        }
        for a in failed
    ]
    if failing and not force:
        names = ", ".join(a.name for a in failed)
        raise GateFailed(
            f"release {model}@{version} has artifacts that failed their eval gates: {names}; "
            "promote with force and a reason to override",
            details={"model": model, "version": version, "failing": failing},
        )
    evals_through = max((e.id for a in artifacts for e in a.evals), default=0)
    return release, evals_through, failing


def promote(session: Session, model: str, name: str, request: PromoteRequest, signed_only: bool = False) -> None:
    """Point channel `name` of `model` at the sealed release `request.version` (all of its traffic).

    Promotions of a model's channels are serialised (a row lock on the model; SQLite's write lock),
    so history is a true chain of from -> to. Refused for a release that is not sealed
    (RELEASE_NOT_SEALED), yanked (RELEASE_YANKED), and (EVAL_GATE_FAILED) while any artifact has a
    failed eval, unless forced with a reason. The channel remembers the newest eval it was judged
    with: evals posted later change what it serves only through another promotion. Every
    promotion is recorded in the channel history and the audit log, a forced one with its reason
    and the failures it overrode. A weighted split the channel had is replaced.
    """
    model_row = get_model(session, model)
    lock_model(session, model_row.id)
    release, evals_through, failing = _gated_release(session, model, request.version, request.force, signed_only)
    channel = find_channel(session, release.model_id, name)
    before = _state(channel)
    if channel is None:
        channel = Channel(model_id=release.model_id, name=name, release_id=release.id, evals_through=evals_through)
        session.add(channel)
    else:
        channel.release_id = release.id
        channel.evals_through = evals_through
        channel.split = None
        channel.updated_at = utcnow()
    session.flush()
    _record(
        session,
        channel,
        model,
        action="channel.promote.forced" if request.force else "channel.promote",
        before=before,
        after={"version": release.version, "evals_through": evals_through},
        forced=request.force,
        reason=request.reason,
        actor=request.actor,
        details={"overridden_failures": failing},
    )


def _state(channel: Channel | None) -> dict[str, Any]:
    """What a channel serves, for history and audit: its version, and its split if it has one."""
    if channel is None:
        return {"version": None}
    state: dict[str, Any] = {"version": channel.release.version}
    if channel.split:
        state["split"] = public_split(channel.split)
    return state


def _record(
    session: Session,
    channel: Channel,
    model: str,
    *,
    action: str,
    before: dict[str, Any],
    after: dict[str, Any],
    forced: bool,
    reason: str | None,
    actor: str | None,
    details: dict[str, Any] | None = None,
) -> None:
    """A change of what a channel serves, in its history and the audit log (with `details` beside
    before/after), in the caller's transaction."""
    session.add(
        ChannelEvent(
            channel_id=channel.id,
            from_version=before["version"],
            to_version=after["version"],
            forced=forced,
            split=after.get("split"),
            reason=reason,
            actor=actor,
        )
    )
    audit.record(
        session,
        action=action,
        target=f"{model}/{channel.name}",
        model=model,
        actor=actor,
        reason=reason,
        details={"before": before, "after": after, **(details or {})},
    )
    session.flush()


def public_split(split: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """[{version, weight (percent)}] of a stored split."""
    return [{"version": m["version"], "weight": m["weight"] * 100 / buckets.BASIS_POINTS} for m in split]


def set_split(session: Session, model: str, name: str, request: SplitRequest, signed_only: bool = False) -> None:
    """Point channel `name` at several releases with weights (a canary: 95 % 1.4.0, 5 % 1.5.0).

    Every release is checked as a promotion checks one (sealed, not yanked, past its eval gates
    unless forced with a reason). Each member owns key buckets (`registry.channels.buckets`): a
    member whose share is unchanged keeps them all, so a key changes release only when the share of
    its release changed. A split of one release is a promotion to it. Recorded in the history and audited
    (`channel.split`), like a promotion.
    """
    model_row = get_model(session, model)
    lock_model(session, model_row.id)
    gated = {w.version: _gated_release(session, model, w.version, request.force, signed_only) for w in request.weights}
    channel = find_channel(session, model_row.id, name)
    before = _state(channel)
    previous: dict[str, buckets.Ranges] = {}
    if channel is not None and channel.split:
        previous = {m["version"]: buckets.merged(m.get("buckets", [])) for m in channel.split}
    elif channel is not None:
        previous = {channel.release.version: [(0, buckets.BASIS_POINTS)]}
    order = [v for v in previous if v in gated] + [w.version for w in request.weights if w.version not in previous]
    basis_points = {w.version: w.basis_points for w in request.weights}
    assigned = buckets.reassign(previous, {v: basis_points[v] for v in order})
    members: list[dict[str, Any]] = [
        {
            "release_id": gated[v][0].id,
            "version": v,
            "weight": basis_points[v],
            "evals_through": gated[v][1],
            "buckets": [list(r) for r in assigned[v]],
        }
        for v in order
    ]
    primary = max(members, key=lambda m: m["weight"])  # the first of the largest
    if channel is None:
        channel = Channel(model_id=model_row.id, name=name, release_id=primary["release_id"])
        session.add(channel)
    channel.release_id = primary["release_id"]
    channel.evals_through = primary["evals_through"]
    channel.split = members if len(members) > 1 else None
    channel.updated_at = utcnow()
    session.flush()
    after = {"version": primary["version"], **({"split": public_split(members)} if len(members) > 1 else {})}
    _record(
        session,
        channel,
        model,
        action="channel.split",
        before=before,
        after=after,
        forced=request.force,
        reason=request.reason,
        actor=request.actor,
        details={
            "forced": request.force,
            "overridden_failures": [f for _, _, failing in gated.values() for f in failing],
        },
    )


def drop_from_splits(session: Session, model: str, release_id: int, version: str, actor: str) -> list[str]:
    """Take a yanked release out of every split it is a minor member of, its weight going to the
    split's largest member; audited as `channel.split`. Returns the channels changed. (A channel whose
    largest member is yanked keeps pointing at it, and resolve refuses it, as for any yanked release.)"""
    model_row = get_model(session, model)
    changed = []
    for channel in session.scalars(
        select(Channel).where(Channel.model_id == model_row.id).options(selectinload(Channel.release))
    ):
        split = channel.split or []
        if channel.release_id == release_id or not any(m["release_id"] == release_id for m in split):
            continue
        before = _state(channel)
        dropped = next(m for m in split if m["release_id"] == release_id)
        kept = [dict(m) for m in split if m["release_id"] != release_id]
        for m in kept:
            if m["release_id"] == channel.release_id:  # the largest member takes the share and its keys
                m["weight"] += dropped["weight"]
                m["buckets"] = [list(r) for r in buckets.merged(m.get("buckets", []) + dropped.get("buckets", []))]
        channel.split = kept if len(kept) > 1 else None
        channel.updated_at = utcnow()
        after = {"version": channel.release.version, **({"split": public_split(kept)} if len(kept) > 1 else {})}
        _record(
            session,
            channel,
            model,
            action="channel.split",
            before=before,
            after=after,
            forced=False,
            reason=f"release {version} yanked",
            actor=actor,
        )
        changed.append(channel.name)
    session.flush()
    return changed


def model_channel_versions(session: Session, model_id: int) -> dict[str, str]:
    query = select(Channel).where(Channel.model_id == model_id).options(joinedload(Channel.release, innerjoin=True))
    return {c.name: c.release.version for c in session.scalars(query)}


def channel_versions_of(session: Session, model_ids: list[int]) -> dict[int, list[tuple[str, str]]]:
    """Per model of `model_ids`: (channel, version) of each of its channels, by name. One query."""
    query = (
        select(Channel)
        .where(Channel.model_id.in_(model_ids))
        .order_by(Channel.model_id, Channel.name)
        .options(joinedload(Channel.release, innerjoin=True))
    )
    found: dict[int, list[tuple[str, str]]] = {}
    for c in session.scalars(query):
        found.setdefault(c.model_id, []).append((c.name, c.release.version))
    return found


def channel_release_ids(session: Session, model_id: int) -> list[tuple[str, int]]:
    """(name, release id) of each of the model's channels (a split's largest member)."""
    return [
        (n, r) for n, r in session.execute(select(Channel.name, Channel.release_id).where(Channel.model_id == model_id))
    ]


def channel_names(session: Session, model_id: int) -> list[str]:
    """The model's channels' names, sorted."""
    return list(session.scalars(select(Channel.name).where(Channel.model_id == model_id).order_by(Channel.name)))


def channels_of_release(session: Session, release_id: int) -> list[str]:
    """The channels that serve the release: those pointing at it, and those whose split has it."""
    query = select(Channel).where(Channel.model_id == model_id_of_release(release_id))
    channels = session.scalars(query.order_by(Channel.name))
    return [
        c.name
        for c in channels
        if c.release_id == release_id or any(m["release_id"] == release_id for m in c.split or [])
    ]
