"""HF tensors -> GGUF tensors, for every family whose record maps the `gguf` target: pure functions over the
record, the shapes and the tensors.

A GGUF tensor is named from its kind (`formats.gguf.constants.TENSOR_NAMES`, or the family's own name for it in
its `TargetMapping.names`): `blk.{i}.` for a decoder layer's, then `.weight` or `.bias`. `layout` says where each
source tensor goes: its GGUF name, or two where llama.cpp stores it split (MLA's kv_b, gpt-oss's gate_up:
`formats.gguf.layout.pieces`); its place in a stacked tensor (llama.cpp keeps each layer's experts as one 3-D
tensor per projection, [experts, rows, columns] in torch order); its q/k rows permuted to the interleaved rope
layout where the mapping says so (`permute_qk`: llama.cpp's `llama`); a norm stored as offset + w where the family
scales by (offset + w) (Gemma, `Norms.offset`), since llama.cpp's RMSNorm multiplies by the stored weight.

`plan_tensors` decides every GGUF tensor's name, shape and type from the source header alone; `convert_tensors` is
the matching generator over the tensors themselves (it never mutates its input and holds one GGUF tensor at a
time). A tensor the release stores as MXFP4 goes through as its own blocks, repacked to ggml's layout; one stored
FP8 is read dequantized. File I/O lives in `export.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, SourceInvalid
from kiln.formats.architectures.record import NORM_KINDS, TargetMapping, TensorKind
from kiln.formats.gguf.constants import (
    BIAS_NAMED_KINDS,
    LLAMA_CPP_ARCHS,
    TENSOR_NAMES,
    TYPE_TRAITS,
    LlamaCppArch,
    QuantSpec,
    TensorType,
)
from kiln.formats.gguf.layout import Piece, kiln_type, pieces, stored_mxfp4, unquantized

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kiln.formats.architectures.shape import ModelShape
    from kiln.formats.safetensors import TensorInfo

# A source dtype and the GGUF type that holds it losslessly (the input to llama.cpp's quantizer).
LOSSLESS_TYPES: dict[str, TensorType] = {"BF16": TensorType.BF16, "F16": TensorType.F16, "F32": TensorType.F32}
# SafeTensors dtypes of a pre-quantized release's stored values (FP8 E4M3; MXFP4 blocks), under the released name.
_STORED_DTYPES = frozenset({"F8_E4M3", "U8"})


def gguf_mapping(shape: ModelShape) -> TargetMapping:
    """The family's `gguf` mapping (its record's), GGUF_UNSUPPORTED_ARCH with the record's reason if it has none."""
    mapping = shape.arch.target("gguf")
    if mapping.refused is not None:
        raise InvalidInput(
            f"GGUF export does not support {shape.architecture} ({shape.family}): {mapping.refused}",
            code=Codes.GGUF_UNSUPPORTED_ARCH,
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
            code=Codes.GGUF_UNSUPPORTED_ARCH,
            details={"architecture": shape.architecture, "gguf_arch": name},
        ) from None


@dataclass(frozen=True)
class Placement:
    """Where one source tensor (or one part of it) goes in the GGUF file."""

    name: str  # the GGUF tensor
    kind: TensorKind  # the source tensor's
    shape: tuple[int, ...]  # the GGUF tensor's, torch order (rows last), experts stacked
    piece: Piece = Piece.WHOLE  # the part of the source tensor it holds (`formats.gguf.layout.pieces`)
    expert: int | None = None  # its index in a stacked tensor of `experts` parts; None: written alone
    experts: int = 1
    heads: int | None = None  # rows permuted to llama.cpp's rope layout, in groups of this many heads
    offset: float = 0.0  # added to every value (a norm computed as x * (offset + w))
    bias: bool = False  # a Linear's bias (or a stack of experts' biases)


def layout(shape: ModelShape) -> dict[str, tuple[Placement, ...]]:
    """Every source tensor's placements (one, or two for a tensor llama.cpp stores split), by its HF name, from the
    record and the config alone."""
    mapping = gguf_mapping(shape)
    names = {**TENSOR_NAMES, **dict(mapping.names)}
    offset = shape.arch.norms.offset
    experts = shape.moe.experts if shape.moe is not None else 1
    out: dict[str, tuple[Placement, ...]] = {}
    for t in shape.tensors():
        if mapping.permute_qk and t.kind is TensorKind.ATTN_QKV:
            raise InvalidInput(
                f"GGUF export: {shape.architecture}'s mapping permutes q/k rows, but its q, k and v are fused",
                code=Codes.GGUF_UNSUPPORTED_ARCH,
                details={"architecture": shape.architecture},
            )
        placed = []
        for part in pieces(shape, t):
            base = names.get(part.kind)
            if base is None:
                raise InvalidInput(
                    f"GGUF export: {shape.architecture}'s {part.kind.value} tensors (e.g. {t.name!r}) have no "
                    "llama.cpp name; the family's gguf mapping must name them",
                    code=Codes.GGUF_UNSUPPORTED_ARCH,
                    details={"architecture": shape.architecture, "kind": part.kind.value},
                )
            name = f"{base}.{'bias' if t.bias or part.kind in BIAS_NAMED_KINDS else 'weight'}"
            heads = None
            if mapping.permute_qk and t.kind is TensorKind.ATTN_Q:
                heads = shape.num_heads
            elif mapping.permute_qk and t.kind is TensorKind.ATTN_K:
                heads = shape.num_kv_heads
            stacked = t.expert is not None
            placed.append(
                Placement(
                    name=name if t.layer is None else f"blk.{t.layer}.{name}",
                    kind=t.kind,
                    shape=(experts, *part.shape) if stacked else part.shape,
                    piece=part.piece,
                    expert=t.expert,
                    experts=experts if stacked else 1,
                    heads=heads,
                    offset=offset if t.kind in NORM_KINDS else 0.0,
                    bias=t.bias,
                )
            )
        out[t.name] = tuple(placed)
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


def take_piece(tensor: torch.Tensor, p: Placement, shape: ModelShape) -> torch.Tensor:
    """The part `p` of a source tensor (`formats.gguf.layout.Piece`), in the GGUF tensor's orientation; a new
    tensor, the input untouched."""
    if p.piece is Piece.WHOLE:
        return tensor
    if p.piece is Piece.TRANSPOSED:
        return tensor.transpose(-1, -2).contiguous()
    if p.piece in (Piece.K_B, Piece.V_B):
        assert shape.mla is not None
        nope, v = shape.mla.qk_nope_head_dim, shape.mla.v_head_dim
        kv_b = tensor.reshape(shape.num_heads, nope + v, tensor.shape[-1])
        if p.piece is Piece.K_B:
            return kv_b[:, :nope].transpose(1, 2).contiguous()
        return kv_b[:, nope:].contiguous()
    start = 0 if p.piece is Piece.GATE else 1  # gate the even columns, up the odd ones
    if tensor.dim() == 2:  # the bias [experts, 2 x intermediate]
        return tensor[:, start::2].contiguous()
    return tensor.transpose(-1, -2)[:, start::2].contiguous()


@dataclass(frozen=True)
class StoredMxfp4:
    """A tensor as the release stores it in MXFP4 (`formats.prequantized`): `blocks` uint8 [..., rows, groups, 16]
    (value 2k of a block in byte k's low nibble) and `scales` uint8 [..., rows, groups] (E8M0 exponents); rows the
    outputs."""

    blocks: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class GgmlBytes:
    """A GGUF tensor's bytes, already in its ggml type's block layout (an MXFP4 tensor repacked from the release's
    blocks), in chunks (one expert's at a time): written as they are."""

    chunks: Iterable[np.ndarray]


def take_stored_piece(stored: StoredMxfp4, p: Placement) -> GgmlBytes:
    """The part `p` of a stack of experts the release stores as MXFP4, as ggml's block_mxfp4 bytes, one expert at a
    time: gate_up's gate (even output rows) or up (odd), or a stack whose stored rows are already llama.cpp's
    (down_proj: the release stores it outputs first, so its transposition is the stored layout itself). The
    blocks' values and exponents are moved, never recomputed (`formats.gguf.quants.mxfp4_from_ocp`)."""
    from kiln.formats.gguf.quants import mxfp4_from_ocp

    blocks, scales = stored.blocks, stored.scales
    if p.piece in (Piece.GATE, Piece.UP):
        start = 0 if p.piece is Piece.GATE else 1
        blocks, scales = blocks[:, start::2], scales[:, start::2]
    elif p.piece is not Piece.TRANSPOSED:
        raise ValueError(f"GGUF tensor {p.name!r}: a {p.piece.value} part of an MXFP4-stored tensor is not written")
    return GgmlBytes(mxfp4_from_ocp(b.numpy(), s.numpy()) for b, s in zip(blocks, scales, strict=True))


def convert_tensors(
    plans: Iterable[TensorPlan], read: Callable[[str], torch.Tensor | StoredMxfp4], shape: ModelShape
) -> Iterator[tuple[str, torch.Tensor | GgmlBytes]]:
    """Yield `(GGUF name, tensor)` for each planned tensor, reading its source tensors with `read` (a float tensor,
    or the release's stored MXFP4 blocks where the plan keeps them): its part taken (`take_piece`), renamed, q/k
    rows permuted, norms offset, a layer's experts stacked. Holds one GGUF tensor and one source tensor at a time;
    never mutates what `read` returns."""
    import torch

    places = layout(shape)
    for plan in plans:
        parts = [next(p for p in places[n] if p.name == plan.name) for n in plan.sources]
        if plan.stored is not None:
            (name,), (p,) = plan.sources, parts
            stored = read(name)
            if not isinstance(stored, StoredMxfp4):
                raise SourceInvalid(f"tensor {name!r} is not stored as MXFP4 blocks", details={"tensor": name})
            yield plan.name, take_stored_piece(stored, p)
            continue
        stack: torch.Tensor | None = None
        for name, p in zip(plan.sources, parts, strict=True):
            tensor = read(name)
            if isinstance(tensor, StoredMxfp4):
                raise SourceInvalid(f"tensor {name!r} is stored MXFP4, the plan reads it as floats")
            tensor = take_piece(tensor, p, shape)
            if p.heads is not None:
                tensor = permute(tensor, p.heads)
            if p.offset:
                tensor = tensor.to(torch.float32) + p.offset  # as transformers computes (1 + w) in float32
            if p.expert is None:
                stack = tensor
                break
            if stack is None:
                stack = torch.empty((p.experts, *tensor.shape), dtype=tensor.dtype)
            if tensor.dtype != stack.dtype:  # experts stored in different dtypes: stack losslessly in float32
                stack = stack.to(torch.float32)
            stack[p.expert].copy_(tensor)
        assert stack is not None
        yield plan.name, stack


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor, decided from the source header before any data is read."""

    sources: tuple[str, ...]  # the HF tensors it is made of: one, or a layer's experts in expert order
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy order, rows last
    ttype: TensorType
    source_nbytes: int
    fallback: str | None = None  # why the requested type was not used, if it was not
    # The release's layout whose stored bytes it is made of, repacked, not recomputed ("mxfp4"); None: its float
    # values are (the source's, or a pre-quantized tensor's dequantized: `dequantized`).
    stored: str | None = None
    dequantized: str | None = None  # the release's layout its pre-quantized source tensors are dequantized from

    @property
    def source(self) -> str:
        """The HF tensor (or the span of experts' tensors) it is made of, for messages."""
        return self.sources[0] if len(self.sources) == 1 else f"{self.sources[0]} .. {self.sources[-1]}"


def plan_tensors(
    tensors: Mapping[str, TensorInfo], shape: ModelShape, quant: QuantSpec, *, strict: bool = False
) -> list[TensorPlan]:
    """Decide every GGUF tensor's name, shape and type from the source header, in the header's order (a stacked
    tensor where its first part is, a split one's parts one after the other).

    A tensor the release stores as MXFP4 is written as MXFP4 from its stored blocks (`formats.gguf.layout`); one
    stored in another pre-quantized layout (FP8 block) is dequantized, and the plan says so. A 2-D or 3-D weight
    whose row length is not a multiple of its type's block size cannot be stored in that type: with `strict` that
    is an `InvalidInput` (GGUF_ROW_NOT_DIVISIBLE) naming the tensor; otherwise the tensor falls back to
    `quant.fallback_type` (F16, as llama.cpp's converter does) and the plan records why.
    """
    places = layout(shape)
    mxfp4 = stored_mxfp4(shape)
    quantized = shape.source_quant.layout.name if shape.source_quant is not None else None
    groups: dict[str, list[tuple[str, Placement]]] = {}
    for hf_name in tensors:
        placed = places.get(hf_name)
        if placed is None:
            raise SourceInvalid(
                f"tensor {hf_name!r} is not a tensor of {shape.architecture}", details={"tensor": hf_name}
            )
        for p in placed:
            groups.setdefault(p.name, []).append((hf_name, p))
    plans: list[TensorPlan] = []
    for gname, members in groups.items():
        first = members[0][1]
        if first.experts > 1:
            members = sorted(members, key=lambda m: m[1].expert or 0)
            if [p.expert for _, p in members] != list(range(first.experts)):
                raise SourceInvalid(
                    f"GGUF tensor {gname!r} needs {first.experts} experts' tensors, the source has {len(members)}",
                    details={"gguf_tensor": gname},
                )
        names = [n for n, _ in members]
        dims = first.shape
        dtypes = {tensors[n].dtype for n in names}
        dtype = dtypes.pop() if len(dtypes) == 1 else "F32"
        kept = names[0] in mxfp4
        if quant.llama_ftype is not None and not kept:
            # llama.cpp's quantizer picks the final types from a lossless file; a dequantized FP8 tensor has no
            # lossless type but F32 (twice the model's bf16 bytes on disk, 2.7 TB at DeepSeek-V3's size): BF16, the
            # release's own float type, one rounding before the quantizer's own
            lossless = LOSSLESS_TYPES.get(dtype, TensorType.BF16)
            ttype = TensorType.F32 if unquantized(first.kind, dims, bias=first.bias) else lossless
        else:
            ttype = kiln_type(first.kind, dims, quant, tied=shape.tie_word_embeddings, mxfp4=kept, bias=first.bias)
        fallback = None
        block = TYPE_TRAITS[ttype].block_size
        if dims[-1] % block:
            reason = f"row length {dims[-1]} is not a multiple of the {ttype.name} block size {block}"
            source = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            if strict or kept:
                raise InvalidInput(
                    f"GGUF {quant.name}: tensor {source!r} ({gname}) cannot be stored as {ttype.name}: {reason}",
                    code=Codes.GGUF_ROW_NOT_DIVISIBLE,
                    details={"tensor": source, "gguf_tensor": gname, "type": ttype.name, "row_length": dims[-1]},
                )
            fallback = f"{ttype.name} -> {quant.fallback_type.name}: {reason}"
            ttype = quant.fallback_type
        # a split tensor's parts: each its share of the source's bytes
        nbytes = sum(tensors[n].nbytes // len(places[n]) for n in names)
        dequantized = quantized if quantized is not None and not kept and dtype in _STORED_DTYPES else None
        plans.append(
            TensorPlan(
                tuple(names),
                gname,
                dims,
                ttype,
                nbytes,
                fallback,
                stored="mxfp4" if kept else None,
                dequantized=dequantized,
            )
        )
    return plans
