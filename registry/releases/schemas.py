"""API shapes for releases."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from registry.api.params import SHA256_PATTERN, VERSION_PATTERN
from registry.artifacts.schemas import ArtifactSummary

MODEL_CONFIG_DOC = (
    "the model's architecture; resolve sizes the KV cache from num_hidden_layers, "
    "num_key_value_heads (or num_attention_heads) and head_dim (or hidden_size / num_attention_heads), "
    "as in a Hugging Face config.json; short names layers, kv_heads are accepted too"
)


class ReleaseCreate(BaseModel):
    # `model_config` is pydantic's own attribute, so the field is `architecture` under that alias.
    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)

    version: str = Field(pattern=VERSION_PATTERN, examples=["2026.11.0"])
    source_digest: str = Field(pattern=SHA256_PATTERN, description="sha256 of the canonical source")
    lineage: dict[str, Any] = Field(default_factory=dict, description="where the source came from")
    architecture: dict[str, Any] = Field(default_factory=dict, alias="model_config", description=MODEL_CONFIG_DOC)


class ReleaseOut(BaseModel):
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)

    model: str
    version: str
    source_digest: str
    lineage: dict[str, Any]
    architecture: dict[str, Any] = Field(alias="model_config")
    created_at: datetime
    yanked_at: datetime | None = Field(default=None, description="set when yanked: resolve never returns it")
    yank_reason: str | None = None


class YankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=10_000, description="why (audited)")


class ReleaseDetail(ReleaseOut):
    artifacts: list[ArtifactSummary]
    channels: list[str] = Field(description="channels that point at this release")
