"""API shapes for channels and promotions."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator

from registry.api.params import VERSION_PATTERN


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(pattern=VERSION_PATTERN)
    force: bool = Field(default=False, description="promote despite failed eval gates; needs a reason")
    reason: str | None = Field(default=None, max_length=10_000)
    actor: str | None = Field(default=None, max_length=128, description="who asks (recorded in history)")

    @model_validator(mode="after")
    def _forced_needs_reason(self) -> PromoteRequest:
        if self.force and not (self.reason and self.reason.strip()):
            raise ValueError("a forced promotion needs a non-empty reason")
        return self


class ChannelEventOut(BaseModel):
    from_version: str | None
    to_version: str
    forced: bool
    reason: str | None
    actor: str | None
    at: datetime


class ChannelOut(BaseModel):
    model: str
    name: str
    version: str = Field(description="the release the channel points at")
    updated_at: datetime


class ChannelDetail(ChannelOut):
    history: list[ChannelEventOut] = Field(description="promotions, newest first")
