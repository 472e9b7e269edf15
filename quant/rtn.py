"""Round-to-nearest quantizers: pure functions from `(name, tensor)` pairs to compressed-tensors tensors.

Scales follow compressed-tensors' own symmetric convention (`calculate_qparams`): for an int grid
[-2^(b-1), 2^(b-1) - 1] the scale is absmax / ((2^b - 1) / 2), i.e. absmax / 7.5 for int4 and
absmax / 127.5 for int8 (what llm-compressor's min-max observer and GPTQ's symmetric quantizer
use: the +absmax element clips by at most half a step, every other value gains resolution). FP8
E4M3 uses absmax / 448, its largest finite value. Scales are rounded to bf16 (the dtype the
checkpoint stores) *before* quantizing, and upwards, so decompression `q * scale` uses exactly the
scale the values were rounded against and no element lands outside the grid.

Which tensors are quantized: the weights of the Linear layers inside the decoder blocks (attention
q/k/v/o or fused qkv, MLP gate/up/down or fused gate_up, every expert's and a shared expert's:
`formats.architectures.LINEAR_WEIGHT`, built from the architecture records), and `lm_head` where the scheme
quantizes it (`Scheme.with_lm_head`; every preset keeps it). Routers, embeddings, norms and biases are passed
through in bf16.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.formats.architectures import LINEAR_WEIGHT
from kiln.formats.architectures.record import TensorKind, TensorSpec
from kiln.quant.methods.base import FLOAT_FORMATS, weight_storage
from kiln.quant.schemes import HEAD, LLMCOMPRESSOR_METHODS, Scheme, WeightQuant

if TYPE_CHECKING:
    import torch

    from kiln.formats.architectures.shape import MergedGemm


HEAD_WEIGHT = f"{HEAD}.weight"
_ROUTER_KINDS = frozenset({TensorKind.FFN_GATE_INP, TensorKind.FFN_GATE_INP_SHEXP})
# A decoder layer's attention tensors, by name (its KV-cache scales sit beside them).
_ATTENTION = re.compile(r"^model\.layers\.(\d+)\.self_attn\.")


def kv_scale_names(tensors: Iterable[str]) -> list[str]:
    """The KV-cache scale tensors of a model with these tensor names: `k_scale` and `v_scale` of every decoder
    layer's attention (where vLLM and compressed-tensors read them), in layer order."""
    layers = sorted({int(m.group(1)) for t in tensors if (m := _ATTENTION.match(t))})
    return [f"model.layers.{i}.self_attn.{kv}" for i in layers for kv in ("k_scale", "v_scale")]


class QuantShapeError(InvalidInput):
    """A layer's shape does not fit the scheme (e.g. input width not a multiple of the group size)."""

    code = Codes.QUANT_SHAPE


def router_modules(tensors: Iterable[TensorSpec]) -> list[str]:
    """The module names of a mixture's routers (`<layer>.mlp.gate`, Mixtral's `<layer>.block_sparse_moe.gate`) and
    shared-expert gates among `tensors`: [out, hidden] weights a loader builds as Linears, which stay bf16."""
    return [t.name.removesuffix(".weight") for t in tensors if t.kind in _ROUTER_KINDS and not t.bias]


def quantizes(scheme: Scheme, name: str) -> bool:
    """Whether `scheme` stores tensor `name` quantized (False for everything left in bf16): the decoder's Linear
    weights, and `lm_head.weight` where the scheme quantizes the head."""
    if scheme.weights is None:
        return False
    if name == HEAD_WEIGHT:
        return scheme.lm_head == "quantized"
    if not LINEAR_WEIGHT.match(name):
        return False
    module = name.removesuffix(".weight")
    return not any(module == ig or module.endswith("." + ig) for ig in scheme.ignore)


class HeadTied(InvalidInput):
    """`lm_head: quantized` for a model whose output projection is its embedding (`tie_word_embeddings`)."""

    code = Codes.QUANT_HEAD_TIED


def check_shapes(scheme: Scheme, shapes: Mapping[str, tuple[int, ...]], merged: Sequence[MergedGemm] = ()) -> None:
    """Refuse, before any tensor is read, a model whose quantized layers do not fit the scheme, or whose tied head
    the scheme would quantize. `merged`: the Linears the serving runtimes run as one GEMM
    (`ModelShape.merged_gemms`), whose parts but the last must fill whole blocks of rows."""
    w = scheme.weights
    if w is None:
        return
    if scheme.lm_head == "quantized" and HEAD_WEIGHT not in shapes:
        raise HeadTied(
            f"{scheme.name}: the model ties lm_head to its embedding (tie_word_embeddings), which stays bf16; "
            "keep lm_head (quantize.<quant>.lm_head: kept) for this model",
            details={"scheme": scheme.name},
        )
    for name, shape in shapes.items():
        if not quantizes(scheme, name):
            continue
        if len(shape) != 2:
            raise QuantShapeError(f"{scheme.name}: layer {name!r} has shape {list(shape)}; a Linear weight is 2-D")
        rows, cols = shape
        if w.block_structure is not None and cols % w.block_structure[1]:
            br, bc = w.block_structure
            raise QuantShapeError(
                f"{scheme.name}: layer {name!r} has {cols} input columns, not a whole number of {br}x{bc} blocks' "
                f"{bc}: vLLM quantizes its activations in groups of {bc} input columns and its block-FP8 kernels "
                "read whole column blocks (only a last block of rows may overhang, zero-padded, as DeepSeek-V3's "
                "kv_a_proj_with_mqa); use a per-channel scheme (fp8) for this model",
                details={"layer": name, "shape": list(shape), "block_structure": [br, bc]},
            )
        if w.group_size is not None and cols % w.group_size:
            raise QuantShapeError(
                f"{scheme.name}: layer {name!r} has {cols} input columns, not a multiple of the group size "
                f"{w.group_size}; use a per-channel scheme (int8, fp8) for this model",
                details={"layer": name, "shape": list(shape), "group_size": w.group_size},
            )
        if scheme.format == "pack-quantized" and (cols * w.num_bits) % 32:
            raise QuantShapeError(
                f"{scheme.name}: layer {name!r} has {cols} input columns; packing {w.num_bits}-bit values "
                f"into int32 needs a multiple of {32 // w.num_bits}",
                details={"layer": name, "shape": list(shape)},
            )
    if w.block_structure is not None:
        _check_merged_blocks(scheme, w.block_structure, merged)


def _check_merged_blocks(scheme: Scheme, block: tuple[int, int], merged: Sequence[MergedGemm]) -> None:
    """QUANT_SHAPE for a part of a merged GEMM, not its last, whose rows end in a partial block of `block`."""
    br, bc = block
    for gemm in merged:
        if not any(quantizes(scheme, f"model.layers.0.{part.replace('<e>', '0')}.weight") for part, _ in gemm.parts):
            continue
        for part, rows in gemm.parts[:-1]:
            if rows % br:
                names = ", ".join(p for p, _ in gemm.parts)
                raise QuantShapeError(
                    f"{scheme.name}: every layer's {part} has {rows} output rows, not a whole number of {br}x{bc} "
                    f"blocks' {br}: vLLM and TensorRT-LLM run {names} as one GEMM ({gemm.name}), whose block scales "
                    f"would straddle two of them (only its last, {gemm.parts[-1][0]}, may end in a partial block); "
                    "use a per-channel scheme (fp8) for this model",
                    details={"layer": part, "rows": rows, "merged": gemm.name, "block_structure": [br, bc]},
                )


def planned_tensors(scheme: Scheme, name: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, SafeTensors dtype, shape) of what `quantize_weight` yields for a weight of `shape`, in order.

    Known from the header alone, so a streaming writer can plan the file before any tensor is read.
    """
    w = scheme.weights
    assert w is not None and len(shape) == 2
    module = name.removesuffix(".weight")
    rows, cols = shape
    if w.block_structure is not None:  # a last block of rows may overhang (`check_shapes`)
        scale = (-(-rows // w.block_structure[0]), -(-cols // w.block_structure[1]))
    elif w.group_size is not None:
        scale = (rows, cols // w.group_size)
    else:
        scale = (rows, 1)
    if scheme.format == "float-quantized":
        stored = FLOAT_FORMATS[weight_storage(w)].safetensors
        return [(f"{module}.weight", stored, (rows, cols)), (f"{module}.weight_scale", "BF16", scale)]
    if scheme.format == "int-quantized":
        return [(f"{module}.weight", "I8", (rows, cols)), (f"{module}.weight_scale", "BF16", scale)]
    if scheme.format == "mxfp4-pack-quantized":  # E8M0 scales: one exponent byte each
        return [(f"{module}.weight_packed", "U8", (rows, cols // 2)), (f"{module}.weight_scale", "U8", scale)]
    if scheme.format == "nvfp4-pack-quantized":  # E4M3 block scales under float32 tensor scales
        static_input = scheme.input_activations is not None and scheme.input_activations.dynamic == "local"
        return [
            *([(f"{module}.input_global_scale", "F32", (1,))] if static_input else []),
            (f"{module}.weight_global_scale", "F32", (1,)),
            (f"{module}.weight_packed", "U8", (rows, cols // 2)),
            (f"{module}.weight_scale", "F8_E4M3", scale),
        ]
    return [
        (f"{module}.weight_packed", "I32", (rows, cols * w.num_bits // 32)),
        (f"{module}.weight_scale", "BF16", scale),
        (f"{module}.weight_shape", "I64", (2,)),
    ]


def weight_scale(weight: torch.Tensor, w: WeightQuant) -> torch.Tensor:
    """Per-channel [out, 1], per-group [out, in / group] or per-block [out / rows, in / cols] scales, rounded to
    bf16 and returned as float32."""
    import torch

    x = weight.float()
    if w.strategy == "block":
        assert w.block_structure is not None
        br, bc = w.block_structure
        # A last block of rows that overhangs the matrix is zero-padded (DeepSeek's `weight_quant_kernel`,
        # compressed-tensors' `_process_block`): its scale is the amax of the rows it has.
        pad = -x.shape[0] % br
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        absmax = x.abs().unflatten(-1, (-1, bc)).unflatten(0, (-1, br)).amax(dim=(1, 3))
    elif w.strategy == "group":
        assert w.group_size is not None
        absmax = x.abs().unflatten(-1, (-1, w.group_size)).amax(dim=-1)
    else:
        absmax = x.abs().amax(dim=-1, keepdim=True)
    fmt = FLOAT_FORMATS.get(weight_storage(w))
    qmax = fmt.max if fmt is not None else (2**w.num_bits - 1) / 2
    exact = absmax / qmax
    scale = exact.to(torch.bfloat16)
    # Round up, never down: then |w| / scale <= qmax for every element and nothing clips beyond the grid.
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    # An all-zero row or group: any positive scale stores it exactly; avoid dividing by zero.
    tiny = torch.finfo(torch.bfloat16).tiny
    return torch.where(scale == 0, torch.full_like(scale, tiny), scale).float()


def quantize_weight(
    name: str,
    weight: torch.Tensor,
    scheme: Scheme,
    scale: torch.Tensor | None = None,
    qparams: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The compressed-tensors tensors for one Linear weight `<module>.weight`, under `<module>.*` names.

    `scale` is the round-to-nearest scale by default; llm-compressor's methods (GPTQ, AWQ, FP4) pass their own,
    and FP4 its other parameters (`qparams`, local names: NVFP4's float32 tensor scales).
    """
    import torch

    from kiln.quant.compressed import compress

    module = name.removesuffix(".weight")
    assert scheme.weights is not None
    if scale is None and scheme.method in LLMCOMPRESSOR_METHODS:
        raise ValueError(f"scheme {scheme.name!r} ({scheme.method}) is quantized by llm-compressor; pass its scales")
    fp4 = scheme.weights.type == "float" and scheme.weights.num_bits == 4
    # FP4 quantizes against its scales as stored (E4M3 / E8M0), which compressed-tensors rounds to itself.
    scale = weight_scale(weight, scheme.weights) if scale is None else scale if fp4 else scale.float()
    extra = {k: v.float() for k, v in (qparams or {}).items()}
    stored = compress(scheme, weight.float() if not fp4 else weight, scale, extra)
    for key in sorted(stored):
        t = stored[key]
        if key == "weight_scale" and not fp4:
            t = t.to(torch.bfloat16)
        yield f"{module}.{key}", t.contiguous()


def dequantize(scheme: Scheme, module: str, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight compressed-tensors reconstructs from one module's stored tensors."""
    from kiln.quant.compressed import decompress

    local = {k.removeprefix(module + "."): v for k, v in stored.items() if k.startswith(module + ".")}
    return decompress(scheme, local)
