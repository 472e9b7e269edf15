"""What a routing render is made of: for each hardware pool, each release of the channel placed as resolve
answered for it (the artifact, its replica's tensor-parallel degree, the runtime that serves it).

`kiln.routing.gather` reads these from a registry through the client; the renderers (`gateway_api`,
`kserve`) are pure functions of them and of `RenderOptions`, so the same records always render the same YAML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.core.hardware import Family
from kiln.core.manifest import ArtifactIdentity
from kiln.core.resolve import Policy
from kiln.registry.channels.buckets import BASIS_POINTS


class Placement(BaseModel):
    """One release of the channel on one pool: what resolve chose for it there, and its share of the traffic."""

    model_config = ConfigDict(frozen=True)

    version: str
    weight: int = Field(ge=1, le=BASIS_POINTS, description="basis points of the channel's traffic (10,000: all)")
    artifact: ArtifactIdentity
    manifest_digest: str
    tp: int = Field(ge=1, description="devices per replica (resolve's reason.tp)")
    runtime: str = Field(description="the serving runtime's name (kiln.routing.runtimes.RUNTIMES)")
    explanation: str = Field(description="resolve's reason for this artifact on this pool")

    @property
    def percent(self) -> float:
        return self.weight * 100 / BASIS_POINTS


class PoolRouting(BaseModel):
    """A hardware pool and the placement of each release of the channel on it, in the split's order."""

    model_config = ConfigDict(frozen=True)

    hardware: str
    family: Family
    free_devices: int | None
    placements: tuple[Placement, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _whole_channel(self) -> PoolRouting:
        if sum(p.weight for p in self.placements) != BASIS_POINTS:
            raise ValueError("the placements' weights are the channel's whole traffic: 10,000 basis points")
        if len({p.version for p in self.placements}) != len(self.placements):
            raise ValueError("each release is placed once per pool")
        return self


class Sizing(BaseModel):
    """The workload each replica is sized for: resolve's query, the same for every pool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    context: int = Field(default=4096, ge=1)
    concurrency: int = Field(default=1, ge=1)
    policy: Policy = "latency"
    kv_cache_dtype: Literal["bf16", "fp8"] = "bf16"

    @classmethod
    def of(cls, **values: object) -> Sizing:
        """The sizing `values` name; a bad one is ROUTING_OPTION_INVALID naming it."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise InvalidInput(
                f"{field.replace('_', '-')}: {first['msg']}",
                code=Codes.ROUTING_OPTION_INVALID,
                details={"option": field},
            ) from None

    def describe(self) -> str:
        return (
            f"context {self.context} × concurrency {self.concurrency}, policy {self.policy}, "
            f"KV cache {self.kv_cache_dtype}"
        )


class ChannelRouting(BaseModel):
    """A channel of a model placed on every pool: what a router's objects are rendered from."""

    model_config = ConfigDict(frozen=True)

    model: str
    channel: str
    registry: str = Field(description="the registry's public URL, as its answers name it (scheme://host[:port])")
    sizing: Sizing
    pools: tuple[PoolRouting, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_split(self) -> ChannelRouting:
        splits = {tuple((p.version, p.weight) for p in pool.placements) for pool in self.pools}
        if len(splits) != 1:
            raise ValueError("every pool places the same releases with the same weights (one split)")
        return self

    @property
    def split(self) -> tuple[tuple[str, int], ...]:
        """(version, basis points) of each release of the channel, in the split's order."""
        return tuple((p.version, p.weight) for p in self.pools[0].placements)


_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1123 label, as Kubernetes requires
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class RenderOptions:
    """How the objects are named and wired, beyond what the registry answered. Bad values are refused
    (ROUTING_OPTION_INVALID), never corrected."""

    namespace: str = "default"
    target_port: int = 8000  # the model servers' port (vLLM's and trtllm-serve's default)
    endpoint_picker: str | None = None  # the endpoint picker's Service; default "<pool>-epp"
    endpoint_picker_port: int = 9002  # the endpoint picker's ext-proc gRPC port (its default)
    priority: int | None = None  # an InferenceObjective's priority per pool; None: no objectives
    oci_host: str | None = None  # the registry as the cluster pulls from it; default the registry's own host

    def __post_init__(self) -> None:
        if not _NAMESPACE.fullmatch(self.namespace):
            _invalid("namespace", self.namespace, "a DNS-1123 label: lower-case letters, digits and '-', 1 to 63")
        for name in ("target_port", "endpoint_picker_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                _invalid(name, port, "a port number from 1 to 65535")
        if self.endpoint_picker is not None and not _NAMESPACE.fullmatch(self.endpoint_picker):
            _invalid("endpoint_picker", self.endpoint_picker, "a Service name (a DNS-1123 label)")
        if self.priority is not None and not -INT32_MAX - 1 <= self.priority <= INT32_MAX:
            _invalid("priority", self.priority, "a 32-bit integer")
        if self.oci_host is not None and not re.fullmatch(r"[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?", self.oci_host):
            _invalid("oci_host", self.oci_host, "host or host:port")


def _invalid(field: str, value: object, expected: str) -> NoReturn:
    raise InvalidInput(
        f"{field.replace('_', '-')} {str(value)[:80]!r}: expected {expected}",
        code=Codes.ROUTING_OPTION_INVALID,
        details={"option": field, "value": str(value)[:200]},
    )
