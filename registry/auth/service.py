"""Token operations: create (the secret is returned once), list, revoke, and look up by secret."""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, NotFound
from kiln.registry.audit import service as audit
from kiln.registry.auth.models import Token
from kiln.registry.auth.patterns import check_pattern
from kiln.registry.auth.principal import SCOPES, Principal, Scope
from kiln.registry.db import utcnow
from kiln.registry.paging import Page, keyset_page

TOKEN_PREFIX = "kiln_"
_TOKEN = re.compile(r"^kiln_[A-Za-z0-9_-]{43}$")
MAX_TOKEN_PATTERNS = 8  # what a scoped admin's listing compares is (its patterns) x (each token's)


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def token_expiry(expires_at: datetime | None, max_lifetime: timedelta | None, now: datetime) -> datetime | None:
    """When a token asked to expire at `expires_at` (None: as late as allowed) expires: refused
    (TOKEN_EXPIRY_INVALID) when that is not in the future or beyond `max_lifetime` (None: no maximum)."""
    latest = None if max_lifetime is None else now + max_lifetime
    if expires_at is None:
        return latest
    if expires_at.tzinfo is None or expires_at <= now or (latest is not None and expires_at > latest):
        limit = "" if latest is None else f" and no later than {latest.isoformat(timespec='seconds')}"
        raise InvalidInput(
            f"a token's expiry must be a time with its zone, in the future{limit}; got {expires_at.isoformat()}",
            code=Codes.TOKEN_EXPIRY_INVALID,
            details={"latest": None if latest is None else latest.isoformat()},
        )
    return expires_at


def create_token(
    session: Session,
    name: str,
    scopes: list[str],
    models: list[str],
    actor: Principal,
    expires_at: datetime | None = None,
    max_lifetime: timedelta | None = None,
) -> tuple[Token, str]:
    """A new token and its secret (shown once; only its hash is stored). Audited.

    `actor` may grant only what it holds: its scopes, within its model patterns (Forbidden otherwise).
    The token expires at `expires_at`, which `max_lifetime` (the server's setting) bounds; without
    one it expires after `max_lifetime`, or never when there is no maximum.
    """
    unknown = [s for s in scopes if s not in SCOPES]
    if not scopes or unknown:
        raise InvalidInput(
            f"scopes must be some of {', '.join(SCOPES)}; got {scopes}",
            code=Codes.INVALID_SCOPE,
            details={"known": SCOPES},
        )
    if len(models) > MAX_TOKEN_PATTERNS:
        raise InvalidInput(
            f"a token names at most {MAX_TOKEN_PATTERNS} model patterns; got {len(models)}",
            code=Codes.TOO_MANY_PATTERNS,
            details={"max": MAX_TOKEN_PATTERNS},
        )
    for pattern in models:
        check_pattern(pattern)
    actor.check_grant(scopes, models)
    expires_at = token_expiry(expires_at, max_lifetime, utcnow())
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = Token(
        name=name,
        token_hash=hash_token(secret),
        prefix=secret[: len(TOKEN_PREFIX) + 6],
        scopes=sorted(set(scopes)),
        models=list(models),
        created_by=actor.name,
        expires_at=expires_at,
    )
    session.add(token)
    session.flush()
    audit.record(
        session,
        action="token.create",
        target=f"token:{token.id}",
        actor=actor.name,
        details={
            "before": None,
            "after": {
                "name": name,
                "scopes": token.scopes,
                "models": token.models,
                "expires_at": None if expires_at is None else expires_at.isoformat(),
            },
        },
    )
    return token, secret


def tokens_page(session: Session, actor: Principal, after: int | None, limit: int) -> Page[Token, int]:
    """Up to `limit` of the tokens `actor` may see, oldest first, past the token `after`: those within its model
    patterns (all of them for an unlimited admin). Patterns are applied here, a chunk at a time."""

    def fetch(past: int | None, n: int) -> list[Token]:
        query = select(Token).order_by(Token.id).limit(n)
        return list(session.scalars(query if past is None else query.where(Token.id > past)))

    visible = (lambda t: actor.covers_patterns(t.models)) if actor.models else None
    return keyset_page(fetch, lambda t: t.id, after, limit, keep=visible)


def revoke_token(session: Session, token_id: int, actor: Principal, reason: str | None = None) -> Token:
    """Revoke a token within `actor`'s model patterns (one outside them is NotFound, as if absent)."""
    token = session.get(Token, token_id)
    if token is None or not actor.covers_patterns(token.models):
        raise NotFound(f"token {token_id} not found", details={"token": token_id})
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        audit.record(
            session,
            action="token.revoke",
            target=f"token:{token.id}",
            actor=actor.name,
            reason=reason,
            details={"before": {"name": token.name, "revoked": False}, "after": {"name": token.name, "revoked": True}},
        )
    return token


def principal_for(session: Session, secret: str) -> Principal | None:
    """The principal a bearer secret stands for, or None if it is unknown, malformed, revoked or expired."""
    if not _TOKEN.fullmatch(secret):
        return None
    token = session.scalars(select(Token).where(Token.token_hash == hash_token(secret))).one_or_none()
    if token is None or token.revoked_at is not None:
        return None
    scopes: frozenset[Scope] = frozenset(s for s in SCOPES if s in token.scopes)
    principal = Principal(
        f"token:{token.name}", scopes, tuple(token.models), token_id=token.id, expires_at=token.expires_at
    )
    return None if principal.expired(utcnow()) else principal
