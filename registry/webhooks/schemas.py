"""API shapes for webhooks and their delivery log: the secret appears only in the creation response."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.rows import FromRow, StoredJSON
from kiln.registry.webhooks.delivery import ERROR_CLASSES
from kiln.registry.webhooks.outbox import EVENTS


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


class WebhookOut(FromRow):
    id: int
    url: str
    events: list[str]
    model_pattern: str
    active: bool
    created_by: str
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(description="the signing secret; shown once, store it now")


class AttemptOut(FromRow):
    attempt: int
    at: datetime
    status_code: int | None = Field(description="the receiver's HTTP status; null when none came")
    error: str | None = Field(
        description="why it did not deliver, one of: " + ", ".join(ERROR_CLASSES) + "; null when it delivered",
        examples=list(ERROR_CLASSES),
    )
    duration_ms: int


class DeliveryOut(FromRow):
    id: int = Field(description="sent as X-Kiln-Delivery")
    webhook_id: int
    audit_event_id: int
    event: str
    payload: StoredJSON
    state: str = Field(examples=["pending", "delivered", "failed"])
    attempts: int
    next_attempt_at: datetime
    last_status: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
    attempt_log: list[AttemptOut] = Field(description="every attempt, first to last")
