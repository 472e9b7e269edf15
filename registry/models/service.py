"""Model operations over a Session."""

from __future__ import annotations

from sqlalchemy import ScalarSelect, select
from sqlalchemy.orm import Session

from kiln.core.errors import Conflict, NotFound
from kiln.registry.auth.principal import Principal
from kiln.registry.db import insert_once, lock_row
from kiln.registry.models.models import Model
from kiln.registry.models.schemas import ModelCreate
from kiln.registry.paging import Page, keyset_page


def find_model(session: Session, name: str) -> Model | None:
    return session.scalars(select(Model).where(Model.name == name)).one_or_none()


def model_id_of(name: str) -> ScalarSelect[int]:
    """The id of the model `name` as a subquery, for another domain's query to filter by in one round trip."""
    return select(Model.id).where(Model.name == name).scalar_subquery()


def lock_model(session: Session, model_id: int) -> None:
    """Serialise changes to one model (its channels) until the transaction ends: a lock on its row."""
    lock_row(session, Model.id, model_id)


def get_model(session: Session, name: str) -> Model:
    model = find_model(session, name)
    if model is None:
        raise NotFound(f"model {name!r} not found", details={"model": name})
    return model


def models_page(session: Session, reader: Principal, after: str | None, limit: int) -> Page[Model, str]:
    """Up to `limit` of the models `reader` may read, by name, past the name `after`."""

    def fetch(past: str | None, n: int) -> list[Model]:
        query = select(Model).order_by(Model.name).limit(n)
        return list(session.scalars(query if past is None else query.where(Model.name > past)))

    readable = None if not reader.models else (lambda m: reader.allows_model(m.name))
    return keyset_page(fetch, lambda m: m.name, after, limit, keep=readable)


def create_model(session: Session, spec: ModelCreate) -> tuple[Model, bool]:
    """Create a model; an existing one is returned unchanged when the description agrees (or is omitted)."""

    def same(existing: Model) -> Model:
        if spec.description is not None and spec.description != existing.description:
            raise Conflict(
                f"model {spec.name!r} exists with a different description",
                details={"model": spec.name, "stored": existing.description, "sent": spec.description},
            )
        return existing

    existing = find_model(session, spec.name)
    if existing is not None:
        return same(existing), False
    row, created = insert_once(
        session, Model(name=spec.name, description=spec.description or ""), lambda: find_model(session, spec.name)
    )
    return (row, True) if created else (same(row), False)
