"""The weight footprint of a scheme's checkpoint, from a model config alone (no weights read).

What hf-bundle writes for a scheme (and rocm-bundle and trtllm's compressed-tensors FP8 with it):
every tensor config.json implies (`formats.architectures.shape.ModelShape.expected_tensors`, in the source's
order), the Linear weights the scheme quantizes as `quant.rtn.planned_tensors` lays them out
(FP8 or int8 values, int4 packed eight to an int32 with its `weight_shape`, bf16 scales per channel,
group or block): every expert's projections one by one, as the checkpoint names them, and fused projections
(Phi-3's qkv_proj, gate_up_proj) as one Linear each; everything else (embeddings, norms, routers, biases,
`lm_head` unless the recipe quantizes it) in bf16. GPTQ and AWQ store the same layout as round-to-nearest;
AWQ's smoothed norms (and a mixture's routers, which read the smoothed norm's output) replace the source's in
bf16, same size. The SafeTensors files hold exactly these bytes plus their headers (8 bytes + JSON each).
A release-only method (mxfp4-experts) is the release's own layout: its tensors as the release stores them
(`ModelShape.stored_tensors`), and a config that is no such release is refused (`quant.catalog.check_source`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from kiln.formats.architectures.shape import ModelShape
from kiln.formats.safetensors import DTYPES
from kiln.quant.catalog import METHODS, check_source, get_scheme
from kiln.quant.rtn import check_shapes, kv_scale_names, planned_tensors, quantizes
from kiln.quant.schemes import HeadChoice


def checkpoint_tensors(
    config: Mapping[str, Any], quant: str, lm_head: HeadChoice = "kept"
) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, SafeTensors dtype, shape) of every tensor of `quant`'s checkpoint for `config`, in file order, its
    `lm_head` kept in bf16 or quantized.

    A config kiln would refuse is refused here the same way (`SourceInvalid`), as is a model whose
    layers do not fit the scheme (`QUANT_SHAPE`) or whose tied head it would quantize (`QUANT_HEAD_TIED`); an
    unknown scheme lists the known ones."""
    scheme = get_scheme(quant, lm_head)
    model = ModelShape.from_config(dict(config))
    if METHODS[quant].release_only:  # the release's own layout: its tensors as it stores them
        check_source(METHODS[quant], model.source_quant)
        for t in model.stored_tensors():
            yield t.name, t.dtype or "BF16", t.shape
        return
    expected = model.expected_tensors()
    check_shapes(scheme, expected)
    for name, shape in expected.items():
        if quantizes(scheme, name):
            yield from planned_tensors(scheme, name, shape)
        else:
            yield name, "BF16", shape
    if scheme.kv_cache is not None:  # an FP8 KV cache's per-layer K and V scales, after everything else
        for name in kv_scale_names(expected):
            yield name, "F32", (1,)


def checkpoint_bytes(config: Mapping[str, Any], quant: str, lm_head: HeadChoice = "kept") -> int:
    """The tensor bytes of `quant`'s checkpoint for `config` (the SafeTensors files less their headers)."""
    tensors = checkpoint_tensors(config, quant, lm_head)
    return sum(DTYPES[dtype].itemsize * math.prod(shape) for _, dtype, shape in tensors)


def quantized_bytes(config: Mapping[str, Any], quant: str, lm_head: HeadChoice = "kept") -> int:
    """The bytes of the Linears `quant` quantizes, as its quantize stage stores them (the rest of the checkpoint
    is the source's, copied by the export)."""
    scheme = get_scheme(quant, lm_head)
    if METHODS[quant].release_only:  # kept by the export from the release: no quantize stage stores anything
        return 0
    expected = ModelShape.from_config(dict(config)).expected_tensors()
    check_shapes(scheme, expected)
    return sum(
        DTYPES[dtype].itemsize * math.prod(shape)
        for name, full in expected.items()
        if quantizes(scheme, name)
        for _, dtype, shape in planned_tensors(scheme, name, full)
    )
