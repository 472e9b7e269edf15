"""Audit log: record events as part of the caller's transaction, list them back.

Other domains subscribe to the actions they act on (`subscribe`): the webhooks' outbox queues deliveries of
the registry events, subscribed by `create_app`. The audit log imports none of its subscribers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.registry.audit.models import AuditEvent
from kiln.registry.auth.principal import Principal
from kiln.registry.paging import Page, keyset_page

ANONYMOUS = "anonymous"


class EventSubscriber(Protocol):
    """Called with each recorded event of an action it subscribed to, flushed (it has its id), in the
    transaction that records it: what it adds commits, or rolls back, with the change."""

    def __call__(self, session: Session, event: AuditEvent, /) -> object: ...


_subscribers: dict[str, list[EventSubscriber]] = {}


def subscribe(actions: Iterable[str], subscriber: EventSubscriber) -> None:
    """Have `subscriber` called with every event of `actions` recorded from now on (once, however often
    it subscribes: each app built in a process subscribes again)."""
    for action in actions:
        subscribed = _subscribers.setdefault(action, [])
        if subscriber not in subscribed:
            subscribed.append(subscriber)


def record(
    session: Session,
    *,
    action: str,
    target: str,
    details: dict[str, Any],
    actor: str | None = None,
    model: str | None = None,
    reason: str | None = None,
) -> AuditEvent:
    """Add an audit event to the session; it commits (or not) with the change it describes.

    An event of an action with subscribers (the registry events, `registry.webhooks.outbox.EVENTS`) is
    flushed and handed to each, in the same transaction."""
    event = AuditEvent(
        actor=actor or ANONYMOUS, action=action, model=model, target=target, details=details, reason=reason
    )
    session.add(event)
    subscribers = _subscribers.get(action)
    if subscribers:  # a registry event: its deliveries commit, or roll back, with it
        session.flush()
        for subscriber in subscribers:
            subscriber(session, event)
    return event


def events_page(
    session: Session, reader: Principal, model: str | None, after: int | None, limit: int
) -> Page[AuditEvent, int]:
    """Up to `limit` events `reader` may see, newest first, older than the event `after`: about models it may
    read. An event that names no model (tokens, keys, webhooks, the hardware catalog: who holds what access) is
    an administrator's, seen only by an admin not limited to model patterns. Patterns are fnmatch's, which SQL
    cannot express everywhere: they are applied here, a chunk at a time."""

    def fetch(past: int | None, n: int) -> list[AuditEvent]:
        query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(n)
        if model is not None:
            query = query.where(AuditEvent.model == model)
        if not reader.unlimited_admin:
            query = query.where(AuditEvent.model.is_not(None))
        return list(session.scalars(query if past is None else query.where(AuditEvent.id < past)))

    def readable(e: AuditEvent) -> bool:
        return e.model is not None and reader.allows_model(e.model)

    return keyset_page(fetch, lambda e: e.id, after, limit, keep=readable if reader.models else None)
