"""API shapes for releases: what a request sends (the answers are `core.releases`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from kiln.core.releases import MODEL_CONFIG_DOC
from kiln.core.shape import ShapeRecord
from kiln.core.untrusted import JSONObject
from kiln.registry.api.params import ARTIFACT_NAME_PATTERN, SHA256_PATTERN, VERSION_PATTERN

# Documented, not enforced: a release from another tool may send any object (resolve reads it leniently).
MODEL_CONFIG_EXAMPLE = ShapeRecord(
    architecture="LlamaForCausalLM",
    num_layers=32,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
).model_dump(mode="json")
MAX_PLANNED_ARTIFACTS = 1000

PlannedName = Annotated[str, StringConstraints(pattern=ARTIFACT_NAME_PATTERN)]
Reason = Annotated[str, StringConstraints(min_length=1, max_length=10_000)]


class ReleaseCreate(BaseModel):
    # `model_config` is pydantic's own attribute, so the field is `architecture` under that alias.
    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)

    version: str = Field(pattern=VERSION_PATTERN, examples=["2026.11.0"])
    source_digest: str = Field(pattern=SHA256_PATTERN, description="sha256 of the canonical source")
    planned_artifacts: list[PlannedName] = Field(
        min_length=1,
        max_length=MAX_PLANNED_ARTIFACTS,
        description="every artifact the build will publish; sealing checks each arrived with an eval",
        examples=[["gguf-q4_k_m", "hf-bundle-fp8"]],
    )
    lineage: JSONObject = Field(default_factory=dict, description="where the source came from")
    architecture: JSONObject = Field(
        default_factory=dict, alias="model_config", description=MODEL_CONFIG_DOC, examples=[MODEL_CONFIG_EXAMPLE]
    )

    @field_validator("planned_artifacts")
    @classmethod
    def _unique(cls, names: list[str]) -> list[str]:
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"planned_artifacts repeats {', '.join(repeated)}")
        return sorted(names)


class ReasonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Reason = Field(description="why (audited)")
