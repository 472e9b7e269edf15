"""What every rendered object says about where it came from: the registry, the sizing, and for each release
the artifact resolve chose for the pool (target, format, quant, manifest digest), its TP and runtime, and
resolve's reason, so an operator reading the object sees why it is what it is."""

from __future__ import annotations

from kiln.routing.names import LABEL_PREFIX, label_value
from kiln.routing.records import ChannelRouting, Placement, PoolRouting


def per_release_key(what: str, version: str) -> str:
    """`kiln.dev/<what>.<version>`, the version made a legal key name where it is not one (a '+')."""
    return f"{LABEL_PREFIX}/{label_value(f'{what}.{version}')}"


def artifact_of(p: Placement) -> str:
    """The placed artifact's name, target, format and quant, as the annotations write it."""
    a = p.artifact
    return f"{a.name} ({a.target}, {a.format}, {a.quant})"


def summary(p: Placement) -> str:
    return f"{artifact_of(p)}, TP {p.tp}, {p.runtime}, manifest {p.manifest_digest}"


def origin(routing: ChannelRouting) -> dict[str, str]:
    return {f"{LABEL_PREFIX}/registry": routing.registry, f"{LABEL_PREFIX}/sizing": routing.sizing.describe()}


def pool_annotations(routing: ChannelRouting, pool: PoolRouting) -> dict[str, str]:
    """For an object that serves every release of the pool: each release's placement and resolve's reason."""
    out = origin(routing)
    for p in pool.placements:
        out[per_release_key("release", p.version)] = summary(p)
        out[per_release_key("why", p.version)] = p.explanation
    return out


def placement_annotations(routing: ChannelRouting, p: Placement) -> dict[str, str]:
    """For an object that serves one release: its placement, field by field, and resolve's reason."""
    return {
        **origin(routing),
        f"{LABEL_PREFIX}/release": p.version,
        f"{LABEL_PREFIX}/artifact": artifact_of(p),
        f"{LABEL_PREFIX}/manifest-digest": p.manifest_digest,
        f"{LABEL_PREFIX}/tp": str(p.tp),
        f"{LABEL_PREFIX}/runtime": p.runtime,
        f"{LABEL_PREFIX}/why": p.explanation,
    }
