"""What other domains ask of resolve: that its cached answers be recomputed."""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session

from kiln.registry.db import insert_once
from kiln.registry.resolve.models import RoutingState

_BUMP = update(RoutingState).where(RoutingState.id == 1).values(revision=RoutingState.revision + 1)


def bump_routing_revision(session: Session) -> None:
    """Mark resolve's cached answers stale (in the caller's transaction).

    It locks the routing state's one row until the transaction ends (PostgreSQL), so callers that bump it
    first are serialised. A schema made without the migrations' first row gets it, once, however many
    writers find it missing at the same time."""
    if getattr(session.execute(_BUMP), "rowcount", 1) == 0:
        _, created = insert_once(session, RoutingState(id=1, revision=1), lambda: session.get(RoutingState, 1))
        if not created:  # another writer inserted it first: count this change too
            session.execute(_BUMP)
