"""API shapes for artifacts, their files and eval results."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from core.manifest import ArtifactManifest
from registry.artifacts.models import Artifact, EvalResult, EvalStatus, eval_status

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


class EvalOut(BaseModel):
    runtime: str
    runtime_version: str | None
    status: EvalStatus
    metrics: dict[str, Any]
    gates: dict[str, Any]
    reason: str | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: EvalResult) -> EvalOut:
        return cls(
            runtime=row.runtime,
            runtime_version=row.runtime_version,
            status=row.status,  # type: ignore[arg-type]  # the CHECK constraint keeps it one of three
            metrics=row.metrics,
            gates=row.gates,
            reason=row.reason,
            created_at=row.created_at,
        )


class ArtifactSummary(BaseModel):
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
    eval_status: EvalStatus = Field(
        description="failed if any eval failed, else passed if any passed, else not_evaluated"
    )
    evals: list[EvalOut]

    @classmethod
    def from_row(cls, row: Artifact) -> ArtifactSummary:
        """Needs `evals` loaded."""
        return cls(**_summary_fields(row))


def _summary_fields(row: Artifact) -> dict[str, Any]:
    return {
        "name": row.name,
        "target": row.target,
        "format": row.format,
        "quant": row.quant,
        "hardware": row.hardware,
        "unsupported": row.unsupported,
        "runtime": row.runtime,
        "manifest_digest": row.manifest_digest,
        "total_size": row.total_size,
        "created_at": row.created_at,
        "eval_status": eval_status(row.evals),
        "evals": [EvalOut.from_row(e) for e in row.evals],
    }


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

    @classmethod
    def from_row(  # type: ignore[override]
        cls, row: Artifact, *, model: str, version: str, manifest: ArtifactManifest, files: list[FileOut]
    ) -> ArtifactDetail:
        return cls(**_summary_fields(row), model=model, version=version, manifest=manifest, files=files)
