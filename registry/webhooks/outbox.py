"""The outbox: registry events become pending deliveries in the transaction that made them, and senders
claim, and settle, due deliveries with leases.

`enqueue` subscribes to the audit log's actions named in `EVENTS` (`subscribe_to_audit`, called by
`create_app`): `audit.record` calls it in the recording transaction, so a change that rolls back sends
nothing and a committed one is never missed. Delivery is at least once: a sender that dies mid-POST
leaves its lease to expire and another sends again; receivers deduplicate by the payload's `id`.
"""

from __future__ import annotations

import fnmatch
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from kiln.registry.audit import service as audit
from kiln.registry.audit.service import AuditEvent
from kiln.registry.settings import RegistrySettings
from kiln.registry.webhooks.models import Webhook, WebhookAttempt, WebhookDelivery

# The audit actions that are registry events, with what each means. Webhooks subscribe to these names.
EVENTS: dict[str, str] = {
    "release.seal": "a release was sealed: complete, immutable, and from now on resolvable and promotable",
    "release.yank": "a sealed release was yanked: never resolved, promoted or served again",
    "channel.promote": "a channel now points at another release",
    "channel.promote.forced": "a channel was promoted despite failed eval gates (the reason is in the payload)",
    "channel.split": "the weights of a channel's canary split changed",
}


def payload_of(event: AuditEvent) -> dict[str, Any]:
    """The JSON a webhook receives for an audit event (the event's own fields; nothing about the webhook)."""
    return {
        "id": event.id,
        "event": event.action,
        "at": event.at.isoformat(),
        "model": event.model,
        "target": event.target,
        "actor": event.actor,
        "reason": event.reason,
        "details": event.details,
    }


def matches(webhook: Webhook, event: AuditEvent) -> bool:
    """True when `webhook` subscribes to `event`: its action is one of the webhook's events, and its
    model matches the webhook's pattern (an event that names no model only matches `*`)."""
    if event.action not in webhook.events:
        return False
    if event.model is None:
        return webhook.model_pattern == "*"
    return fnmatch.fnmatchcase(event.model, webhook.model_pattern)


def enqueue(session: Session, event: AuditEvent) -> list[WebhookDelivery]:
    """Add a pending delivery of `event` (flushed, so it has an id) for each active webhook subscribing to it."""
    webhooks = session.scalars(select(Webhook).where(Webhook.active.is_(True)).order_by(Webhook.id))
    payload = payload_of(event)
    deliveries = [
        WebhookDelivery(
            webhook_id=webhook.id,
            audit_event_id=event.id,
            event=event.action,
            payload=payload,
            state="pending",
            next_attempt_at=event.at,
        )
        for webhook in webhooks
        if matches(webhook, event)
    ]
    session.add_all(deliveries)
    return deliveries


def subscribe_to_audit() -> None:
    """Queue deliveries of every registry event the audit log records from now on."""
    audit.subscribe(EVENTS, enqueue)


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how far apart, a delivery is attempted."""

    max_attempts: int
    base_s: float
    max_s: float

    @classmethod
    def from_settings(cls, settings: RegistrySettings) -> RetryPolicy:
        return cls(settings.webhook_max_attempts, settings.webhook_backoff_base_s, settings.webhook_backoff_max_s)

    def delay(self, attempt: int) -> timedelta:
        """The wait after failed attempt `attempt` (1-based): base * 2^(attempt-1), capped."""
        return timedelta(seconds=min(self.max_s, self.base_s * 2 ** min(attempt - 1, 60)))


@dataclass(frozen=True)
class Claim:
    """A delivery a sender holds the lease of, with what it needs to send it."""

    delivery_id: int
    token: str
    attempt: int  # the number of the attempt about to be made, from 1
    url: str
    secret: str
    event: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class AttemptResult:
    """What one POST came to: the receiver's status, or the error that stopped it."""

    at: datetime
    status_code: int | None
    error: str | None
    duration_ms: int

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def _due(now: datetime) -> Any:
    return (
        WebhookDelivery.state == "pending",
        WebhookDelivery.next_attempt_at <= now,
        or_(WebhookDelivery.claimed_until.is_(None), WebhookDelivery.claimed_until < now),
    )


def has_due(session: Session, now: datetime) -> bool:
    """Whether any delivery is due: a read that takes no write lock, asked before claiming."""
    query = (
        select(WebhookDelivery.id)
        .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
        .where(*_due(now), Webhook.active.is_(True))
        .limit(1)
    )
    return session.scalar(query) is not None


def claim_due(session: Session, *, now: datetime, lease_s: float, limit: int) -> list[Claim]:
    """Lease up to `limit` due deliveries of active webhooks to the caller, oldest due first.

    One UPDATE takes them: on PostgreSQL its subquery locks the rows it picks and skips rows another
    claimer holds, and the conditions are checked again on the row being updated, so a row claimed
    and committed meanwhile is not taken twice; on SQLite the caller's write session holds the
    database's write lock. The caller commits, ending the claim's transaction before any POST.
    """
    token = secrets.token_hex(16)
    picked = (
        select(WebhookDelivery.id)
        .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
        .where(*_due(now), Webhook.active.is_(True))
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
        .limit(limit)
        .with_for_update(skip_locked=True, of=WebhookDelivery)
    )
    claimed = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id.in_(picked), *_due(now))
        .values(claimed_until=now + timedelta(seconds=lease_s), claim_token=token)
        .returning(WebhookDelivery.id)
        .execution_options(synchronize_session=False)
    )
    ids = list(claimed.scalars())
    if not ids:
        return []
    rows = session.execute(
        select(
            WebhookDelivery.id,
            WebhookDelivery.attempts,
            WebhookDelivery.event,
            WebhookDelivery.payload,
            Webhook.url,
            Webhook.secret,
        )
        .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
        .where(WebhookDelivery.id.in_(ids))
        .order_by(WebhookDelivery.id)
    )
    return [
        Claim(
            delivery_id=row.id,
            token=token,
            attempt=row.attempts + 1,
            url=row.url,
            secret=row.secret,
            event=row.event,
            payload=row.payload,
        )
        for row in rows
    ]


def settle(session: Session, claim: Claim, result: AttemptResult, policy: RetryPolicy) -> str | None:
    """Log the attempt, and move the delivery on: delivered on a 2xx, failed after its last attempt,
    else due again after the backoff. Returns the new state, or None when the claim's lease was lost
    (another sender took over, or the webhook was deleted): the attempt is logged all the same."""
    session.add(
        WebhookAttempt(
            delivery_id=claim.delivery_id,
            attempt=claim.attempt,
            at=result.at,
            status_code=result.status_code,
            error=result.error,
            duration_ms=result.duration_ms,
        )
    )
    changes: dict[str, Any]
    if result.ok:
        changes = {"state": "delivered", "delivered_at": result.at}
    elif claim.attempt >= policy.max_attempts:
        changes = {"state": "failed"}
    else:
        changes = {"next_attempt_at": result.at + policy.delay(claim.attempt)}
    settled = session.execute(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == claim.delivery_id,
            WebhookDelivery.claim_token == claim.token,
            WebhookDelivery.state == "pending",
        )
        .values(
            attempts=claim.attempt,
            last_status=result.status_code,
            last_error=result.error,
            claimed_until=None,
            claim_token=None,
            **changes,
        )
        .execution_options(synchronize_session=False)
    )
    session.flush()
    if settled.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return str(changes.get("state", "pending"))
