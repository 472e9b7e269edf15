"""Who is calling, and what they may do: `Principal` and the scope rules, as data.

Scopes: `read` (list, resolve, download), `publish` (models, releases, blobs, artifacts, evals, and
promotion to unprotected channels), `promote` (promotion to protected channels, yank), `admin`
(tokens, garbage collection; implies every other scope). Any scope implies `read`. A token may be
limited to model name patterns (`llama-*`); it then acts on those models only.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Literal

from kiln.errors import Forbidden, Unauthorized

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

    def has(self, scope: Scope) -> bool:
        return any(scope == s or scope in IMPLIES[s] for s in self.scopes)

    def allows_model(self, model: str) -> bool:
        return not self.models or any(fnmatch.fnmatchcase(model, p) for p in self.models)

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
