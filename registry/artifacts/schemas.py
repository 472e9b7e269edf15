"""API shapes for artifacts, their files and eval results."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field

from core.manifest import ArtifactManifest
from registry.api.rows import FromRow
from registry.artifacts.evals import EvalStatus, eval_status

# A runtime name, optionally `@<hardware>` for an eval made on one GPU SKU (`tensorrt_llm@h100`,
# as the publish stage names a GPU runner's eval); the SKU is a hardware profile name (lowercase).
RUNTIME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+:-]*(@[a-z0-9][a-z0-9._-]*)?$"
RUNTIME_MAX_LENGTH = 64  # EvalResult.runtime's column
# What a runtime reports as its version ("transformers 5.17.0, torch 2.9.0+cu128", "vLLM 0.32.0 (CPU)"):
# printable and conservative, no leading or trailing space, no quotes or angle brackets.
RUNTIME_VERSION_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9 ._+:()/,=-]*[A-Za-z0-9._+:()/,=-])?$"
RUNTIME_VERSION_MAX_LENGTH = 200  # EvalResult.runtime_version's column


class EvalCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    runtime: str = Field(
        pattern=RUNTIME_PATTERN,
        max_length=RUNTIME_MAX_LENGTH,
        examples=["llama.cpp", "transformers", "tensorrt_llm@h100"],
    )
    runtime_version: str | None = Field(
        default=None,
        pattern=RUNTIME_VERSION_PATTERN,
        max_length=RUNTIME_VERSION_MAX_LENGTH,
        examples=["transformers 5.17.0, torch 2.9.0", "vLLM 0.32.0 (CPU)"],
        description="the exact runtime that ran the eval, as it reports its name and version",
    )
    status: EvalStatus
    metrics: dict[str, Any] = Field(default_factory=dict, examples=[{"kl": 0.012, "ppl_delta": 0.3}])
    gates: dict[str, Any] = Field(default_factory=dict, description="the gate thresholds applied")
    reason: str | None = Field(default=None, max_length=10_000, description="why it failed / was not run")


class EvalOut(FromRow):
    runtime: str
    runtime_version: str | None
    status: EvalStatus
    metrics: dict[str, Any]
    gates: dict[str, Any]
    reason: str | None
    created_at: datetime


class ArtifactSummary(FromRow):
    name: str
    target: str
    format: str
    quant: str
    hardware: list[str]
    unsupported: dict[str, str] = Field(description="hardware it does not run on, with the reason")
    runtime: dict[str, Any]
    manifest_digest: str
    total_size: int
    created_at: datetime
    evals: list[EvalOut]

    @computed_field(description="failed if any eval failed, else passed if any passed, else not_evaluated")
    def eval_status(self) -> EvalStatus:
        return eval_status(self.evals)


class FileOut(BaseModel):
    path: str
    sha256: str
    size: int
    url: str = Field(description="absolute download URL")


class ArtifactDetail(ArtifactSummary):
    model: str
    version: str
    manifest: ArtifactManifest
    files: list[FileOut]
