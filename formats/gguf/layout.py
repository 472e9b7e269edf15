"""Which GGUF tensors a checkpoint's tensors become, and in which type, from the model's shape alone.

Most checkpoint tensors become one GGUF tensor each (a layer's experts, stored one by one, are stacked into one).
Two kinds llama.cpp stores split, and one transposed (`pieces`):

- MLA's `kv_b_proj` [heads x (qk_nope + v), kv_lora_rank] becomes `attn_k_b` [heads, kv_lora_rank, qk_nope] (each
  head's key rows, transposed) and `attn_v_b` [heads, v, kv_lora_rank]: deepseek2's graph computes attention in its
  absorbed form, multiplying the queries by attn_k_b and the latent's attention output by attn_v_b
  (llama.cpp `conversion/deepseek.py` DeepseekV2Model.modify_tensors; `src/models/deepseek2.cpp` reads attn_kv_b
  only from legacy files).
- gpt-oss's stacked `gate_up_proj` [experts, hidden, 2 x intermediate], gate and up interleaved along its last axis
  (gate the even columns), becomes `ffn_gate_exps` and `ffn_up_exps` [experts, intermediate, hidden]; its bias
  [experts, 2 x intermediate] the two biases; its `down_proj` [experts, intermediate, hidden] is transposed to
  `ffn_down_exps` [experts, hidden, intermediate] (`conversion/gpt_oss.py` GptOssModel.modify_tensors).

A tensor the release stores as MXFP4 (gpt-oss's experts: `ModelShape.stored_tensors`) keeps its MXFP4 blocks in
every file kiln writes (`stored_mxfp4`): GGUF has the type, and any other would be an upcast of 4-bit values
(F16, BF16: four times the bytes for the same numbers) or their requantization (Q8_0, Q4_0: lossy). llama.cpp's
converter does the same (GptOssModel.dequant_model keeps them, whatever --outtype).

Pure functions, no numpy or torch: the GGUF target (`targets.gguf.convert`) plans and converts with them, and sizing
(`placement.weights`) counts a file's bytes with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from kiln.formats.architectures.record import TensorKind
from kiln.formats.gguf.constants import F32_KINDS, FileType, QuantSpec, TensorType

if TYPE_CHECKING:
    from kiln.formats.architectures.record import TensorSpec
    from kiln.formats.architectures.shape import ModelShape


class Piece(StrEnum):
    """The part of a checkpoint tensor one GGUF tensor holds."""

    WHOLE = "whole"  # all of it, as it is
    TRANSPOSED = "transposed"  # a stack of experts held inputs first [E, in, out], as llama.cpp's [E, out, in]
    K_B = "k_b"  # MLA's kv_b: each head's key rows, transposed
    V_B = "v_b"  # MLA's kv_b: each head's value rows
    GATE = "gate"  # an interleaved gate_up stack's even columns (its bias's even entries), transposed
    UP = "up"  # its odd columns


@dataclass(frozen=True)
class GgufPiece:
    """One GGUF tensor a checkpoint tensor becomes: its kind (which names it), the part of the source it holds
    and its shape in torch order (rows last; one expert's, where the checkpoint stores experts one by one)."""

    kind: TensorKind
    piece: Piece
    shape: tuple[int, ...]


def pieces(shape: ModelShape, t: TensorSpec) -> tuple[GgufPiece, ...]:
    """The GGUF tensors checkpoint tensor `t` becomes (one, or MLA's kv_b and gpt-oss's gate_up split in two)."""
    if t.kind is TensorKind.ATTN_KV_B and shape.mla is not None:
        mla, heads = shape.mla, shape.num_heads
        return (
            GgufPiece(TensorKind.ATTN_K_B, Piece.K_B, (heads, mla.kv_lora_rank, mla.qk_nope_head_dim)),
            GgufPiece(TensorKind.ATTN_V_B, Piece.V_B, (heads, mla.v_head_dim, mla.kv_lora_rank)),
        )
    if t.kind is TensorKind.FFN_GATE_UP_EXPS:  # every expert in one tensor, gate and up interleaved
        if t.bias:
            experts, both = t.shape
            half: tuple[int, ...] = (experts, both // 2)
        else:
            experts, hidden, both = t.shape
            half = (experts, both // 2, hidden)
        return (
            GgufPiece(TensorKind.FFN_GATE_EXPS, Piece.GATE, half),
            GgufPiece(TensorKind.FFN_UP_EXPS, Piece.UP, half),
        )
    if t.kind is TensorKind.FFN_DOWN_EXPS and t.expert is None and not t.bias and len(t.shape) == 3:
        experts, inputs, outputs = t.shape
        return (GgufPiece(t.kind, Piece.TRANSPOSED, (experts, outputs, inputs)),)
    return (GgufPiece(t.kind, Piece.WHOLE, t.shape),)


def stored_mxfp4(shape: ModelShape) -> frozenset[str]:
    """The tensors the release stores as MXFP4 blocks and scales (`ModelShape.stored_tensors`): written as MXFP4,
    their blocks repacked, in every file kiln writes."""
    return frozenset(s.of.name for s in shape.stored_tensors() if s.name == f"{s.of.name}_blocks")


def unquantized(kind: TensorKind, dims: tuple[int, ...], *, bias: bool) -> bool:
    """Whether llama.cpp keeps a tensor in F32 whatever the file type: norms and other 1-D tensors, biases (a stack
    of experts' biases is 2-D) and routers (a token's choice of experts is too sensitive to round); its converter
    writes them F32 and llama-quantize never quantizes them."""
    return len(dims) == 1 or bias or kind in F32_KINDS


def kiln_type(
    kind: TensorKind, dims: tuple[int, ...], quant: QuantSpec, *, tied: bool, mxfp4: bool, bias: bool = False
) -> TensorType:
    """The type kiln writes a GGUF tensor of `kind` and `dims` (torch order) in, for a quant kiln encodes itself (not
    one llama.cpp's quantizer makes), before the fallback for a row that does not fill whole blocks: F32 for norms,
    biases and routers (`unquantized`); MXFP4 for a tensor the release stores as MXFP4 (`mxfp4`); the quant's output
    type for the head (the embedding where it is tied: llama.cpp reuses it); else the quant's type."""
    if unquantized(kind, dims, bias=bias):
        return TensorType.F32
    if mxfp4:
        return TensorType.MXFP4
    is_output = kind is TensorKind.OUTPUT or (tied and kind is TensorKind.TOKEN_EMBD)
    if is_output and quant.output_type is not None:
        return quant.output_type
    if quant.tensor_type is None:
        raise ValueError(f"GGUF {quant.name} is made by llama.cpp's quantizer; kiln writes no type of its own for it")
    return quant.tensor_type


# The file types of kiln's unquantized files; with a release's MXFP4 tensors kept they are llama.cpp's "MXFP4 MoE".
FLOAT_FILE_TYPES = frozenset({FileType.ALL_F32, FileType.MOSTLY_F16, FileType.MOSTLY_BF16})


def gguf_file_type(shape: ModelShape, quant: QuantSpec) -> FileType:
    """general.file_type of kiln's file for `quant`: the quant's, or MOSTLY_MXFP4_MOE for an unquantized file that
    keeps a release's MXFP4 experts (as llama.cpp's converter labels it: base.py `prepare_metadata`)."""
    if quant.file_type in FLOAT_FILE_TYPES and stored_mxfp4(shape):
        return FileType.MOSTLY_MXFP4_MOE
    return quant.file_type
