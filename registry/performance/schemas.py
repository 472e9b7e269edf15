"""API shapes for measured performance records."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.hardware import DEVICES_PER_NODE, HARDWARE_NAME_PATTERN
from kiln.registry.api.params import ITL_MS, MAX_CONCURRENCY, MAX_CONTEXT, TOKENS_PER_S, TTFT_MS
from kiln.registry.artifacts.schemas import (
    RUNTIME_MAX_LENGTH,
    RUNTIME_PATTERN,
    RUNTIME_VERSION_MAX_LENGTH,
    RUNTIME_VERSION_PATTERN,
)


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
