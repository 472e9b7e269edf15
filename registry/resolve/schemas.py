"""API shapes for resolve answers."""

from __future__ import annotations

from pydantic import BaseModel, Field

from registry.artifacts.models import EvalStatus
from registry.artifacts.schemas import FileOut


class ResolvedArtifact(BaseModel):
    name: str
    target: str
    format: str
    quant: str
    manifest_digest: str
    files: list[FileOut]


class ResolveReason(BaseModel):
    fits: bool = Field(description="weights + KV cache + 10% overhead fit in the hardware's memory")
    weights_bytes: int
    kv_cache_bytes: int = Field(description="2 (K,V) × layers × kv_heads × head_dim × context × concurrency × 2 B")
    memory_bytes: int = Field(description="memory of the hardware profile")
    required_bytes: int = Field(description="(weights + KV cache) × 1.1")
    decode_tokens_per_s_bound: float = Field(description="memory bandwidth / weight bytes read per token")
    eval_status: EvalStatus
    explanation: str


class ResolveCandidate(BaseModel):
    artifact: ResolvedArtifact
    reason: ResolveReason


class ResolveOut(BaseModel):
    model: str
    channel: str
    version: str
    hardware: str
    artifact: ResolvedArtifact
    reason: ResolveReason
    fallbacks: list[ResolveCandidate] = Field(description="the other candidates, best first")
