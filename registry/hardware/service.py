"""The registry's hardware catalog: kiln's built-in entries, with admins' additions and overrides over them.

Every change is audited and bumps the routing revision, so resolve answers from the new catalog at
once, in every worker.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.core.error_codes import Codes
from kiln.core.errors import NotFound
from kiln.core.hardware import (
    HardwareCatalog,
    HardwareProfile,
    HardwareSource,
    builtin_catalog,
    parse_entry,
    parse_profile,
)
from kiln.registry.audit import service as audit
from kiln.registry.db import bytewise
from kiln.registry.hardware.models import HardwareEntry
from kiln.registry.paging import Page, keyset_page
from kiln.registry.resolve.service import bump_routing_revision


def registry_entries(session: Session) -> list[HardwareProfile]:
    """The entries admins gave, validated again on the way out (an entry from an older kiln may not parse)."""
    return [parse_profile(row.profile, f"registry hardware entry {row.name!r}") for row in _rows(session)]


def _rows(session: Session) -> list[HardwareEntry]:
    return list(session.scalars(select(HardwareEntry).order_by(HardwareEntry.name)))


def effective_catalog(session: Session) -> HardwareCatalog:
    """The catalog resolve uses: built-in entries, replaced or extended by the registry's own."""
    return builtin_catalog().extended(registry_entries(session))


def get_entry(session: Session, name: str) -> tuple[HardwareProfile, HardwareSource]:
    """One SKU of the effective catalog and where its entry comes from; HARDWARE_NOT_FOUND lists the known."""
    entries = {p.name: (p, source) for p, source in catalog_entries(session)}
    if name not in entries:
        known = sorted(entries)
        raise NotFound(
            f"unknown hardware {name!r}; known: {', '.join(known)}",
            code=Codes.HARDWARE_NOT_FOUND,
            details={"hardware": name, "known": known},
        )
    return entries[name]


def catalog_entries(session: Session) -> list[tuple[HardwareProfile, HardwareSource]]:
    """The effective catalog, each entry with where it comes from (builtin | registry | registry (overrides
    builtin)), from one read of the registry's entries: two reads could see a PUT committed between them."""
    own = registry_entries(session)
    names = {p.name for p in own}
    return [(p, registry_source(p.name) if p.name in names else "builtin") for p in builtin_catalog().extended(own)]


def catalog_page(session: Session, after: str | None, limit: int) -> Page[tuple[HardwareProfile, HardwareSource], str]:
    """Up to `limit` entries of the effective catalog, by name past `after`, each with where it comes from (as
    `catalog_entries`). The built-in entries are merged with a page of the registry's own: of the names past
    a cursor, the first `n` are among the first `n` of each, so `n` registry rows are all a page reads."""
    builtin = builtin_catalog().profiles

    def fetch(past: str | None, n: int) -> list[tuple[HardwareProfile, HardwareSource]]:
        name = bytewise(session, HardwareEntry.name)
        query = select(HardwareEntry).order_by(name).limit(n)
        rows = session.scalars(query if past is None else query.where(name > past))
        own = {row.name: parse_profile(row.profile, f"registry hardware entry {row.name!r}") for row in rows}
        names = sorted({*own, *(b for b in builtin if past is None or b > past)})[:n]
        return [(own[k], registry_source(k)) if k in own else (builtin[k], "builtin") for k in names]

    return keyset_page(fetch, lambda entry: entry[0].name, after, limit)


def registry_source(name: str) -> HardwareSource:
    """How `catalog_entries` names the source of the registry's own entry for `name`."""
    return "registry (overrides builtin)" if name in builtin_catalog().profiles else "registry"


def put_entry(session: Session, name: str, data: dict[str, Any], actor: str) -> HardwareProfile:
    """Add SKU `name`, or replace its entry (a built-in one is overridden, not changed); audited."""
    profile = parse_entry(name, data)
    # First: the routing state's row lock serialises catalog writers (PostgreSQL; SQLite's write lock
    # already does), so two first PUTs of one SKU do not both insert it, and `before` is what was there.
    bump_routing_revision(session)
    row = session.scalars(select(HardwareEntry).where(HardwareEntry.name == name)).one_or_none()
    before = row.profile if row is not None else _builtin_dump(name)
    after = profile.model_dump(mode="json")
    if row is None:
        session.add(HardwareEntry(name=name, profile=after, updated_by=actor))
    else:
        row.profile = after
        row.updated_by = actor
    audit.record(
        session,
        action="hardware.put",
        target=f"hardware/{name}",
        actor=actor,
        details={"before": before, "after": after},
    )
    session.flush()
    return profile


def delete_entry(session: Session, name: str, actor: str) -> None:
    """Remove the registry's entry for `name`: an added SKU goes, an overridden built-in one returns; audited."""
    bump_routing_revision(session)  # first, as in `put_entry`
    row = session.scalars(select(HardwareEntry).where(HardwareEntry.name == name)).one_or_none()
    if row is None:
        builtin = name in builtin_catalog().profiles
        raise NotFound(
            f"the registry has no entry of its own for hardware {name!r}"
            + ("; built-in entries can be overridden (PUT), not deleted" if builtin else ""),
            code=Codes.HARDWARE_NOT_FOUND,
            details={"hardware": name},
        )
    audit.record(
        session,
        action="hardware.delete",
        target=f"hardware/{name}",
        actor=actor,
        details={"before": row.profile, "after": _builtin_dump(name)},
    )
    session.delete(row)
    session.flush()


def _builtin_dump(name: str) -> dict[str, Any] | None:
    profile = builtin_catalog().profiles.get(name)
    return profile.model_dump(mode="json") if profile is not None else None
