"""config.json as the runtimes read it: the family's schema, with the faults that break a load named by code.

`check_config` validates with the family's record (`ModelShape.from_config`) after looking first at what a
schema error would hide behind one message: `layer_types` of the wrong length (CONFIG_LAYER_TYPES), sliding
layers without a window (CONFIG_SLIDING_WINDOW), a rope given per layer type that misses a type the layers use
(CONFIG_ROPE: transformers' rotary embedding looks each layer's type up in it). It still returns the shape
where it can (without the faulty key), so the tensors are checked too. `compare_shapes` says where an
artifact's model differs from the one it was made from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from kiln.core.errors import KilnError
from kiln.formats.architectures import get_architecture
from kiln.formats.architectures.record import LAYER_TYPES
from kiln.formats.architectures.shape import ModelShape
from kiln.targets.lint.findings import Finding, finding

ROPE_KEYS: Final = ("rope_parameters", "rope_scaling")
# A ModelShape field -> the code of a disagreement about it.
FIELD_CODES: Final = {
    "layer_types": "CONFIG_LAYER_TYPES",
    "sliding_window": "CONFIG_SLIDING_WINDOW",
    "rope": "CONFIG_ROPE",
    "rope_theta": "CONFIG_ROPE",
    "rotary_fraction": "CONFIG_ROPE",
    "moe": "CONFIG_EXPERTS",
}


def check_config(config: Any, file: str = "config.json") -> tuple[ModelShape | None, list[Finding]]:
    """The model `config` describes (None where it cannot be read), and what is wrong with it."""
    if not isinstance(config, dict):
        return None, [finding("JSON_INVALID", file, "must be a JSON object", file)]
    try:
        get_architecture(config.get("architectures"))
    except KilnError as e:
        return None, [finding("CONFIG_INVALID", "architectures", e.message, file)]
    out: list[Finding] = []
    readable = dict(config)
    layers = config.get("num_hidden_layers")
    kinds = config.get("layer_types")
    if kinds is not None:
        bad = not isinstance(kinds, list) or any(k not in LAYER_TYPES for k in kinds)
        if bad:
            out.append(finding("CONFIG_LAYER_TYPES", "layer_types", f"each entry must be one of {LAYER_TYPES}", file))
            readable.pop("layer_types")
        elif type(layers) is int and len(kinds) != layers:
            out.append(
                finding(
                    "CONFIG_LAYER_TYPES",
                    "layer_types",
                    f"{len(kinds)} entries for num_hidden_layers={layers}: transformers and vLLM index it per layer",
                    file,
                )
            )
            readable.pop("layer_types")
    try:
        shape = ModelShape.from_config(readable)
    except KilnError as e:
        field = str(e.details.get("field", "config"))
        top = field.split(".")[0]
        code = "CONFIG_SLIDING_WINDOW" if top == "sliding_window" else "CONFIG_ROPE" if top in ROPE_KEYS else None
        return None, [*out, finding(code or "CONFIG_INVALID", field, e.message.removeprefix("config.json: "), file)]
    used = set(shape.layer_types) or {"full_attention"}
    for key in ROPE_KEYS:
        rope = config.get(key)
        per_type = {k for k in rope if k in LAYER_TYPES} if isinstance(rope, dict) else set()
        missing = sorted(used - per_type) if per_type else []
        if missing:
            out.append(
                finding(
                    "CONFIG_ROPE",
                    key,
                    f"gives a rope per layer type but none for {', '.join(missing)}, which the layers use",
                    file,
                )
            )
    return shape, out


def compare_shapes(artifact: ModelShape, source: ModelShape, file: str) -> list[Finding]:
    """One finding per field of the model that the artifact states differently from its source.

    `source_quant`, a release's own quantized layout (FP8 block, MXFP4), is compared only where the artifact
    declares one: an artifact of a pre-quantized source holds its tensors dequantized or in compressed-tensors'
    layout (which its `quantization_config` says, and the layout's lint checks), so it declares none; one that
    does keep the release's layout must keep it as the source declares it."""
    out = []
    for f in dataclasses.fields(ModelShape):
        mine, theirs = getattr(artifact, f.name), getattr(source, f.name)
        if f.name == "source_quant" and mine is None:
            continue
        if mine != theirs:
            out.append(
                finding(
                    FIELD_CODES.get(f.name, "CONFIG_MISMATCH"),
                    f.name,
                    f"the artifact says {_short(mine)}, the source model {_short(theirs)}",
                    file,
                )
            )
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
