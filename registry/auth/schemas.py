"""API shapes for tokens: the secret appears only in the creation response."""

from __future__ import annotations

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from kiln.registry.auth.principal import Scope


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    scopes: list[Scope] = Field(min_length=1)
    models: list[str] = Field(default_factory=list, description="model name patterns (fnmatch); empty: all models")
    expires_at: AwareDatetime | None = Field(
        default=None,
        description="when the token stops working; default: the server's longest token lifetime from now "
        "(never, where it sets none)",
    )


class TokenRevoke(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=10_000)
