"""API shapes for models."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.rows import FromRow
from kiln.registry.api.params import MODEL_NAME_PATTERN


class ModelCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=MODEL_NAME_PATTERN, examples=["tiny-llama"])
    description: str | None = Field(
        default=None, max_length=10_000, description="omitted: keep whatever an existing model has"
    )


class ModelOut(FromRow):
    name: str
    description: str
    created_at: datetime


class ModelDetail(ModelOut):
    releases: list[str] = Field(description="versions, newest first: a page of them (`after`, `limit`, `Link`)")
    channels: dict[str, str] = Field(description="channel name -> version it points to")
