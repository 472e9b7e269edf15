"""An artifact's weight bytes, from the model's shape alone: a GGUF file's tensors for llama.cpp, a scheme's
checkpoint (`quant.footprint`) for the HF-format targets, else the source's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from core.errors import KilnError
from formats.architectures.record import TensorKind
from formats.architectures.shape import ModelShape
from formats.gguf.constants import F32_KINDS, FileType, TensorType, tensor_nbytes
from formats.gguf.constants import QUANTS as GGUF_QUANTS
from quant.catalog import SCHEMES
from quant.footprint import checkpoint_bytes

# The GGUF tensor type most of a llama.cpp-quantized file's 2-D weights get, by its file type (the output
# tensor gets Q6_K; llama.cpp's mix also puts Q6_K on some attn_v / ffn_down, a few percent more).
LLAMA_FTYPE_TYPES: Final[dict[FileType, TensorType]] = {
    FileType.MOSTLY_Q4_K_M: TensorType.Q4_K,
    FileType.MOSTLY_Q6_K: TensorType.Q6_K,
}


def gguf_bytes(shape: ModelShape, quant: str) -> int:
    """A GGUF file's tensor bytes for `quant`: 1-D tensors and routers F32; 2-D weights the quant's type (the output
    tensor its output type; llama.cpp's file types as `LLAMA_FTYPE_TYPES`), F16 where a row does not fill
    whole blocks. Experts stacked into one tensor take the bytes of their parts."""
    spec = GGUF_QUANTS[quant]
    output = TensorKind.TOKEN_EMBD if shape.tie_word_embeddings else TensorKind.OUTPUT
    total = 0
    for t in shape.tensors():
        dims = t.shape
        if len(dims) == 1 or t.kind in F32_KINDS:  # norms, biases and routers stay F32 (llama.cpp's rule)
            total += 4 * t.elements
            continue
        if spec.llama_ftype is not None:
            ttype = TensorType.Q6_K if t.kind == output else LLAMA_FTYPE_TYPES[spec.llama_ftype]
        else:
            assert spec.tensor_type is not None
            ttype = spec.output_type if t.kind == output and spec.output_type is not None else spec.tensor_type
        try:
            total += tensor_nbytes(dims, ttype)
        except ValueError:
            total += tensor_nbytes(dims, spec.fallback_type)
    return total


def artifact_bytes(shape: ModelShape, config: Mapping[str, Any], weight_bytes: int, quant: str, runtime: str) -> int:
    """The artifact's weights: a GGUF file's tensors for llama.cpp, else the scheme's checkpoint
    (`quant.footprint`); the source's bytes (`weight_bytes` per element) where the quant is neither or the
    shape does not fit it."""
    if runtime == "llama.cpp" and quant in GGUF_QUANTS:
        return gguf_bytes(shape, quant)
    if quant in SCHEMES:
        try:
            return checkpoint_bytes(config, quant)
        except KilnError as e:  # QUANT_SHAPE: the export refuses it; the plan sizes the source
            if e.code != "QUANT_SHAPE":
                raise
    return weight_bytes * sum(t.elements for t in shape.tensors())
