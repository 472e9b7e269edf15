"""API shapes for webhooks and their delivery log: the secret appears only in the creation response."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from registry.webhooks.delivery import ERROR_CLASSES
from registry.webhooks.models import Webhook, WebhookAttempt, WebhookDelivery
from registry.webhooks.outbox import EVENTS


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        max_length=2048,
        description="where events are POSTed: an http or https URL of a public address (or one the operator "
        "allow-lists), without a user name or password",
    )
    events: list[str] = Field(min_length=1, max_length=len(EVENTS), examples=[list(EVENTS)])
    model_pattern: str = Field(default="*", max_length=64, description="the models whose events it gets (fnmatch)")
    secret: str | None = Field(
        default=None, min_length=16, max_length=256, description="the HMAC key; default: a new random one"
    )


class WebhookOut(BaseModel):
    id: int
    url: str
    events: list[str]
    model_pattern: str
    active: bool
    created_by: str
    created_at: datetime

    @classmethod
    def from_row(cls, row: Webhook) -> WebhookOut:
        return cls(
            id=row.id,
            url=row.url,
            events=row.events,
            model_pattern=row.model_pattern,
            active=row.active,
            created_by=row.created_by,
            created_at=row.created_at,
        )


class WebhookCreated(WebhookOut):
    secret: str = Field(description="the signing secret; shown once, store it now")


class AttemptOut(BaseModel):
    attempt: int
    at: datetime
    status_code: int | None = Field(description="the receiver's HTTP status; null when none came")
    error: str | None = Field(
        description="why it did not deliver, one of: " + ", ".join(ERROR_CLASSES) + "; null when it delivered",
        examples=list(ERROR_CLASSES),
    )
    duration_ms: int

    @classmethod
    def from_row(cls, row: WebhookAttempt) -> AttemptOut:
        return cls(
            attempt=row.attempt,
            at=row.at,
            status_code=row.status_code,
            error=row.error,
            duration_ms=row.duration_ms,
        )


class DeliveryOut(BaseModel):
    id: int = Field(description="sent as X-Kiln-Delivery")
    webhook_id: int
    audit_event_id: int
    event: str
    payload: dict[str, Any]
    state: str = Field(examples=["pending", "delivered", "failed"])
    attempts: int
    next_attempt_at: datetime
    last_status: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
    attempt_log: list[AttemptOut] = Field(description="every attempt, first to last")

    @classmethod
    def from_row(cls, row: WebhookDelivery, attempts: list[WebhookAttempt]) -> DeliveryOut:
        return cls(
            id=row.id,
            webhook_id=row.webhook_id,
            audit_event_id=row.audit_event_id,
            event=row.event,
            payload=row.payload,
            state=row.state,
            attempts=row.attempts,
            next_attempt_at=row.next_attempt_at,
            last_status=row.last_status,
            last_error=row.last_error,
            created_at=row.created_at,
            delivered_at=row.delivered_at,
            attempt_log=[AttemptOut.from_row(a) for a in attempts],
        )
