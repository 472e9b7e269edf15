"""API shapes for an artifact's eval results as a request sends them (the answers are `core.releases`)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from kiln.core.evals import (
    RUNTIME_MAX_LENGTH,
    RUNTIME_PATTERN,
    RUNTIME_VERSION_MAX_LENGTH,
    RUNTIME_VERSION_PATTERN,
    EvalMetrics,
    PublishedEval,
)

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
