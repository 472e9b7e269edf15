"""What a caller asks resolve: hardware pools in its order of preference, a policy, a workload and an SLO."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.core.hardware import HARDWARE_NAME_PATTERN
from kiln.core.resolve import Policy

POLICIES: tuple[Policy, ...] = ("latency", "cost", "quality")
MAX_POOLS = 16


@dataclass(frozen=True)
class Pool:
    """A pool of one SKU a router can place a replica in; `free_devices` None: not limited."""

    hardware: str
    free_devices: int | None = None


@dataclass(frozen=True)
class ResolveQuery:
    """What the caller asks: pools (in its order of preference), policy, workload and SLO.

    `hardware` is the pools as the caller wrote them (`h100,mi300x:16`): the query is then a few strings and
    numbers, cheap to hash (the key of resolve's cached answers), and its pools are parsed on first use."""

    hardware: str
    policy: Policy = "latency"
    context: int = 4096
    concurrency: int = 1
    kv_dtype: str = "bf16"
    min_tokens_per_s: float | None = None  # per sequence
    max_ttft_ms: float | None = None

    def __post_init__(self) -> None:
        # Hashed once: the answer cache hashes its key on every lookup (and again to mark it recent).
        fields = (self.hardware, self.policy, self.context, self.concurrency, self.kv_dtype)
        object.__setattr__(self, "_hash", hash((*fields, self.min_tokens_per_s, self.max_ttft_ms)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined,no-any-return]

    @functools.cached_property
    def pools(self) -> tuple[Pool, ...]:
        return parse_pools(self.hardware)


def parse_pools(text: str) -> tuple[Pool, ...]:
    """`h100,mi300x:16,tpu-v5e`: pools by SKU name, each optionally with its free devices."""
    pools: list[Pool] = []
    for item in text.split(","):
        name, sep, free = item.strip().partition(":")
        if not _HARDWARE_NAME.fullmatch(name):
            raise InvalidInput(
                f"hardware {item.strip()[:40]!r}: expected an SKU name, optionally with its free devices "
                "(h100 or h100:4), comma-separated",
                code=Codes.RESOLVE_POOLS_INVALID,
            )
        free_devices: int | None = None
        if sep:
            if not (free.isascii() and free.isdigit() and len(free) <= 7):
                raise InvalidInput(
                    f"hardware {item.strip()[:40]!r}: free devices must be a whole number (0 to 9999999)",
                    code=Codes.RESOLVE_POOLS_INVALID,
                )
            free_devices = int(free)
        if any(p.hardware == name for p in pools):
            raise InvalidInput(f"hardware {name!r} is listed twice", code=Codes.RESOLVE_POOLS_INVALID)
        pools.append(Pool(name, free_devices))
    if len(pools) > MAX_POOLS:
        raise InvalidInput(f"at most {MAX_POOLS} hardware pools per query", code=Codes.RESOLVE_POOLS_INVALID)
    return tuple(pools)


_HARDWARE_NAME = re.compile(HARDWARE_NAME_PATTERN)
