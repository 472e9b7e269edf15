"""Who is calling, and what they may do: `Principal` and the scope rules, as data.

Scopes: `read` (list, resolve, download), `publish` (models, releases, blobs, artifacts, evals, and
promotion to unprotected channels), `promote` (promotion to protected channels, yank), `admin`
(tokens, garbage collection; implies every other scope). Any scope implies `read`. A token may be
limited to model name patterns (`llama-*`); it then acts on those models only.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from kiln.core.errors import Forbidden, Unauthorized
from kiln.registry.auth.patterns import pattern_contains, patterns_overlap

Scope = Literal["read", "publish", "promote", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "publish", "promote", "admin")
# What each scope grants besides itself.
IMPLIES: dict[Scope, frozenset[Scope]] = {
    "read": frozenset(),
    "publish": frozenset({"read"}),
    "promote": frozenset({"read"}),
    "admin": frozenset(SCOPES),
}


@dataclass(frozen=True)
class Principal:
    """The caller: a token's name and grants, `anonymous`, or `local` (in-process, auth off)."""

    name: str
    scopes: frozenset[Scope]
    models: tuple[str, ...] = ()  # patterns; empty: all models
    authenticated: bool = True
    token_id: int | None = None  # the token's row, for what the registry records per token (uploads)
    expires_at: datetime | None = None  # the token's expiry (aware); None: never

    def __post_init__(self) -> None:
        # Asked on every request: what the scopes grant, and the answer per model, are kept.
        granted = frozenset(self.scopes).union(*(IMPLIES[s] for s in self.scopes if s in IMPLIES))
        object.__setattr__(self, "_granted", granted)
        object.__setattr__(self, "_models_allowed", {})

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def has(self, scope: Scope) -> bool:
        return scope in self._granted  # type: ignore[attr-defined]

    def allows_model(self, model: str) -> bool:
        if not self.models:
            return True
        known: dict[str, bool] = self._models_allowed  # type: ignore[attr-defined]
        allowed = known.get(model)
        if allowed is None:
            allowed = any(fnmatch.fnmatchcase(model, p) for p in self.models)
            if len(known) < 1024:  # the model names asked are the caller's to choose
                known[model] = allowed
        return allowed

    def covers_patterns(self, models: list[str] | tuple[str, ...]) -> bool:
        """True when this principal's model limit contains `models` (a token's patterns; empty: all)."""
        if not self.models:
            return True
        return bool(models) and all(any(pattern_contains(own, p) for own in self.models) for p in models)

    def sees_pattern(self, pattern: str) -> bool:
        """True when `pattern` (of a key, a webhook) matches some model this principal may act on."""
        return not self.models or any(patterns_overlap(own, pattern) for own in self.models)

    @property
    def unlimited_admin(self) -> bool:
        """An admin not limited to model patterns: the only caller who may change what belongs to no
        model or to every model (the hardware catalog, keys and webhooks beyond its own patterns)."""
        return self.has("admin") and not self.models

    def require_unlimited_admin(self, what: str) -> None:
        """Refuse (401/403) unless this is an admin not limited to model patterns."""
        self.require("admin")
        if self.models:
            raise Forbidden(
                f"token {self.name!r} is limited to {', '.join(self.models)}; {what} needs an admin token "
                "for all models",
                details={"limited_to": list(self.models), "token": self.name},
            )

    def check_grant(self, scopes: list[str], models: list[str]) -> None:
        """Forbidden unless a token with `scopes` and `models` grants nothing this principal lacks."""
        beyond = [s for s in scopes if s not in SCOPES or not self.has(s)]  # type: ignore[arg-type]
        if beyond:
            raise Forbidden(
                f"token {self.name!r} cannot grant scopes it does not have: {', '.join(beyond)}",
                details={"scopes": beyond, "token": self.name},
            )
        if not self.covers_patterns(models):
            wanted = ", ".join(models) if models else "all models"
            raise Forbidden(
                f"token {self.name!r} is limited to {', '.join(self.models)} and cannot grant {wanted}",
                details={"models": models, "limited_to": list(self.models), "token": self.name},
            )

    def require(self, scope: Scope, model: str | None = None) -> None:
        """Raise 401 (no token) or 403 (token lacks the scope or the model) unless allowed."""
        if not self.has(scope):
            if not self.authenticated:
                raise Unauthorized(
                    f"this needs a token with the {scope!r} scope; send 'Authorization: Bearer <token>'",
                    details={"scope": scope},
                )
            raise Forbidden(
                f"token {self.name!r} lacks the {scope!r} scope (has: {', '.join(sorted(self.scopes)) or 'none'})",
                details={"scope": scope, "token": self.name},
            )
        if model is not None and not self.allows_model(model):
            raise Forbidden(
                f"token {self.name!r} may not act on model {model!r} (limited to: {', '.join(self.models)})",
                details={"model": model, "token": self.name},
            )


ANONYMOUS_READER = Principal("anonymous", frozenset({"read"}), authenticated=False)
ANONYMOUS = Principal("anonymous", frozenset(), authenticated=False)
LOCAL = Principal("local", frozenset({"admin"}))
