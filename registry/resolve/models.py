"""ORM row for the routing revision: what resolve's cached answers depend on beyond a channel."""

from __future__ import annotations

from sqlalchemy.orm import Mapped, mapped_column

from kiln.registry.db import Base


class RoutingState(Base):
    """One row. `revision` grows with every change to the hardware catalog or to performance records,
    so resolve's one query per request sees them, as it sees promotions, in every worker at once."""

    __tablename__ = "routing_state"

    id: Mapped[int] = mapped_column(primary_key=True)
    revision: Mapped[int] = mapped_column(default=0)
