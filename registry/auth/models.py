"""ORM row for an API token: only its sha256 is stored; the secret is shown once, at creation."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from kiln.registry.db import Base, utcnow


class Token(Base):
    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    # sha256 of the whole secret: tokens are 256 random bits, so a fast hash is not guessable.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # shown in listings to tell tokens apart
    scopes: Mapped[list[str]]
    models: Mapped[list[str]]  # fnmatch patterns; empty: every model
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    expires_at: Mapped[datetime | None] = mapped_column(default=None)  # None: never (created before expiry)
