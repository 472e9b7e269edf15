"""ORM rows for webhooks, their deliveries (the outbox) and every delivery attempt."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from sqlalchemy import CheckConstraint, ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from kiln.registry.db import Base, utcnow

DeliveryState = Literal["pending", "delivered", "failed"]


class Webhook(Base):
    """A subscriber: the events it wants, for the models its pattern matches, signed with its secret."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(primary_key=True)
    url: Mapped[str] = mapped_column(String(2048))
    # Kept as given, not hashed: signing needs it. Returned only by the create response.
    secret: Mapped[str] = mapped_column(String(256))
    events: Mapped[list[str]]
    model_pattern: Mapped[str] = mapped_column(String(64))
    # Deleting a webhook deactivates it: its delivery log stays readable.
    active: Mapped[bool] = mapped_column(default=True)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    """One event for one webhook: pending until a 2xx answer (delivered) or its last attempt (failed)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        CheckConstraint("state IN ('pending', 'delivered', 'failed')", name="state"),
        # What the senders look for on every poll: pending deliveries that are due.
        Index("ix_webhook_deliveries_due", "state", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id"), index=True)
    audit_event_id: Mapped[int] = mapped_column(ForeignKey("audit_events.id"))
    event: Mapped[str] = mapped_column(String(64))
    # The body, as built from the audit event when it was recorded (signed as canonical JSON when sent).
    payload: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The lease of the sender that claimed it: no other sender takes it before `claimed_until`, and only
    # the holder of `claim_token` records the outcome.
    claimed_until: Mapped[datetime | None] = mapped_column(default=None)
    claim_token: Mapped[str | None] = mapped_column(String(32), default=None)
    last_status: Mapped[int | None] = mapped_column(default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)

    attempt_log: Mapped[list[WebhookAttempt]] = relationship(lazy="raise", order_by="WebhookAttempt.id")


class WebhookAttempt(Base):
    """One POST of a delivery: the receiver's status, or the error that stopped it, and how long it took."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(primary_key=True)
    delivery_id: Mapped[int] = mapped_column(ForeignKey("webhook_deliveries.id"), index=True)
    attempt: Mapped[int]
    at: Mapped[datetime] = mapped_column(default=utcnow)
    status_code: Mapped[int | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    duration_ms: Mapped[int]
