"""API shapes for models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kiln.registry.api.params import MODEL_NAME_PATTERN


class ModelCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=MODEL_NAME_PATTERN, examples=["tiny-llama"])
    description: str | None = Field(
        default=None, max_length=10_000, description="omitted: keep whatever an existing model has"
    )
