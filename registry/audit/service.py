"""Audit log: record events as part of the caller's transaction, list them back."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.audit.models import AuditEvent
from registry.auth.principal import Principal
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


def list_events(session: Session, reader: Principal, model: str | None = None, limit: int = 100) -> list[AuditEvent]:
    """The newest `limit` events `reader` may see: about models it may read. An event that names no
    model (tokens, keys, webhooks, the hardware catalog: who holds what access) is an administrator's,
    seen only by an admin not limited to model patterns."""
    query = select(AuditEvent).order_by(AuditEvent.id.desc())
    if model is not None:
        query = query.where(AuditEvent.model == model)
    if reader.unlimited_admin:
        return list(session.scalars(query.limit(limit)))
    query = query.where(AuditEvent.model.is_not(None))
    if not reader.models:
        return list(session.scalars(query.limit(limit)))
    # Patterns are fnmatch's, which SQL cannot express everywhere: filter here, a page at a time.
    seen: list[AuditEvent] = []
    before: int | None = None
    while len(seen) < limit:
        page_query = query if before is None else query.where(AuditEvent.id < before)
        page = list(session.scalars(page_query.limit(max(limit, 200))))
        if not page:
            break
        seen += [e for e in page if e.model is not None and reader.allows_model(e.model)]
        before = page[-1].id
    return seen[:limit]
