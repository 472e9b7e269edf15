"""A short-lived cache of token lookups, so authenticated reads do not cost a database query each.

A revocation is seen at once by the process that made it and within `ttl_s` by the others; an expiry
is seen at once by every process (a cached principal carries it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from kiln.registry.auth.principal import Principal
from kiln.registry.auth.service import hash_token, principal_for
from kiln.registry.db import utcnow


class Missing:
    """Not in a memory cache: the answer needs the database."""


MISSING = Missing()


class TokenCache:
    def __init__(self, session_factory: Callable[[], Session], ttl_s: float = 5.0, size: int = 1024) -> None:
        self._session_factory = session_factory
        self._ttl_s = ttl_s
        self._size = size
        self._entries: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    def cached(self, secret: str) -> Principal | None | Missing:
        """What `lookup` would answer, from memory only (no database): MISSING when it must ask."""
        hit = self._entries.get(hash_token(secret))  # a dict read is atomic; the lock guards the writes
        if hit is not None and time.monotonic() - hit[0] < self._ttl_s:
            principal = hit[1]  # an expired token is refused from the cache too, the moment it expires
            return None if principal is None or principal.expired(utcnow()) else principal
        return MISSING

    def lookup(self, secret: str) -> Principal | None:
        """The token's principal (None: unknown or revoked), from the cache or else the database (blocking)."""
        hit = self.cached(secret)
        if not isinstance(hit, Missing):
            return hit
        key = hash_token(secret)
        now = time.monotonic()
        with self._session_factory() as session:
            principal = principal_for(session, secret)
        with self._lock:
            if len(self._entries) >= self._size:
                self._entries.clear()
            self._entries[key] = (now, principal)
        return principal

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
