"""HF Llama-family tensors -> GGUF tensors: pure functions over names, shapes and `(name, tensor)` pairs.

`plan_tensors` decides, from the source header alone, every GGUF tensor's name, shape and type;
`convert_tensors` is the matching generator that renames and permutes the tensors themselves (it
never mutates its input). File I/O lives in `export.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import InvalidInput, SourceInvalid
from formats.gguf.constants import (
    ARCHS,
    BLOCK_TENSOR_NAMES,
    GLOBAL_TENSOR_NAMES,
    OUTPUT_TENSOR,
    PERMUTED_K,
    PERMUTED_Q,
    TOKEN_EMBD_TENSOR,
    TYPE_TRAITS,
    ArchSpec,
    QuantSpec,
    TensorType,
)

if TYPE_CHECKING:
    import torch

    from formats.architectures.shape import ModelShape
    from formats.safetensors import TensorInfo

_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# A source dtype and the GGUF type that holds it losslessly (the input to llama.cpp's quantizer).
LOSSLESS_TYPES: dict[str, TensorType] = {"BF16": TensorType.BF16, "F16": TensorType.F16, "F32": TensorType.F32}


def arch_spec(shape: ModelShape) -> ArchSpec:
    try:
        return ARCHS[shape.family]
    except KeyError:
        raise InvalidInput(
            f"GGUF export does not support the {shape.family!r} family; supported: {', '.join(ARCHS)}",
            code="GGUF_UNSUPPORTED_ARCH",
        ) from None


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of an HF Llama-family tensor name."""
    if hf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[hf_name]
    m = _BLOCK.match(hf_name)
    if m and m.group(2) in BLOCK_TENSOR_NAMES:
        return f"blk.{int(m.group(1))}.{BLOCK_TENSOR_NAMES[m.group(2)]}"
    raise SourceInvalid(f"tensor {hf_name!r} has no GGUF name in the llama tensor map", details={"tensor": hf_name})


def permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute`: reorder q/k rows from HF's rotate-half rope layout to the
    interleaved pairs llama.cpp's `llama` architecture expects. Works on weights and biases."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _head_counts(hf_name: str, shape: ModelShape) -> tuple[int, int] | None:
    """(n_head, n_head_kv) for `permute` if this tensor's rows are permuted, else None."""
    if not arch_spec(shape).permute_qk:
        return None
    if hf_name.endswith(PERMUTED_Q):
        return shape.num_heads, shape.num_heads
    if hf_name.endswith(PERMUTED_K):
        return shape.num_heads, shape.num_kv_heads
    return None


def convert_tensors(pairs: Iterable[tuple[str, torch.Tensor]], shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename HF tensors to GGUF names and permute q/k rows where the architecture needs it."""
    for name, tensor in pairs:
        heads = _head_counts(name, shape)
        yield gguf_name(name), permute(tensor, *heads) if heads else tensor


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor, decided from the source header before any data is read."""

    source: str  # HF tensor name
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy order, rows last
    ttype: TensorType
    source_nbytes: int
    fallback: str | None = None  # why the requested type was not used, if it was not


def _wanted_type(gname: str, shape: tuple[int, ...], info: TensorInfo, quant: QuantSpec, tied: bool) -> TensorType:
    if len(shape) == 1:
        return TensorType.F32  # norms and biases: ggml adds/multiplies them in F32
    if quant.llama_ftype is not None:
        return LOSSLESS_TYPES[info.dtype]  # llama.cpp's quantizer picks the final types
    is_output = gname == OUTPUT_TENSOR or (tied and gname == TOKEN_EMBD_TENSOR)
    if is_output and quant.output_type is not None:
        return quant.output_type
    assert quant.tensor_type is not None
    return quant.tensor_type


def plan_tensors(
    tensors: Mapping[str, TensorInfo], shape: ModelShape, quant: QuantSpec, *, strict: bool = False
) -> list[TensorPlan]:
    """Decide every GGUF tensor's name, shape and type from the source header.

    A 2-D weight whose row length is not a multiple of its type's block size cannot be stored in that
    type: with `strict` that is an `InvalidInput` (GGUF_ROW_NOT_DIVISIBLE) naming the tensor; otherwise
    the tensor falls back to `quant.fallback_type` (F16, as llama.cpp's converter does) and the plan
    records why.
    """
    arch_spec(shape)
    plans: list[TensorPlan] = []
    for hf_name, info in tensors.items():
        gname = gguf_name(hf_name)
        dims = tuple(info.shape)
        ttype = _wanted_type(gname, dims, info, quant, shape.tie_word_embeddings)
        fallback = None
        block = TYPE_TRAITS[ttype].block_size
        if dims[-1] % block:
            reason = f"row length {dims[-1]} is not a multiple of the {ttype.name} block size {block}"
            if strict:
                raise InvalidInput(
                    f"GGUF {quant.name}: tensor {hf_name!r} ({gname}) cannot be stored as {ttype.name}: {reason}",
                    code="GGUF_ROW_NOT_DIVISIBLE",
                    details={"tensor": hf_name, "gguf_tensor": gname, "type": ttype.name, "row_length": dims[-1]},
                )
            fallback = f"{ttype.name} -> {quant.fallback_type.name}: {reason}"
            ttype = quant.fallback_type
        plans.append(TensorPlan(hf_name, gname, dims, ttype, info.nbytes, fallback))
    return plans
