"""What other domains ask of resolve: that its cached answers be recomputed."""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session

from registry.resolve.models import RoutingState


def bump_routing_revision(session: Session) -> None:
    """Mark resolve's cached answers stale (in the caller's transaction)."""
    result = session.execute(
        update(RoutingState).where(RoutingState.id == 1).values(revision=RoutingState.revision + 1)
    )
    if getattr(result, "rowcount", 1) == 0:  # a schema made without the migrations' first row
        session.add(RoutingState(id=1, revision=1))
