"""GGUF v3 format facts, as one typed table.

Sources: ggml-org/llama.cpp `gguf-py/gguf/constants.py` (GGUF_MAGIC, GGMLQuantizationType,
GGML_QUANT_SIZES, Keys, TokenType, LlamaFileType), `src/llama-vocab.cpp` (pre-tokenizer names and
the regexes llama.cpp runs for them) and `convert_hf_to_gguf.py` / `conversion/llama.py`,
`conversion/qwen.py` (tensor names, which families permute q/k rows). Nothing here imports numpy or
torch: recipe checks and `kiln plan` import `targets`, which imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Final

GGUF_MAGIC: Final = 0x46554747  # b"GGUF" read as a little-endian uint32
GGUF_VERSION: Final = 3
GGUF_ALIGNMENT: Final = 32  # default data alignment; written as general.alignment too
GGML_QUANT_VERSION: Final = 2  # GGML_QNT_VERSION in ggml.h; general.quantization_version
GGML_MAX_NAME: Final = 64  # tensor names are stored in char[64] with a terminating NUL
GGML_MAX_DIMS: Final = 4  # ggml tensors have at most 4 dimensions; gguf.cpp refuses more
QK_K: Final = 256  # super-block size of the K-quants


class ValueType(IntEnum):
    """Metadata value types (gguf_type in ggml/include/gguf.h)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format of each fixed-size scalar value type (little-endian)
SCALAR_FORMATS: Final[dict[ValueType, str]] = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}


class TensorType(IntEnum):
    """ggml tensor types kiln writes or asks llama.cpp to produce (a subset of ggml_type)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
    MXFP4 = 39
    NVFP4 = 40


@dataclass(frozen=True)
class TypeTraits:
    """How a type lays out a row: `block_size` elements are stored in `type_size` bytes."""

    block_size: int
    type_size: int


TYPE_TRAITS: Final[dict[TensorType, TypeTraits]] = {
    TensorType.F32: TypeTraits(1, 4),
    TensorType.F16: TypeTraits(1, 2),
    TensorType.BF16: TypeTraits(1, 2),
    TensorType.Q4_0: TypeTraits(32, 2 + 16),  # f16 scale + 32 nibbles
    TensorType.Q5_0: TypeTraits(32, 2 + 4 + 16),
    TensorType.Q8_0: TypeTraits(32, 2 + 32),  # f16 scale + 32 int8
    TensorType.Q4_K: TypeTraits(QK_K, 2 + 2 + QK_K // 2 + 12),
    TensorType.Q5_K: TypeTraits(QK_K, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    TensorType.Q6_K: TypeTraits(QK_K, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    TensorType.MXFP4: TypeTraits(32, 1 + 16),  # E8M0 shared exponent + 32 E2M1 nibbles (OCP MX)
    TensorType.NVFP4: TypeTraits(64, 4 + 32),  # four UE4M3 scales, one per 16, + 64 E2M1 nibbles
}


def tensor_nbytes(shape: tuple[int, ...], ttype: TensorType) -> int:
    """Bytes a tensor of `shape` (numpy order: rows last) takes as `ttype`; rows must fill whole blocks."""
    traits = TYPE_TRAITS[ttype]
    n = 1
    for d in shape:
        n *= d
    if shape and shape[-1] % traits.block_size:
        raise ValueError(f"row length {shape[-1]} is not a multiple of {ttype.name} block size {traits.block_size}")
    return n // traits.block_size * traits.type_size


class FileType(IntEnum):
    """general.file_type values (llama_ftype in include/llama.h)."""

    ALL_F32 = 0
    MOSTLY_F16 = 1
    MOSTLY_Q4_0 = 2
    MOSTLY_Q8_0 = 7
    MOSTLY_Q4_K_M = 15
    MOSTLY_Q6_K = 18
    MOSTLY_BF16 = 32
    MOSTLY_MXFP4_MOE = 38  # llama.cpp's only MXFP4 file type (named for gpt-oss's experts)
    MOSTLY_NVFP4 = 39


class TokenType(IntEnum):
    """tokenizer.ggml.token_type values (llama_token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class Keys:
    """Metadata key names. `{arch}` is replaced by general.architecture."""

    ARCHITECTURE: Final = "general.architecture"
    NAME: Final = "general.name"
    ALIGNMENT: Final = "general.alignment"
    FILE_TYPE: Final = "general.file_type"
    QUANTIZATION_VERSION: Final = "general.quantization_version"

    CONTEXT_LENGTH: Final = "{arch}.context_length"
    EMBEDDING_LENGTH: Final = "{arch}.embedding_length"
    BLOCK_COUNT: Final = "{arch}.block_count"
    FEED_FORWARD_LENGTH: Final = "{arch}.feed_forward_length"
    HEAD_COUNT: Final = "{arch}.attention.head_count"
    HEAD_COUNT_KV: Final = "{arch}.attention.head_count_kv"
    LAYERNORM_RMS_EPS: Final = "{arch}.attention.layer_norm_rms_epsilon"
    KEY_LENGTH: Final = "{arch}.attention.key_length"
    VALUE_LENGTH: Final = "{arch}.attention.value_length"
    ROPE_FREQ_BASE: Final = "{arch}.rope.freq_base"
    ROPE_DIMENSION_COUNT: Final = "{arch}.rope.dimension_count"
    VOCAB_SIZE: Final = "{arch}.vocab_size"

    TOKENIZER_MODEL: Final = "tokenizer.ggml.model"
    TOKENIZER_PRE: Final = "tokenizer.ggml.pre"
    TOKENS: Final = "tokenizer.ggml.tokens"
    TOKEN_TYPE: Final = "tokenizer.ggml.token_type"
    MERGES: Final = "tokenizer.ggml.merges"
    BOS_ID: Final = "tokenizer.ggml.bos_token_id"
    EOS_ID: Final = "tokenizer.ggml.eos_token_id"
    UNK_ID: Final = "tokenizer.ggml.unknown_token_id"
    PAD_ID: Final = "tokenizer.ggml.padding_token_id"
    ADD_BOS: Final = "tokenizer.ggml.add_bos_token"
    ADD_EOS: Final = "tokenizer.ggml.add_eos_token"
    CHAT_TEMPLATE: Final = "tokenizer.chat_template"


@dataclass(frozen=True)
class ArchSpec:
    """How one HF family is written: the llama.cpp architecture name and its rope layout.

    llama.cpp's `llama` architecture uses the interleaved (GPT-J style) rope layout, so the HF q/k
    rows are permuted at conversion (LlamaModel.permute); `qwen2` uses NEOX rope, which is HF's own
    layout, so Qwen2Model does not permute.
    """

    gguf_arch: str
    permute_qk: bool


ARCHS: Final[dict[str, ArchSpec]] = {
    "llama": ArchSpec("llama", permute_qk=True),
    "mistral": ArchSpec("llama", permute_qk=True),
    "qwen2": ArchSpec("qwen2", permute_qk=False),
}

# HF tensor name -> GGUF tensor name, for the tensors outside the decoder blocks.
GLOBAL_TENSOR_NAMES: Final[dict[str, str]] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Suffix after `model.layers.{i}.` -> GGUF name after `blk.{i}.`.
BLOCK_TENSOR_NAMES: Final[dict[str, str]] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# The HF suffixes whose rows llama.cpp permutes for its rope layout, and the head count used.
PERMUTED_Q: Final = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
PERMUTED_K: Final = ("self_attn.k_proj.weight", "self_attn.k_proj.bias")
OUTPUT_TENSOR: Final = "output.weight"
TOKEN_EMBD_TENSOR: Final = "token_embd.weight"


@dataclass(frozen=True)
class QuantSpec:
    """What one kiln quant name means for GGUF.

    `tensor_type` is what kiln itself writes for 2-D weights. `output_type`, when set, is used for the
    output projection (or token_embd when embeddings are tied, as llama.cpp reuses it as output).
    `llama_ftype` set means kiln writes a lossless intermediate file and llama.cpp's own quantizer
    (llama_model_quantize) produces the final file, with llama.cpp's per-tensor type mix.
    """

    name: str
    file_type: FileType
    tensor_type: TensorType | None
    output_type: TensorType | None = None
    llama_ftype: FileType | None = None
    fallback_type: TensorType = TensorType.F16  # for a row that does not fill whole blocks


QUANTS: Final[dict[str, QuantSpec]] = {
    q.name: q
    for q in (
        QuantSpec("f16", FileType.MOSTLY_F16, TensorType.F16),
        QuantSpec("bf16", FileType.MOSTLY_BF16, TensorType.BF16),
        QuantSpec("q8_0", FileType.MOSTLY_Q8_0, TensorType.Q8_0),
        # llama-quantize gives Q4_0's output tensor Q6_K; kiln writes Q4_0 itself and keeps output at
        # Q8_0, the best type it writes bit-exactly, because output is the most sensitive tensor.
        QuantSpec("q4_0", FileType.MOSTLY_Q4_0, TensorType.Q4_0, output_type=TensorType.Q8_0),
        # OCP MXFP4: blocks of 32 E2M1 values sharing a power-of-two (E8M0) scale, as MI355X and Blackwell
        # compute; the output tensor stays Q8_0 as for Q4_0.
        QuantSpec("mxfp4", FileType.MOSTLY_MXFP4_MOE, TensorType.MXFP4, output_type=TensorType.Q8_0),
        # NVIDIA's NVFP4 as llama.cpp stores it: E2M1 values in blocks of 16, each with an unsigned E4M3 scale
        # (no per-tensor scale), encoded by ggml's own quantizer (the pinned llama.cpp's llama_model_quantize
        # refuses its file type); the output tensor stays Q8_0.
        QuantSpec("nvfp4", FileType.MOSTLY_NVFP4, TensorType.NVFP4, output_type=TensorType.Q8_0),
        QuantSpec("q4_k_m", FileType.MOSTLY_Q4_K_M, None, llama_ftype=FileType.MOSTLY_Q4_K_M),
        QuantSpec("q6_k", FileType.MOSTLY_Q6_K, None, llama_ftype=FileType.MOSTLY_Q6_K),
    )
}


@dataclass(frozen=True)
class PreTokenizerSpec:
    """A llama.cpp pre-tokenizer name and the HF pre-tokenizer it reproduces exactly."""

    name: str  # tokenizer.ggml.pre
    hf_regex: str | None  # the Split regex before a regex-less ByteLevel; None: ByteLevel(use_regex=True)
    ignore_merges: bool  # llama.cpp sets ignore_merges for this name; HF's BPE must agree


# The GPT-2 regex HF's ByteLevel(use_regex=True) runs; llama.cpp's "gpt-2" runs the same.
LLAMA3_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PRE_TOKENIZERS: Final[tuple[PreTokenizerSpec, ...]] = (
    PreTokenizerSpec("gpt-2", None, ignore_merges=False),
    PreTokenizerSpec("llama-bpe", LLAMA3_REGEX, ignore_merges=True),
    PreTokenizerSpec("qwen2", QWEN2_REGEX, ignore_merges=False),
)

# Runtime requirements recorded in the artifact manifest.
RUNTIME: Final[dict[str, object]] = {"engine": "llama.cpp", "gguf_version": GGUF_VERSION, "min_llama_cpp_python": "0.3"}
