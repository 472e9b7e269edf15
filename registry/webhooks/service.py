"""Webhook administration: create (the secret is returned once), list, deactivate, the delivery log, redeliver.

An admin token limited to model patterns manages only webhooks whose pattern lies within its own:
it could otherwise subscribe to events about models it may not read.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlsplit

from sqlalchemy import select, update
from sqlalchemy.orm import Session, selectinload

from kiln.core.error_codes import Codes
from kiln.core.errors import Conflict, Forbidden, NotFound, UnknownName
from kiln.registry.audit import service as audit
from kiln.registry.auth.patterns import check_pattern
from kiln.registry.auth.principal import Principal
from kiln.registry.db import utcnow
from kiln.registry.paging import Page, keyset_page
from kiln.registry.webhooks.destinations import DestinationPolicy, parse_url
from kiln.registry.webhooks.models import Webhook, WebhookDelivery
from kiln.registry.webhooks.outbox import EVENTS


def check_events(events: list[str]) -> None:
    """UnknownName (UNKNOWN_EVENT), listing the known events, unless every one of `events` is known."""
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        raise UnknownName(
            f"unknown webhook events: {', '.join(unknown)}; known: {', '.join(EVENTS)}",
            code=Codes.UNKNOWN_EVENT,
            details={"unknown": unknown, "known": list(EVENTS)},
        )


def _origin(url: str) -> str:
    # What the audit log (readable with `read`) says of a URL: its path may hold a credential.
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def create_webhook(
    session: Session,
    actor: Principal,
    *,
    url: str,
    events: list[str],
    model_pattern: str,
    destinations: DestinationPolicy,
    secret: str | None = None,
) -> tuple[Webhook, str]:
    """A new active webhook and its signing secret (generated unless given). Audited, without URL path or secret.

    Its URL must name a destination `destinations` admits (a public address unless the operator's
    allow-list says otherwise); it is checked again, resolved afresh, before every delivery attempt.
    """
    parse_url(url)
    check_events(events)
    check_pattern(model_pattern)
    if not actor.covers_patterns([model_pattern]):
        raise Forbidden(
            f"token {actor.name!r} is limited to {', '.join(actor.models)} and cannot subscribe to "
            f"events of {model_pattern!r}",
            details={"model_pattern": model_pattern, "limited_to": list(actor.models), "token": actor.name},
        )
    # Last: it may ask the resolver, which only an admin allowed this subscription gets to do.
    destinations.check(url)
    secret = secret if secret is not None else secrets.token_urlsafe(32)
    webhook = Webhook(
        url=url,
        secret=secret,
        events=list(events),
        model_pattern=model_pattern,
        active=True,
        created_by=actor.name,
    )
    session.add(webhook)
    session.flush()
    audit.record(
        session,
        action="webhook.create",
        target=f"webhook:{webhook.id}",
        actor=actor.name,
        details={
            "before": None,
            "after": {"url": _origin(url), "events": webhook.events, "model_pattern": model_pattern},
        },
    )
    return webhook, secret


def webhooks_page(session: Session, actor: Principal, after: int | None, limit: int) -> Page[Webhook, int]:
    """Up to `limit` of the webhooks `actor` may manage, active or not, oldest first, past the webhook `after`.
    Patterns are applied here, a chunk at a time."""

    def fetch(past: int | None, n: int) -> list[Webhook]:
        query = select(Webhook).order_by(Webhook.id).limit(n)
        return list(session.scalars(query if past is None else query.where(Webhook.id > past)))

    managed = (lambda w: actor.covers_patterns([w.model_pattern])) if actor.models else None
    return keyset_page(fetch, lambda w: w.id, after, limit, keep=managed)


def get_webhook(session: Session, actor: Principal, webhook_id: int) -> Webhook:
    """A webhook `actor` may manage; one outside its model patterns is NotFound, as if absent."""
    webhook = session.get(Webhook, webhook_id)
    if webhook is None or not actor.covers_patterns([webhook.model_pattern]):
        raise NotFound(f"webhook {webhook_id} not found", details={"webhook": webhook_id})
    return webhook


def deactivate_webhook(session: Session, actor: Principal, webhook_id: int) -> Webhook:
    """Deactivate a webhook (idempotent): it gets no new events, and its pending deliveries are failed."""
    webhook = get_webhook(session, actor, webhook_id)
    if not webhook.active:
        return webhook
    webhook.active = False
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.webhook_id == webhook.id, WebhookDelivery.state == "pending")
        .values(state="failed", last_error="the webhook was deleted")
        .execution_options(synchronize_session=False)
    )
    audit.record(
        session,
        action="webhook.delete",
        target=f"webhook:{webhook.id}",
        actor=actor.name,
        details={"before": {"active": True}, "after": {"active": False}},
    )
    session.flush()
    return webhook


def deliveries_page(
    session: Session, actor: Principal, webhook_id: int, after: int | None, limit: int
) -> Page[WebhookDelivery, int]:
    """Up to `limit` of a webhook's deliveries, newest first, older than the delivery `after`, each with its
    attempts."""
    webhook = get_webhook(session, actor, webhook_id)

    def fetch(past: int | None, n: int) -> list[WebhookDelivery]:
        query = select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook.id)
        query = query if past is None else query.where(WebhookDelivery.id < past)
        query = query.order_by(WebhookDelivery.id.desc()).limit(n)
        return list(session.scalars(query.options(selectinload(WebhookDelivery.attempt_log))))

    return keyset_page(fetch, lambda d: d.id, after, limit)


def redeliver(session: Session, actor: Principal, webhook_id: int, delivery_id: int) -> WebhookDelivery:
    """A new pending delivery of a delivered or failed delivery's payload (same event `id`; receivers
    that deduplicate by it will see it as the same event)."""
    webhook = get_webhook(session, actor, webhook_id)
    original = session.get(WebhookDelivery, delivery_id)
    if original is None or original.webhook_id != webhook.id:
        raise NotFound(
            f"webhook {webhook_id} has no delivery {delivery_id}",
            details={"webhook": webhook_id, "delivery": delivery_id},
        )
    if not webhook.active:
        raise Conflict(
            f"webhook {webhook_id} was deleted; create a new one to receive events",
            code=Codes.WEBHOOK_INACTIVE,
            details={"webhook": webhook_id},
        )
    if original.state == "pending":
        raise Conflict(
            f"delivery {delivery_id} is still pending (attempt {original.attempts + 1} is due); it will be sent",
            code=Codes.DELIVERY_PENDING,
            details={"webhook": webhook_id, "delivery": delivery_id},
        )
    copy = WebhookDelivery(
        webhook_id=webhook.id,
        audit_event_id=original.audit_event_id,
        event=original.event,
        payload=original.payload,
        state="pending",
        next_attempt_at=utcnow(),
    )
    session.add(copy)
    session.flush()
    audit.record(
        session,
        action="webhook.redeliver",
        target=f"webhook:{webhook.id}",
        actor=actor.name,
        details={"before": {"delivery": delivery_id}, "after": {"delivery": copy.id}},
    )
    return copy
