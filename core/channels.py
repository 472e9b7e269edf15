"""Channels as the registry answers them, and the client reads them back: where a channel points (a release,
or a weighted split over releases) and its history of promotions."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class SplitMemberOut(BaseModel):
    version: str
    weight: float = Field(description="percent of the traffic")


class ChannelEventOut(BaseModel):
    from_version: str | None
    to_version: str
    forced: bool
    split: list[SplitMemberOut] | None = Field(default=None, description="the weights after a split change")
    reason: str | None
    actor: str | None
    at: datetime


class ChannelOut(BaseModel):
    model: str
    name: str
    version: str = Field(description="the release the channel points at (of a split: the largest member)")
    split: list[SplitMemberOut] | None = Field(default=None, description="a weighted split over releases (canary)")
    updated_at: datetime

    def members(self) -> list[SplitMemberOut]:
        """The releases the channel's traffic goes to: its split's members, else its one release at 100 %."""
        return self.split or [SplitMemberOut(version=self.version, weight=100)]


class ChannelDetail(ChannelOut):
    history: list[ChannelEventOut] = Field(
        description="promotions, newest first: a page of them (`limit`; the next page is the answer's `Link`)"
    )
