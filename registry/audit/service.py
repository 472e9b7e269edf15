"""Audit log: record events as part of the caller's transaction, list them back."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.audit.models import AuditEvent

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
    """Add an audit event to the session; it commits (or not) with the change it describes."""
    event = AuditEvent(
        actor=actor or ANONYMOUS, action=action, model=model, target=target, details=details, reason=reason
    )
    session.add(event)
    return event


def list_events(session: Session, model: str | None = None, limit: int = 100) -> list[AuditEvent]:
    query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
    if model is not None:
        query = query.where(AuditEvent.model == model)
    return list(session.scalars(query))
