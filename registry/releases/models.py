"""ORM row for a release."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import CheckConstraint, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from kiln.core.error_codes import Codes
from kiln.core.errors import Conflict, NotFound
from kiln.core.releases import ReleaseStatus
from kiln.registry.db import Base, utcnow
from kiln.registry.models.models import Model

if TYPE_CHECKING:
    from kiln.registry.artifacts.models import Artifact


RELEASE_STATUSES: tuple[ReleaseStatus, ...] = ("open", "sealed", "abandoned")


class Release(Base):
    """A version of a model: `open` while its artifacts and evals arrive, then `sealed` (complete,
    immutable, and only then resolvable, promotable and downloadable by revision) or `abandoned`."""

    __tablename__ = "releases"
    __table_args__ = (
        UniqueConstraint("model_id", "version"),
        CheckConstraint("status IN ('open', 'sealed', 'abandoned')", name="status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    version: Mapped[str] = mapped_column(String(64))
    source_digest: Mapped[str] = mapped_column(String(64))
    lineage: Mapped[dict[str, Any]]
    # The architecture (layers, KV heads, head_dim, ...) that resolve uses to size the KV cache.
    model_config: Mapped[dict[str, Any]]
    # The artifact names the build planned: sealing checks each is published with an eval.
    planned_artifacts: Mapped[list[str]]
    status: Mapped[str] = mapped_column(String(16), default="open")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    sealed_at: Mapped[datetime | None] = mapped_column(default=None)
    abandoned_at: Mapped[datetime | None] = mapped_column(default=None)
    abandon_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # Yanked releases stay (a channel may still name one) but are never resolved, downloaded by
    # revision, or promoted.
    yanked_at: Mapped[datetime | None] = mapped_column(default=None)
    yank_reason: Mapped[str | None] = mapped_column(Text, default=None)

    model: Mapped[Model] = relationship(lazy="raise")
    artifacts: Mapped[list[Artifact]] = relationship(lazy="raise", order_by="Artifact.name")

    def check_open(self, model: str, doing: str) -> None:
        """Conflict unless artifacts may still be added to the release (it is open)."""
        where = {"model": model, "version": self.version, "status": self.status}
        if self.status == "sealed":
            raise Conflict(
                f"release {model}@{self.version} is sealed: its artifacts never change; {doing} in a new version",
                code=Codes.RELEASE_SEALED,
                details=where,
            )
        if self.status == "abandoned":
            raise Conflict(
                f"release {model}@{self.version} was abandoned ({self.abandon_reason}); {doing} in a new version",
                code=Codes.RELEASE_ABANDONED,
                details=where,
            )

    def check_served(self, model: str) -> None:
        """Conflict (open or abandoned) or gone (yanked) unless the release is sealed and may be served."""
        where = {"model": model, "version": self.version, "status": self.status}
        if self.status == "open":
            raise Conflict(
                f"release {model}@{self.version} is open (still being published): it is served only once it is sealed",
                code=Codes.RELEASE_NOT_SEALED,
                details=where,
            )
        if self.status == "abandoned":
            raise NotFound(
                f"release {model}@{self.version} was abandoned and is never served",
                code=Codes.RELEASE_NOT_SERVED,
                details=where,
            )
        if self.yanked_at is not None:
            raise NotFound(
                f"release {model}@{self.version} is yanked ({self.yank_reason}) and is never served",
                code=Codes.RELEASE_NOT_SERVED,
                details={**where, "yanked": True},
            )
