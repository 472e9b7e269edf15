"""Measured performance as it crosses the wire: one measurement of an artifact served on one SKU, as a
runner sends it (`PerformanceCreate`) and the registry records and answers it (`PerformanceOut`), with the
ranges of a serving workload that resolve's queries share.

They live here, in the ground layer, because the registry and the client both speak them; how resolve
ranks candidates by them stays in `registry.resolve`.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.evals import RUNTIME_MAX_LENGTH, RUNTIME_PATTERN, RUNTIME_VERSION_MAX_LENGTH, RUNTIME_VERSION_PATTERN
from kiln.core.hardware import DEVICES_PER_NODE, HARDWARE_NAME_PATTERN

# A serving workload, as resolve asks it (query) and a performance record states it (body): ranges far
# past any real replica and within which resolve's arithmetic stays finite. Floats are (low, high).
MAX_CONTEXT = 10_000_000  # tokens per sequence
MAX_CONCURRENCY = 100_000  # sequences at once
TOKENS_PER_S = (0.001, 10_000_000.0)  # decode tokens/s (of a replica, or per sequence)
TTFT_MS = (0.001, 86_400_000.0)  # time to first token: a microsecond to a day
ITL_MS = (0.001, 3_600_000.0)  # inter-token latency: a microsecond to an hour


class PerformanceCreate(BaseModel):
    """One measurement of an artifact served on one SKU."""

    model_config = ConfigDict(extra="forbid")

    hardware: str = Field(pattern=HARDWARE_NAME_PATTERN, description="catalog SKU it ran on", examples=["h100"])
    runtime: str = Field(pattern=RUNTIME_PATTERN, max_length=RUNTIME_MAX_LENGTH, examples=["vllm"])
    runtime_version: str = Field(
        pattern=RUNTIME_VERSION_PATTERN, max_length=RUNTIME_VERSION_MAX_LENGTH, examples=["vLLM 0.32.0, CUDA 12.8"]
    )
    tp: int = Field(
        strict=True, ge=1, le=DEVICES_PER_NODE[1], description="devices per replica (tensor-parallel degree)"
    )
    context: int = Field(strict=True, ge=1, le=MAX_CONTEXT, description="tokens of context per sequence")
    concurrency: int = Field(strict=True, ge=1, le=MAX_CONCURRENCY, description="sequences served at once")
    tokens_per_s: float = Field(
        strict=True,
        ge=TOKENS_PER_S[0],
        le=TOKENS_PER_S[1],
        allow_inf_nan=False,
        description="output tokens/s of the whole replica at that concurrency",
    )
    ttft_ms: float = Field(
        strict=True, ge=TTFT_MS[0], le=TTFT_MS[1], allow_inf_nan=False, description="time to first token"
    )
    itl_p50_ms: float = Field(
        strict=True, ge=ITL_MS[0], le=ITL_MS[1], allow_inf_nan=False, description="inter-token latency, median"
    )
    itl_p99_ms: float = Field(
        strict=True, ge=ITL_MS[0], le=ITL_MS[1], allow_inf_nan=False, description="inter-token latency, 99th percentile"
    )


class PerformanceOut(PerformanceCreate):
    id: int
    artifact: str
    recorded_by: str
    recorded_at: datetime
