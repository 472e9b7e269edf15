"""An artifact's weight bytes, from the model's shape alone: a GGUF file's tensors for llama.cpp, a scheme's
checkpoint (`quant.footprint`) for the HF-format targets, else the source's.

A source may be released quantized (config.json's `quantization_config`): its bytes are its tensors as it stores
them (`ModelShape.stored_tensors`), FP8 E4M3 weights with a float32 scale per 128 x 128 block (DeepSeek-V3, 690 GB
with its multi-token-prediction layer), MXFP4 experts at 17 bytes per 32 weights (gpt-oss-120b, 65 GB), not the
config's dtype for every weight. An artifact in the scheme the source is stored in (DeepSeek-V3's fp8-block) is the
source's tensors as they are, less the layers kiln builds nothing from.

A file llama.cpp's own quantizer writes (`llama_ftype`: Q4_K_M, Q6_K) takes llama.cpp's per-tensor mix, as
`llama_tensor_get_type` in llama.cpp's src/llama-quant.cpp chooses it (`llama_tensor_types`). For Llama-3-70B's
Q4_K_M that is 42.5 GB, not the 40.0 GB every weight at Q4_K would take: the output tensor at Q6_K, half the
layers' ffn_down (`use_more_bits`) at Q6_K, attn_v at Q6_K or Q5_K.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any, Final

from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError
from kiln.formats.architectures.record import TensorKind, TensorSpec
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.gguf.constants import QUANTS as GGUF_QUANTS
from kiln.formats.gguf.constants import TYPE_TRAITS, FileType, TensorType, tensor_nbytes
from kiln.formats.gguf.layout import kiln_type, pieces, stored_mxfp4, unquantized
from kiln.formats.prequantized import FP8_BLOCK
from kiln.formats.safetensors import DTYPES
from kiln.quant.catalog import SCHEMES
from kiln.quant.footprint import checkpoint_bytes

# The type most of a llama.cpp-quantized file's 2-D weights get, by its file type (`llama_ftype_get_default_type`).
LLAMA_FTYPE_TYPES: Final[dict[FileType, TensorType]] = {
    FileType.MOSTLY_Q4_K_M: TensorType.Q4_K,
    FileType.MOSTLY_Q6_K: TensorType.Q6_K,
}
# llama.cpp's fallback for a row that does not fill whole blocks of the chosen type (`tensor_type_fallback`);
# F16 where the fallback's blocks do not fit either.
LLAMA_FALLBACK: Final[dict[TensorType, TensorType]] = {
    TensorType.Q4_K: TensorType.Q5_0,
    TensorType.Q5_K: TensorType.Q5_1,
    TensorType.Q6_K: TensorType.Q8_0,
}
# The types whose weights llama.cpp's CPU backend repacks at load into interleaved copies for its AVX2 / AVX-512
# kernels (ggml-cpu's "extra" buffer type, `ggml_repack_get_optimal_repack_type`): those tensors are then held
# twice, the mapped file's pages and the repacked copy in anonymous memory. Measured at Llama-3-8B's shape
# (bench/results/scale.jsonl, 2026-11-26 and 2026-11-27, 128-token windows): a Q4_K_M eval's anonymous memory rose
# 3.7-3.9 GiB over its start for a 4.9 GB file (3.4 GiB of it Q4_K), MXFP4's 4.2 GiB for 4.6 GB (3.7 GiB MXFP4);
# Q8_0's and F16's 0.7 GiB, the window-by-window comparison and llama.cpp's buffers (not repacked).
CPU_REPACKED: Final = frozenset({TensorType.Q4_0, TensorType.Q4_K, TensorType.MXFP4})


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in its K-quant mixes: the first and last eighth, and
    every third layer between them."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _llama_type(shape: ModelShape, t: TensorSpec, ftype: FileType, output: TensorKind) -> TensorType:
    """The type llama.cpp's quantizer gives a 2-D weight `t` in a file of `ftype` (`llama_tensor_get_type_impl`, for
    the families kiln writes: not Falcon), before the fallback for rows that do not fill its blocks."""
    default = LLAMA_FTYPE_TYPES[ftype]
    layers = shape.num_layers
    experts = shape.moe.experts if shape.moe is not None else 1
    # llama.cpp's LLM_TYPE_70B (Llama-2/3-70B, Qwen2-72B: 80 layers with grouped KV heads): attn_v gets Q5_K over Q4_K.
    is_70b = layers == 80 and shape.num_kv_heads < shape.num_heads
    if t.kind == output:
        return TensorType.Q6_K if t.shape[-1] % TYPE_TRAITS[default].block_size == 0 else TensorType.Q8_0
    if t.kind in (TensorKind.ATTN_V, TensorKind.ATTN_QKV):
        ttype = default
        if ftype == FileType.MOSTLY_Q4_K_M and use_more_bits(t.layer or 0, layers):
            ttype = TensorType.Q6_K
        if is_70b and ttype == TensorType.Q4_K:
            ttype = TensorType.Q5_K
        return TensorType.Q8_0 if experts == 8 else ttype
    if t.kind == TensorKind.ATTN_K and experts == 8:
        return TensorType.Q8_0
    if t.kind in (TensorKind.FFN_DOWN, TensorKind.FFN_DOWN_EXPS, TensorKind.FFN_DOWN_SHEXP):
        more = ftype == FileType.MOSTLY_Q4_K_M and use_more_bits(t.layer or 0, layers)
        return TensorType.Q6_K if more else default
    if t.kind == TensorKind.ATTN_OUTPUT and experts == 8 and ftype == FileType.MOSTLY_Q4_K_M:
        return TensorType.Q5_K
    return default


def gguf_tensor_types(shape: ModelShape, quant: str) -> Iterator[tuple[TensorSpec, TensorType]]:
    """Each tensor of a GGUF file for `quant` and its type, as GGUF tensors (`formats.gguf.layout.pieces`: MLA's
    kv_b and gpt-oss's gate_up split in two, shapes in GGUF's orientation; a layer's experts, stored one by one,
    one spec each): norms, biases and routers F32; a release's MXFP4 experts MXFP4; other weights the quant's type
    (the output tensor its output type), F16 where a row does not fill whole blocks; a file llama.cpp quantizes,
    llama.cpp's mix and its fallbacks."""
    spec = GGUF_QUANTS[quant]
    output = TensorKind.TOKEN_EMBD if shape.tie_word_embeddings else TensorKind.OUTPUT
    mxfp4 = stored_mxfp4(shape)
    for source in shape.tensors():
        for piece in pieces(shape, source):
            t = replace(source, shape=piece.shape, kind=piece.kind)
            kept = source.name in mxfp4
            if spec.llama_ftype is not None and not kept:
                if unquantized(t.kind, t.shape, bias=t.bias):
                    yield t, TensorType.F32
                    continue
                ttype = _llama_type(shape, t, spec.llama_ftype, output)
                for fallback in (LLAMA_FALLBACK.get(ttype), TensorType.F16):
                    if t.shape[-1] % TYPE_TRAITS[ttype].block_size == 0 or fallback is None:
                        break
                    ttype = fallback
                yield t, ttype
                continue
            ttype = kiln_type(t.kind, t.shape, spec, tied=shape.tie_word_embeddings, mxfp4=kept, bias=t.bias)
            yield t, ttype if t.shape[-1] % TYPE_TRAITS[ttype].block_size == 0 else spec.fallback_type


def gguf_bytes(shape: ModelShape, quant: str) -> int:
    """A GGUF file's tensor bytes for `quant` (`gguf_tensor_types`). Experts stacked into one tensor take the bytes of
    their parts."""
    return sum(tensor_nbytes(t.shape, ttype) for t, ttype in gguf_tensor_types(shape, quant))


def gguf_repacked_bytes(shape: ModelShape, quant: str) -> int:
    """The bytes of a GGUF file for `quant` that llama.cpp's CPU backend holds a second time, repacked
    (`CPU_REPACKED`)."""
    return sum(tensor_nbytes(t.shape, ttype) for t, ttype in gguf_tensor_types(shape, quant) if ttype in CPU_REPACKED)


def artifact_bytes(shape: ModelShape, config: Mapping[str, Any], weight_bytes: int, quant: str, runtime: str) -> int:
    """The artifact's weights: a GGUF file's tensors for llama.cpp, else the scheme's checkpoint
    (`quant.footprint`); the source's bytes (`weight_bytes` per element) where the quant is neither or the
    shape does not fit it."""
    if runtime == "llama.cpp" and quant in GGUF_QUANTS:
        return gguf_bytes(shape, quant)
    if keeps_source(shape, quant):
        return source_bytes(shape, weight_bytes, extras=False)
    if quant in SCHEMES:
        try:
            return checkpoint_bytes(config, quant)
        except KilnError as e:  # QUANT_SHAPE: the export refuses it; the plan sizes the source
            if e.code != Codes.QUANT_SHAPE:
                raise
    return source_bytes(shape, weight_bytes)


def keeps_source(shape: ModelShape, quant: str) -> bool:
    """Whether an artifact of catalog scheme `quant` stores the weights as the pre-quantized source does, so it keeps
    the source's tensors: FP8 weights in the source's 2-D blocks (DeepSeek-V3's 128 x 128 is `fp8-block`'s). gpt-oss's
    MXFP4 experts beside bf16 attention are no catalog scheme (`mxfp4-w4a4` quantizes every Linear)."""
    q, scheme = shape.source_quant, SCHEMES.get(quant)
    if q is None or q.layout is not FP8_BLOCK or scheme is None or scheme.weights is None:
        return False
    w = scheme.weights
    return w.type == "float" and w.num_bits == 8 and w.block_structure == q.block


def source_bytes(shape: ModelShape, weight_bytes: int, *, extras: bool = True) -> int:
    """The source checkpoint's tensor bytes: each tensor as the release stores it (`ModelShape.stored_tensors`:
    FP8 weights and their block scales, MXFP4 blocks and scales, where config.json's `quantization_config` says
    so), the rest at `weight_bytes` per element; with `extras`, the layers a release carries that kiln builds nothing
    from (`ModelShape.extra_tensors`: DeepSeek-V3's multi-token-prediction layer; a checkpoint that leaves them
    out holds that much less)."""
    if shape.source_quant is None and not (extras and shape.prediction_layers):
        return weight_bytes * sum(t.elements for t in shape.tensors())
    return sum(
        (DTYPES[t.dtype].itemsize if t.dtype is not None else weight_bytes) * math.prod(t.shape)
        for t in shape.stored_tensors(extras=extras)
    )
