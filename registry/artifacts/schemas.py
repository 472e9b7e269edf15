"""API shapes for artifacts, their files and eval results."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ConfigDict, Field, computed_field, field_validator

from kiln.core.evals import EvalMetrics, PublishedEval, RecordedEval
from kiln.core.manifest import ArtifactManifest, FileOut
from kiln.core.rows import FromRow
from kiln.registry.api.rows import StoredJSON
from kiln.registry.artifacts.evals import EvalStatus, eval_status

# A runtime name, optionally `@<hardware>` for an eval made on one GPU SKU (`tensorrt_llm@h100`,
# as the publish stage names a GPU runner's eval); the SKU is a hardware profile name (lowercase).
RUNTIME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+:-]*(@[a-z0-9][a-z0-9._-]*)?$"
RUNTIME_MAX_LENGTH = 64  # EvalResult.runtime's column
# What a runtime reports as its version ("transformers 5.17.0, torch 2.9.0+cu128", "vLLM 0.32.0 (CPU)"):
# printable and conservative, no leading or trailing space, no quotes or angle brackets.
RUNTIME_VERSION_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9 ._+:()/,=-]*[A-Za-z0-9._+:()/,=-])?$"
RUNTIME_VERSION_MAX_LENGTH = 200  # EvalResult.runtime_version's column
# The OpenAPI example of an eval's metrics: illustrative values, of the order a q4_k_m GGUF scores (eval.gates).
EXAMPLE_METRICS = {
    "tokens": 4064, "windows": 16, "vocab_size": 512, "ppl_ref": 3.21, "ppl": 3.27, "ppl_change": 0.0187,
    "kl": 0.0031, "kl_error": 0.0, "kl_max": 0.41, "top1": 0.947, "greedy_tokens": 128, "greedy_match": 0.52,
    "greedy_match_total": 0.61,
}  # fmt: skip


class EvalCreate(PublishedEval):
    """A `core.evals.PublishedEval` as the API accepts it: names and versions checked, nothing unknown."""

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
    metrics: EvalMetrics | None = Field(default=None, examples=[EXAMPLE_METRICS])
    reason: str | None = Field(default=None, max_length=10_000, description="why it failed / was not run")

    @field_validator("metrics", "gates", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        # `{}` is how publishers from before these fields were typed say "none measured" (and `{}`
        # is what the column stores for it), so it is accepted as that, not read as a record.
        return None if value == {} else value


class EvalOut(RecordedEval, FromRow):
    """A `core.evals.RecordedEval`, read from its row."""


class ArtifactSummary(FromRow):
    name: str
    target: str
    format: str
    quant: str
    hardware: list[str]
    unsupported: dict[str, str] = Field(description="hardware it does not run on, with the reason")
    runtime: StoredJSON
    manifest_digest: str
    total_size: int
    created_at: datetime
    evals: list[EvalOut]

    @computed_field(description="failed if any eval failed, else passed if any passed, else not_evaluated")
    def eval_status(self) -> EvalStatus:
        return eval_status(self.evals)


class ArtifactDetail(ArtifactSummary):
    model: str
    version: str
    manifest: ArtifactManifest
    files: list[FileOut]
