"""Audit log: record events as part of the caller's transaction, list them back."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.audit.models import AuditEvent
from registry.auth.principal import Principal
from registry.paging import Page, keyset_page
from registry.webhooks import outbox as webhooks

ANONYMOUS = "anonymous"


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

    A registry event (`registry.webhooks.outbox.EVENTS`) is flushed and queued for the webhooks that
    subscribe to it, in the same transaction."""
    event = AuditEvent(
        actor=actor or ANONYMOUS, action=action, model=model, target=target, details=details, reason=reason
    )
    session.add(event)
    if action in webhooks.EVENTS:  # a registry event: its deliveries commit, or roll back, with it
        session.flush()
        webhooks.enqueue(session, event)
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
