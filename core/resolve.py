"""Resolve's answer as it crosses the wire: the artifact a pool should load, why, and the fallbacks.

The registry's `GET /v1/resolve` renders a `ResolveOut` (`registry.resolve.routes`), and the client
reads the answer back into the same record (`client.RegistryClient.resolve`), which the CLI prints.
They live here, in the ground layer, because the registry and the client both speak them; how the
candidates are sized and ranked stays in `registry.resolve`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.evals import EvalStatus
from kiln.core.hardware import MatmulDtype
from kiln.core.manifest import ArtifactIdentity, FileOut

Policy = Literal["latency", "cost", "quality"]


class ResolvedArtifact(ArtifactIdentity):
    """An artifact of the release (what it is, the digest of its manifest), with where to download each of its
    files."""

    model_config = ConfigDict(extra="ignore")  # what a newer registry adds, a client reads past

    manifest_digest: str
    files: list[FileOut]


class MeasurementOut(BaseModel):
    """A performance record as resolve reads it (its release views hold these) and used it in an answer."""

    model_config = ConfigDict(frozen=True)

    id: int
    hardware: str
    runtime: str
    runtime_version: str
    tp: int
    context: int
    concurrency: int
    tokens_per_s: float
    ttft_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    recorded_at: str


class BoundBasis(BaseModel):
    """What a replica's bounds rest on: the catalog's data-sheet peaks alone ("spec"), or scaled by the shares
    of them measured on that SKU (its catalog entry's `measured` record)."""

    model_config = ConfigDict(frozen=True)

    decode: Literal["measured", "spec"] = Field(
        description="the decode bound's limiting term (memory reads, or matmuls when FLOP-bound) used a measured share"
    )
    prefill: Literal["measured", "spec"] = Field(
        description="the prefill (TTFT) bound used a measured share of the matmul rate"
    )
    memory: Literal["measured", "spec"] = Field(
        description="usable memory is a share of the measured allocatable memory, not of the data sheet's"
    )
    bandwidth_fraction: float = Field(description="share of the data-sheet bandwidth the weights are read at (1: spec)")
    bandwidth_path: Literal["decode", "memory_read", "spec"] = Field(
        description="where bandwidth_fraction comes from: a decode-like chain measured for the weights' matmul "
        "type, the plain memory read (no decode measured for that type), or the data sheet"
    )
    kv_bandwidth_fraction: float = Field(
        description="share of the data-sheet bandwidth the KV cache is read at: the measured memory read, or 1"
    )
    matmul_fraction: float = Field(
        description="share of the data-sheet TFLOP/s of matmul_dtype that prefill and FLOP-bound decode run at"
    )
    matmul_dtype: MatmulDtype = Field(description="the type the replica's matmuls run in on this hardware")
    allocatable_bytes: int | None = Field(description="measured memory one process can allocate, where measured")
    source: str | None = Field(description="where and when the measured shares were measured; None: all spec")


class ResolveReason(BaseModel):
    """Why a candidate placed where it did: its replica's memory plan, its speed, its SLO and its eval."""

    model_config = ConfigDict(frozen=True)

    fits: bool = Field(description="the replica fits in its devices' memory and in the pool's free devices")
    tp: int = Field(description="devices per replica (tensor-parallel degree): the smallest that fits")
    weights_bytes: int
    kv_cache_bytes: int = Field(
        description="the replica's: 2 (K,V) × layers × kv_heads × head_dim × context × concurrency × KV bytes"
    )
    memory_bytes: int = Field(description="memory of one device")
    usable_bytes: int = Field(
        description="90 % of it (of the measured allocatable memory where smaller): the rest is kept for "
        "activations and the runtime"
    )
    required_bytes: int = Field(description="weights + KV cache per device (KV heads replicated where TP > KV heads)")
    kv_room_bytes: int = Field(description="usable memory per device left for the KV cache after the weights")
    decode_tokens_per_s_bound: float = Field(
        description="replica decode bound: concurrency × bandwidth × measured share × TP efficiency / bytes read "
        "per device per step (or the matmuls' time, when longer)"
    )
    prefill_tokens_per_s_bound: float | None = Field(description="context / time-to-first-token bound")
    tokens_per_s: float = Field(description="replica output tokens/s the answer is ranked by (measured or bound)")
    tokens_per_s_per_sequence: float
    ttft_ms: float | None
    cost_per_mtok: float | None = Field(description="USD per million output tokens (catalog price), None without")
    speed_source: Literal["measured", "estimate"]
    measured: MeasurementOut | None = Field(description="the performance record used, where one applies")
    meets_slo: bool
    eval_status: EvalStatus
    kl: float | None
    basis: BoundBasis = Field(description="which of the bounds rest on measured shares of the peaks, and which on spec")
    explanation: str


class ResolveCandidate(BaseModel):
    """One artifact on one pool, as ranked: the answer's own choice or a fallback."""

    model_config = ConfigDict(frozen=True)

    hardware: str
    artifact: ResolvedArtifact
    reason: ResolveReason


class SplitMember(BaseModel):
    """One release of a channel's weighted split."""

    model_config = ConfigDict(frozen=True)

    version: str
    weight: float = Field(description="percent of the channel's traffic")
    chosen: bool = Field(description="the release this answer is for")


class ResolveOut(BaseModel):
    """Resolve's answer: the best candidate under the policy, why it won, and the others best first."""

    model_config = ConfigDict(frozen=True)

    model: str
    channel: str
    version: str = Field(description="the release this answer is for (of a split: the caller key's, else the largest)")
    hardware: str = Field(description="the pool the artifact is for")
    policy: Policy
    artifact: ResolvedArtifact
    reason: ResolveReason
    explanation: str = Field(description="why this candidate won under the policy")
    fallbacks: list[ResolveCandidate] = Field(description="the other candidates, across pools, best first")
    split: list[SplitMember] | None = Field(description="the channel's weighted split (canary), if it has one")
