"""Models, releases and their artifacts as the registry answers them, and the client reads them back.

The registry renders these records from its rows (`FromRow.of`); `client.RegistryClient` reads its
answers into the same records, which the CLI and the pipeline read by field. They live here, in the
ground layer, because the registry and the client both speak them. Each reads past what it does not
know, so a client reads a newer registry's answers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from kiln.core.evals import EvalStatus, RecordedEval, eval_status
from kiln.core.manifest import ArtifactIdentity, ArtifactManifest, FileOut
from kiln.core.rows import FromRow, StoredJSON
from kiln.core.shape import ShapeRecord

ReleaseStatus = Literal["open", "sealed", "abandoned"]

MODEL_CONFIG_DOC = (
    "the model's shape: the record kiln publishes (core.shape.ShapeRecord: "
    + ", ".join(ShapeRecord.model_fields)
    + "), or any config such as a Hugging Face config.json; stored as sent. Resolve reads it leniently: it sizes "
    "the KV cache from num_layers (or num_hidden_layers), num_kv_heads (or num_key_value_heads, else "
    "num_attention_heads) and head_dim (else hidden_size / num_attention_heads), and prefill from the "
    "parameters the other sizes give; a value that is not an integer from 1 to 2^24 counts as missing"
)


class ModelOut(FromRow):
    name: str
    description: str
    created_at: datetime


class ModelDetail(ModelOut):
    releases: list[str] = Field(description="versions, newest first: a page of them (`after`, `limit`, `Link`)")
    channels: dict[str, str] = Field(description="channel name -> version it points to")


class ArtifactSummary(ArtifactIdentity):
    """An artifact of a release: what it is, where it does not run, its manifest's digest and its evals."""

    model_config = ConfigDict(frozen=False, extra="ignore")  # what a newer registry adds, a client reads past

    unsupported: dict[str, str] = Field(description="hardware it does not run on, with the reason")
    manifest_digest: str
    total_size: int
    created_at: datetime
    evals: list[RecordedEval]

    @computed_field(description="failed if any eval failed, else passed if any passed, else not_evaluated")
    def eval_status(self) -> EvalStatus:
        return eval_status(self.evals)


class ArtifactDetail(ArtifactSummary):
    model: str
    version: str
    manifest: ArtifactManifest
    files: list[FileOut]


class ReleaseOut(BaseModel):
    # `model_config` is pydantic's own attribute, so the field is `architecture` under that alias.
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True, validate_by_alias=True)

    model: str
    version: str
    status: ReleaseStatus = Field(
        description="open: artifacts still arriving, not resolvable, promotable or downloadable by revision; "
        "sealed: complete and immutable; abandoned: never sealed, its artifacts dropped"
    )
    source_digest: str
    planned_artifacts: list[str]
    lineage: StoredJSON
    architecture: StoredJSON = Field(alias="model_config", description=MODEL_CONFIG_DOC)
    created_at: datetime
    sealed_at: datetime | None = None
    abandoned_at: datetime | None = None
    abandon_reason: str | None = None
    yanked_at: datetime | None = Field(default=None, description="set when yanked: resolve never returns it")
    yank_reason: str | None = None


class ReleaseDetail(ReleaseOut):
    artifacts: list[ArtifactSummary]
    missing: list[str] = Field(description="planned artifacts not published yet")
    channels: list[str] = Field(description="channels that point at this release")
