"""HF tensors -> GGUF tensors, for every family whose record maps the `gguf` target: pure functions over the
record, the shapes and `(name, tensor)` pairs.

A GGUF tensor is named from its kind (`formats.gguf.constants.TENSOR_NAMES`, or the family's own name for it in
its `TargetMapping.names`): `blk.{i}.` for a decoder layer's, then `.weight` or `.bias`. `layout` says where each
source tensor goes: its GGUF name; its place in a stacked tensor (llama.cpp keeps each layer's experts as one 3-D
tensor per projection, [experts, rows, columns] in torch order); its q/k rows permuted to the interleaved rope
layout where the mapping says so (`permute_qk`: llama.cpp's `llama`); a norm stored as offset + w where the family
scales by (offset + w) (Gemma, `Norms.offset`), since llama.cpp's RMSNorm multiplies by the stored weight.

`plan_tensors` decides every GGUF tensor's name, shape and type from the source header alone; `convert_tensors` is
the matching generator over the tensors themselves (it never mutates its input; fed in plan order, it holds one
stacked tensor at a time). File I/O lives in `export.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import InvalidInput, SourceInvalid
from formats.architectures.record import NORM_KINDS, TargetMapping, TensorKind
from formats.gguf.constants import (
    F32_KINDS,
    LLAMA_CPP_ARCHS,
    TENSOR_NAMES,
    TYPE_TRAITS,
    LlamaCppArch,
    QuantSpec,
    TensorType,
)

if TYPE_CHECKING:
    import torch

    from formats.architectures.shape import ModelShape
    from formats.safetensors import TensorInfo

# A source dtype and the GGUF type that holds it losslessly (the input to llama.cpp's quantizer).
LOSSLESS_TYPES: dict[str, TensorType] = {"BF16": TensorType.BF16, "F16": TensorType.F16, "F32": TensorType.F32}


def gguf_mapping(shape: ModelShape) -> TargetMapping:
    """The family's `gguf` mapping (its record's), GGUF_UNSUPPORTED_ARCH with the record's reason if it has none."""
    mapping = shape.arch.target("gguf")
    if mapping.refused is not None:
        raise InvalidInput(
            f"GGUF export does not support {shape.architecture} ({shape.family}): {mapping.refused}",
            code="GGUF_UNSUPPORTED_ARCH",
            details={"architecture": shape.architecture, "reason": mapping.refused},
        )
    return mapping


def llama_cpp_arch(shape: ModelShape) -> LlamaCppArch:
    """The llama.cpp architecture the family is written as (`general.architecture`)."""
    name = gguf_mapping(shape).gguf_arch or ""
    try:
        return LLAMA_CPP_ARCHS[name]
    except KeyError:
        raise InvalidInput(
            f"GGUF export: {shape.architecture}'s mapping names llama.cpp architecture {name!r}, which kiln does not "
            f"know; known: {', '.join(LLAMA_CPP_ARCHS)}",
            code="GGUF_UNSUPPORTED_ARCH",
            details={"architecture": shape.architecture, "gguf_arch": name},
        ) from None


@dataclass(frozen=True)
class Placement:
    """Where one source tensor goes in the GGUF file."""

    name: str  # the GGUF tensor
    kind: TensorKind
    expert: int | None = None  # its index in a stacked tensor of `experts` parts; None: written alone
    experts: int = 1
    heads: int | None = None  # rows permuted to llama.cpp's rope layout, in groups of this many heads
    offset: float = 0.0  # added to every value (a norm computed as x * (offset + w))


def layout(shape: ModelShape) -> dict[str, Placement]:
    """Every source tensor's placement, by its HF name, from the record and the config alone."""
    mapping = gguf_mapping(shape)
    names = {**TENSOR_NAMES, **dict(mapping.names)}
    offset = shape.arch.norms.offset
    experts = shape.moe.experts if shape.moe is not None else 1
    out: dict[str, Placement] = {}
    for t in shape.tensors():
        base = names.get(t.kind)
        if base is None:
            raise InvalidInput(
                f"GGUF export: {shape.architecture}'s {t.kind.value} tensors (e.g. {t.name!r}) have no llama.cpp "
                "name; the family's gguf mapping must name them",
                code="GGUF_UNSUPPORTED_ARCH",
                details={"architecture": shape.architecture, "kind": t.kind.value},
            )
        if mapping.permute_qk and t.kind is TensorKind.ATTN_QKV:
            raise InvalidInput(
                f"GGUF export: {shape.architecture}'s mapping permutes q/k rows, but its q, k and v are fused",
                code="GGUF_UNSUPPORTED_ARCH",
                details={"architecture": shape.architecture},
            )
        name = f"{base}.{'bias' if t.bias else 'weight'}"
        heads = None
        if mapping.permute_qk and t.kind is TensorKind.ATTN_Q:
            heads = shape.num_heads
        elif mapping.permute_qk and t.kind is TensorKind.ATTN_K:
            heads = shape.num_kv_heads
        out[t.name] = Placement(
            name=name if t.layer is None else f"blk.{t.layer}.{name}",
            kind=t.kind,
            expert=t.expert,
            experts=experts if t.expert is not None else 1,
            heads=heads,
            offset=offset if t.kind in NORM_KINDS else 0.0,
        )
    return out


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


def convert_tensors(pairs: Iterable[tuple[str, torch.Tensor]], shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(GGUF name, tensor)` for HF `(name, tensor)` pairs: renamed, q/k rows permuted, norms offset, and
    each layer's experts stacked into one tensor per projection, yielded when its last part arrives. Fed in plan
    order (a stacked tensor's parts one after another), it holds one stacked tensor and one part at a time."""
    import torch

    places = layout(shape)
    stacks: dict[str, tuple[torch.Tensor, set[int]]] = {}
    for name, tensor in pairs:
        p = places.get(name)
        if p is None:
            raise SourceInvalid(f"tensor {name!r} is not a tensor of {shape.architecture}", details={"tensor": name})
        if p.heads is not None:
            tensor = permute(tensor, p.heads)
        if p.offset:
            tensor = tensor.to(torch.float32) + p.offset  # as transformers computes (1 + w) in float32
        if p.expert is None:
            yield p.name, tensor
            continue
        stack, seen = stacks.get(p.name) or (torch.empty((p.experts, *tensor.shape), dtype=tensor.dtype), set())
        if tensor.dtype != stack.dtype:  # experts stored in different dtypes: stack losslessly in float32
            stack = stack.to(torch.float32)
        stack[p.expert].copy_(tensor)
        seen.add(p.expert)
        if len(seen) < p.experts:
            stacks[p.name] = (stack, seen)
            continue
        stacks.pop(p.name, None)
        yield p.name, stack
    if stacks:
        gname, (stack, seen) = next(iter(stacks.items()))
        raise SourceInvalid(
            f"GGUF tensor {gname!r} stacks {stack.shape[0]} experts' tensors, {len(seen)} were given",
            details={"gguf_tensor": gname},
        )


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor, decided from the source header before any data is read."""

    sources: tuple[str, ...]  # the HF tensors it is made of: one, or a layer's experts in expert order
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy order, rows last
    ttype: TensorType
    source_nbytes: int
    fallback: str | None = None  # why the requested type was not used, if it was not

    @property
    def source(self) -> str:
        """The HF tensor (or the span of experts' tensors) it is made of, for messages."""
        return self.sources[0] if len(self.sources) == 1 else f"{self.sources[0]} .. {self.sources[-1]}"


def _wanted_type(kind: TensorKind, dims: tuple[int, ...], dtype: str, quant: QuantSpec, tied: bool) -> TensorType:
    if len(dims) == 1 or kind in F32_KINDS:
        return TensorType.F32  # norms, biases (ggml adds/multiplies them in F32) and routers
    if quant.llama_ftype is not None:
        return LOSSLESS_TYPES[dtype]  # llama.cpp's quantizer picks the final types
    is_output = kind is TensorKind.OUTPUT or (tied and kind is TensorKind.TOKEN_EMBD)
    if is_output and quant.output_type is not None:
        return quant.output_type
    assert quant.tensor_type is not None
    return quant.tensor_type


def plan_tensors(
    tensors: Mapping[str, TensorInfo], shape: ModelShape, quant: QuantSpec, *, strict: bool = False
) -> list[TensorPlan]:
    """Decide every GGUF tensor's name, shape and type from the source header, in the header's order (a stacked
    tensor where its first part is).

    A 2-D or 3-D weight whose row length is not a multiple of its type's block size cannot be stored in that
    type: with `strict` that is an `InvalidInput` (GGUF_ROW_NOT_DIVISIBLE) naming the tensor; otherwise the
    tensor falls back to `quant.fallback_type` (F16, as llama.cpp's converter does) and the plan records why.
    """
    places = layout(shape)
    groups: dict[str, list[str]] = {}
    for hf_name in tensors:
        p = places.get(hf_name)
        if p is None:
            raise SourceInvalid(
                f"tensor {hf_name!r} is not a tensor of {shape.architecture}", details={"tensor": hf_name}
            )
        groups.setdefault(p.name, []).append(hf_name)
    plans: list[TensorPlan] = []
    for gname, names in groups.items():
        first = places[names[0]]
        if first.experts > 1:
            names = sorted(names, key=lambda n: places[n].expert or 0)
            if [places[n].expert for n in names] != list(range(first.experts)):
                raise SourceInvalid(
                    f"GGUF tensor {gname!r} needs {first.experts} experts' tensors, the source has {len(names)}",
                    details={"gguf_tensor": gname},
                )
            dims: tuple[int, ...] = (first.experts, *tensors[names[0]].shape)
        else:
            dims = tuple(tensors[names[0]].shape)
        dtypes = {tensors[n].dtype for n in names}
        dtype = dtypes.pop() if len(dtypes) == 1 else "F32"
        ttype = _wanted_type(first.kind, dims, dtype, quant, shape.tie_word_embeddings)
        fallback = None
        block = TYPE_TRAITS[ttype].block_size
        if dims[-1] % block:
            reason = f"row length {dims[-1]} is not a multiple of the {ttype.name} block size {block}"
            source = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            if strict:
                raise InvalidInput(
                    f"GGUF {quant.name}: tensor {source!r} ({gname}) cannot be stored as {ttype.name}: {reason}",
                    code="GGUF_ROW_NOT_DIVISIBLE",
                    details={"tensor": source, "gguf_tensor": gname, "type": ttype.name, "row_length": dims[-1]},
                )
            fallback = f"{ttype.name} -> {quant.fallback_type.name}: {reason}"
            ttype = quant.fallback_type
        nbytes = sum(tensors[n].nbytes for n in names)
        plans.append(TensorPlan(tuple(names), gname, dims, ttype, nbytes, fallback))
    return plans
