"""Hardware profiles as data: what each pool is, and the facts that decide what it can load.

Sources: NVIDIA compute capabilities (sm80 A100, sm89 L40S, sm90 H100/H200, sm100 B200);
AMD CDNA3 gfx942 (MI300X/MI325X) and CDNA4 gfx950 (MI350X/MI355X); vendor memory and
bandwidth data sheets. Bandwidth is used for the decode-speed bound in resolve.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import UnknownName


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    vendor: str  # nvidia | amd | google | cpu | apple
    arch: str  # sm90, gfx942, tpu-v5e, x86_64, ...
    memory_gib: float
    bandwidth_gbs: float
    family: str  # cuda | rocm | tpu | cpu | metal
    compute_capability: int | None = None  # NVIDIA only, e.g. 90


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        HardwareProfile("cpu", "cpu", "x86_64", 64, 50, "cpu"),
        HardwareProfile("apple-m2", "apple", "arm64", 24, 100, "metal"),
        HardwareProfile("edge", "cpu", "arm64", 8, 25, "cpu"),
        HardwareProfile("a100", "nvidia", "sm80", 80, 2039, "cuda", 80),
        HardwareProfile("l40s", "nvidia", "sm89", 48, 864, "cuda", 89),
        HardwareProfile("h100", "nvidia", "sm90", 80, 3350, "cuda", 90),
        HardwareProfile("h200", "nvidia", "sm90", 141, 4800, "cuda", 90),
        HardwareProfile("b200", "nvidia", "sm100", 180, 8000, "cuda", 100),
        HardwareProfile("mi300x", "amd", "gfx942", 192, 5300, "rocm"),
        HardwareProfile("mi325x", "amd", "gfx942", 256, 6000, "rocm"),
        HardwareProfile("mi355x", "amd", "gfx950", 288, 8000, "rocm"),
        HardwareProfile("tpu-v5e", "google", "tpu-v5e", 16, 819, "tpu"),
        HardwareProfile("tpu-v5p", "google", "tpu-v5p", 95, 2765, "tpu"),
    ]
}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownName(
            f"unknown hardware {name!r}; known: {', '.join(sorted(PROFILES))}",
            details={"known": sorted(PROFILES)},
        ) from None
