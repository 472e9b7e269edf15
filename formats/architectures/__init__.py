"""The architectures kiln builds, one record per family (`record.Architecture`), by config.json's class name.

The family modules are a fixed list here, never imported from a user-supplied string; each defines one
`RECORD`, and a class name registered twice fails at import. Adding a family is one module in this package,
its name in `FAMILY_MODULES`, and its tests (docs/extending.md).
"""

from __future__ import annotations

import re
from typing import Final

from kiln.core.errors import SourceInvalid
from kiln.core.untrusted import short_repr
from kiln.formats.architectures import (
    deepseek_v3,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from kiln.formats.architectures.record import Architecture

FAMILY_MODULES: Final = (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, gemma3, phi3, deepseek_v3, gpt_oss)


def _registry() -> dict[str, Architecture]:
    out: dict[str, Architecture] = {}
    families: set[str] = set()
    for module in FAMILY_MODULES:
        record: Architecture = module.RECORD
        if record.hf_class in out or record.family in families:
            raise RuntimeError(f"architecture {record.hf_class} ({record.family}) is registered twice")
        out[record.hf_class] = record
        families.add(record.family)
    return out


ARCHITECTURES: Final[dict[str, Architecture]] = _registry()
FAMILIES: Final[dict[str, Architecture]] = {a.family: a for a in ARCHITECTURES.values()}


def get_architecture(architectures: object) -> Architecture:
    """The record of config.json's `architectures` (a list of one class name); SOURCE_INVALID naming the
    supported classes for anything else."""
    if (
        not isinstance(architectures, list)
        or len(architectures) != 1
        or not isinstance(architectures[0], str)
        or architectures[0] not in ARCHITECTURES
    ):
        raise SourceInvalid(
            f"config.json: architectures={short_repr(architectures)} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}",
            details={"file": "config.json", "field": "architectures", "supported": list(ARCHITECTURES)},
        )
    return ARCHITECTURES[architectures[0]]


def get_family(family: str) -> Architecture:
    """The record of kiln's family name (`qwen3_moe`)."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise SourceInvalid(
            f"unknown architecture family {family[:64]!r}; known: {', '.join(FAMILIES)}",
            details={"family": family[:64], "known": list(FAMILIES)},
        ) from None


def _linear_weight_pattern() -> re.Pattern[str]:
    """Every family's decoder-layer Linear weights (what a scheme may quantize), built from the records' names:
    attention q/k/v/o (or fused qkv; MLA's latent projections), the MLP's projections (or fused gate_up), every
    expert's and a shared expert's. Routers, norms, embeddings, the head and experts stacked in one 3-D tensor
    never match."""
    names: set[str] = set()
    for a in ARCHITECTURES.values():
        attn = re.escape(a.attention.prefix)
        names.add(f"{attn}\\.({'|'.join(re.escape(p) for p in a.attention.linears())})")
        mlp, proj = re.escape(a.mlp.prefix), a.mlp.projections
        gated = "|".join(re.escape(p) for p in (proj.gate, proj.up, proj.down, "gate_up_proj"))
        names.add(f"{mlp}\\.({gated})")
        if a.mlp.experts is not None and a.mlp.experts.layout == "per_expert":
            x = a.mlp.experts
            block, ep = re.escape(x.block), x.projections
            routed = "|".join(re.escape(p) for p in (ep.gate, ep.up, ep.down))
            names.add(f"{block}\\.{re.escape(x.experts)}\\.\\d+\\.({routed})")
            if x.shared is not None:
                names.add(f"{block}\\.{re.escape(x.shared)}\\.(gate_proj|up_proj|down_proj)")
    return re.compile(r"^model\.layers\.\d+\.(" + "|".join(sorted(names)) + r")\.weight$")


# The Linear weights of every family's decoder layers, by tensor name (`quant.rtn.quantizes` reads it).
LINEAR_WEIGHT: Final = _linear_weight_pattern()
