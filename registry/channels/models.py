"""ORM rows for channels and their promotion history."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from kiln.registry.db import Base, utcnow
from kiln.registry.models.models import Model
from kiln.registry.releases.models import Release


class Channel(Base):
    __tablename__ = "channels"
    __table_args__ = (UniqueConstraint("model_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    name: Mapped[str] = mapped_column(String(32))
    release_id: Mapped[int] = mapped_column(ForeignKey("releases.id"))
    # The newest eval result of the release when it was promoted here: resolve on this channel
    # judges artifacts by the evals up to this one, so an eval posted later changes what the
    # channel serves only through a new promotion (by someone allowed to promote to it).
    evals_through: Mapped[int] = mapped_column(default=0)
    # A weighted split over several releases (a canary), or None: all traffic to `release_id`.
    # [{"release_id", "version", "weight" (basis points, summing to 10,000), "evals_through",
    # "buckets" ([start, end) ranges of the 10,000 key buckets it serves, registry.channels.buckets)}].
    # `release_id` is the member with the largest weight.
    split: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    model: Mapped[Model] = relationship(lazy="raise")
    release: Mapped[Release] = relationship(lazy="raise")


class ChannelEvent(Base):
    """One promotion or weight change: the channel moved from one version to another (None for its first).

    For a split, `to_version` is its largest member and `split` the weights after the change."""

    __tablename__ = "channel_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    channel_id: Mapped[int] = mapped_column(ForeignKey("channels.id"), index=True)
    from_version: Mapped[str | None] = mapped_column(String(64))
    to_version: Mapped[str] = mapped_column(String(64))
    forced: Mapped[bool]
    split: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str | None] = mapped_column(String(128))
    at: Mapped[datetime] = mapped_column(default=utcnow)
