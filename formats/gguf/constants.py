"""GGUF v3 format facts, as one typed table.

Sources: ggml-org/llama.cpp `gguf-py/gguf/constants.py` (GGUF_MAGIC, GGMLQuantizationType,
GGML_QUANT_SIZES, Keys, TokenType, LlamaFileType), `src/llama-vocab.cpp` (pre-tokenizer names and
the regexes llama.cpp runs for them) and `convert_hf_to_gguf.py` / `conversion/llama.py`,
`conversion/qwen.py`, `conversion/gemma.py`, `conversion/phi.py`, `conversion/deepseek.py`, `conversion/gpt_oss.py`
(tensor names, metadata keys) and
`src/models/*.cpp` (what each architecture's graph computes). Nothing here imports numpy or torch: recipe checks
and `kiln plan` import `targets`, which imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Final, Literal

from kiln.formats.architectures.record import TensorKind

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
    Q5_1 = 7
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
    TensorType.Q5_1: TypeTraits(32, 2 + 2 + 4 + 16),  # f16 scale and minimum + high bits + nibbles
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


class ExpertGatingFunc(IntEnum):
    """{arch}.expert_gating_func values (llama_expert_gating_func_type; gguf-py's ExpertGatingFuncType): how an
    expert's score is made from its router logit. A deepseek2 file without the key is computed with SOFTMAX."""

    SOFTMAX = 1
    SIGMOID = 2


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
    ROPE_FREQ_BASE_SWA: Final = "{arch}.rope.freq_base_swa"
    ROPE_SCALING_TYPE: Final = "{arch}.rope.scaling.type"
    ROPE_SCALING_FACTOR: Final = "{arch}.rope.scaling.factor"
    SLIDING_WINDOW: Final = "{arch}.attention.sliding_window"
    SLIDING_WINDOW_PATTERN: Final = "{arch}.attention.sliding_window_pattern"
    FINAL_LOGIT_SOFTCAPPING: Final = "{arch}.final_logit_softcapping"
    EXPERT_COUNT: Final = "{arch}.expert_count"
    EXPERT_USED_COUNT: Final = "{arch}.expert_used_count"
    EXPERT_FEED_FORWARD_LENGTH: Final = "{arch}.expert_feed_forward_length"
    EXPERT_SHARED_COUNT: Final = "{arch}.expert_shared_count"
    EXPERT_WEIGHTS_SCALE: Final = "{arch}.expert_weights_scale"
    EXPERT_WEIGHTS_NORM: Final = "{arch}.expert_weights_norm"
    EXPERT_GATING_FUNC: Final = "{arch}.expert_gating_func"
    EXPERT_GROUP_COUNT: Final = "{arch}.expert_group_count"
    EXPERT_GROUP_USED_COUNT: Final = "{arch}.expert_group_used_count"
    LEADING_DENSE_BLOCK_COUNT: Final = "{arch}.leading_dense_block_count"
    VOCAB_SIZE: Final = "{arch}.vocab_size"
    # Multi-head latent attention (deepseek2): the latents' ranks and each head's key and value as the graph
    # decompresses them (key_length / value_length are then the cached latent's: kv_lora_rank + rope, kv_lora_rank).
    Q_LORA_RANK: Final = "{arch}.attention.q_lora_rank"
    KV_LORA_RANK: Final = "{arch}.attention.kv_lora_rank"
    KEY_LENGTH_MLA: Final = "{arch}.attention.key_length_mla"
    VALUE_LENGTH_MLA: Final = "{arch}.attention.value_length_mla"
    ROPE_SCALING_ORIG_CTX_LEN: Final = "{arch}.rope.scaling.original_context_length"
    ROPE_SCALING_YARN_BETA_FAST: Final = "{arch}.rope.scaling.yarn_beta_fast"
    ROPE_SCALING_YARN_BETA_SLOW: Final = "{arch}.rope.scaling.yarn_beta_slow"
    ROPE_SCALING_YARN_EXT_FACTOR: Final = "{arch}.rope.scaling.yarn_ext_factor"
    ROPE_SCALING_YARN_ATTN_FACTOR: Final = "{arch}.rope.scaling.yarn_attn_factor"
    ROPE_SCALING_YARN_LOG_MUL: Final = "{arch}.rope.scaling.yarn_log_multiplier"

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


# Tensor kind (`formats.architectures.record.TensorKind`) -> llama.cpp's tensor name (gguf-py's TENSOR_NAMES), without
# the `blk.{i}.` of a decoder layer's tensors or the `.weight` / `.bias` suffix. A kind that is missing (Phi-3's fused
# gate_up) has no name of its own: the family's mapping names it (`TargetMapping.names`).
TENSOR_NAMES: Final[dict[TensorKind, str]] = {
    TensorKind.TOKEN_EMBD: "token_embd",
    TensorKind.OUTPUT_NORM: "output_norm",
    TensorKind.OUTPUT: "output",
    TensorKind.ATTN_NORM: "attn_norm",
    TensorKind.ATTN_Q: "attn_q",
    TensorKind.ATTN_K: "attn_k",
    TensorKind.ATTN_V: "attn_v",
    TensorKind.ATTN_QKV: "attn_qkv",
    TensorKind.ATTN_OUTPUT: "attn_output",
    TensorKind.ATTN_Q_NORM: "attn_q_norm",
    TensorKind.ATTN_K_NORM: "attn_k_norm",
    TensorKind.ATTN_POST_NORM: "post_attention_norm",
    TensorKind.FFN_NORM: "ffn_norm",
    TensorKind.FFN_POST_NORM: "post_ffw_norm",
    TensorKind.FFN_GATE: "ffn_gate",
    TensorKind.FFN_UP: "ffn_up",
    TensorKind.FFN_DOWN: "ffn_down",
    TensorKind.FFN_GATE_INP: "ffn_gate_inp",
    TensorKind.FFN_GATE_EXPS: "ffn_gate_exps",
    TensorKind.FFN_UP_EXPS: "ffn_up_exps",
    TensorKind.FFN_DOWN_EXPS: "ffn_down_exps",
    TensorKind.FFN_GATE_SHEXP: "ffn_gate_shexp",
    TensorKind.FFN_UP_SHEXP: "ffn_up_shexp",
    TensorKind.FFN_DOWN_SHEXP: "ffn_down_shexp",
    TensorKind.FFN_GATE_INP_SHEXP: "ffn_gate_inp_shexp",
    TensorKind.ATTN_Q_A: "attn_q_a",
    TensorKind.ATTN_Q_A_NORM: "attn_q_a_norm",
    TensorKind.ATTN_Q_B: "attn_q_b",
    TensorKind.ATTN_KV_A_MQA: "attn_kv_a_mqa",
    TensorKind.ATTN_KV_A_NORM: "attn_kv_a_norm",
    TensorKind.ATTN_K_B: "attn_k_b",
    TensorKind.ATTN_V_B: "attn_v_b",
    TensorKind.ATTN_SINKS: "attn_sinks",
    TensorKind.FFN_EXP_PROBS_B: "exp_probs_b",
}
# Kinds llama.cpp names `.bias` that are no Linear's bias (DeepSeek's router correction, exp_probs_b.bias).
BIAS_NAMED_KINDS: Final = frozenset({TensorKind.FFN_EXP_PROBS_B})
# Kinds llama.cpp keeps in F32 whatever the file type: its converter writes them F32 and llama-quantize never
# quantizes them (the routers: a token's choice of experts is too sensitive to round).
F32_KINDS: Final = frozenset({TensorKind.FFN_GATE_INP, TensorKind.FFN_GATE_INP_SHEXP})


@dataclass(frozen=True)
class LlamaCppArch:
    """One llama.cpp architecture (`general.architecture`): what its graph computes, where families differ, and
    the optional keys its converter writes. kiln refuses a model the graph would compute differently from
    transformers (`targets.gguf.export.check_supported`), and writes the keys the converter writes.

    `sliding`: "none" (every layer attends to every earlier token), "per_layer" (a window on the layers
    `{arch}.attention.sliding_window_pattern` marks) or "disabled" (reads a window and ignores it: Phi-3);
    `swa_rope`: the sliding layers' rope, "own_base" (a base of their own, `rope.freq_base_swa`, unscaled: Gemma 3)
    or "shared" (the full layers' rope, scaling included: gpt-oss); `swa_default_period`: the pattern the graph
    assumes where the file gives none, every n-th layer full and the others sliding (gpt-oss: 2), so the pattern is
    written only where the model's layers differ from it (0: always written). `experts`: routes to experts when
    `expert_count` is set; `routing` how: "softmax" (a softmax over every expert, the top k, renormalised to sum to
    1), "softmax_weight" (the top k logits, a softmax over them: gpt-oss's), "sigmoid" (sigmoid scores plus the
    router's correction bias `exp_probs_b` to choose, group-limited by `expert_group_count` / `_used_count`, the
    chosen scores renormalised where `expert_weights_norm`, times `expert_weights_scale`: deepseek2);
    `shared_experts` and `leading_dense`: a shared expert beside the routed ones, dense layers before the first
    sparse one (`leading_dense_block_count`); `expert_activation` "clamped_swiglu": the experts compute
    ggml_swiglu_oai with llama.cpp's constants (alpha 1.702, limit 7: gpt-oss's). `attention` "mla": deepseek2's
    absorbed multi-head latent attention (the latent and one rope key cached; attn_k_b / attn_v_b per head);
    `sinks`: one learned sink logit per head. `rope_scalings`: the rope scalings its graph computes (YaRN as
    ggml's rope does, its correction range rounded out to whole dimensions). `scale_by_embd_per_head_at`: layer
    counts at which the graph scales attention by (hidden / heads)^-1/2 instead of head_dim^-1/2 (Gemma 3 27B).
    The keys: `vocab_size` and `rope_dimension_count` written or not; `head_dim_keys` key/value_length "always" or
    only where head_dim is not hidden / heads; `expert_feed_forward_length` for the experts' size.

    Sources: llama.cpp `src/models/<arch>.cpp` (load_arch_hparams and the graph), `src/llama-graph.cpp`
    (`build_moe_ffn`), `src/llama-model.cpp` (`llama_model_rope_type`) and `conversion/*.py`
    (`set_gguf_parameters`) of the pinned llama-cpp-python's vendored llama.cpp.
    """

    name: str
    activation: str = "silu"
    sliding: Literal["none", "per_layer", "disabled"] = "none"
    swa_rope: Literal["own_base", "shared"] = "own_base"
    swa_default_period: int = 0
    partial_rotary: bool = False
    embedding_scale: Literal["none", "sqrt_hidden"] = "none"
    experts: bool = False
    routing: Literal["softmax", "softmax_weight", "sigmoid"] = "softmax"
    shared_experts: bool = False
    leading_dense: bool = False
    expert_activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    attention: Literal["gqa", "mla"] = "gqa"
    sinks: bool = False
    rope_scalings: frozenset[str] = frozenset({"default", "linear"})
    final_logit_softcapping: bool = False
    scale_by_embd_per_head_at: frozenset[int] = frozenset()
    vocab_size_key: bool = False
    rope_dimension_key: bool = False
    head_dim_keys: Literal["always", "when_not_default"] = "when_not_default"
    expert_feed_forward_key: bool = False


LLAMA_CPP_ARCHS: Final[dict[str, LlamaCppArch]] = {
    a.name: a
    for a in (
        LlamaCppArch("llama", experts=True, vocab_size_key=True, rope_dimension_key=True),
        LlamaCppArch("qwen2", vocab_size_key=True, rope_dimension_key=True),
        LlamaCppArch("qwen3", head_dim_keys="always"),
        LlamaCppArch("qwen3moe", experts=True, head_dim_keys="always", expert_feed_forward_key=True),
        LlamaCppArch(
            "gemma3",
            activation="gelu_pytorch_tanh",
            sliding="per_layer",
            embedding_scale="sqrt_hidden",
            final_logit_softcapping=True,
            scale_by_embd_per_head_at=frozenset({62}),
            head_dim_keys="always",
        ),
        LlamaCppArch("phi3", sliding="disabled", partial_rotary=True, rope_dimension_key=True),
        # DeepSeek-V2/V3 (src/models/deepseek2.cpp): MLA in its absorbed form, interleaved-pair rope (NORM) on the
        # rope part only, sigmoid group-limited routing with a correction bias, shared experts, dense leading
        # layers; YaRN with DeepSeek's attention scale (`yarn_log_multiplier`).
        LlamaCppArch(
            "deepseek2",
            experts=True,
            routing="sigmoid",
            shared_experts=True,
            leading_dense=True,
            attention="mla",
            rope_scalings=frozenset({"default", "yarn"}),
            vocab_size_key=True,
            rope_dimension_key=True,
            expert_feed_forward_key=True,
        ),
        # gpt-oss (src/models/openai-moe.cpp): biased GQA with sinks, sliding and full layers (default: every
        # second layer full), one YaRN rope for both, the top-k router logits softmaxed, biased experts computing
        # ggml_swiglu_oai; rope on halves (NEOX), as transformers computes it.
        LlamaCppArch(
            "gpt-oss",
            sliding="per_layer",
            swa_rope="shared",
            swa_default_period=2,
            experts=True,
            routing="softmax_weight",
            expert_activation="clamped_swiglu",
            sinks=True,
            rope_scalings=frozenset({"default", "yarn"}),
            head_dim_keys="always",
            expert_feed_forward_key=True,
        ),
    )
}

# llama.cpp's vocabulary loader sets token attributes by general.name (src/llama-vocab.cpp, "Handle per token
# attributes"): for a name containing one of the words it looks up each of the tokens, and a vocabulary without
# one of them fails to load (std::out_of_range).
LLAMA_CPP_NAMED_TOKENS: Final[tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = (
    (("phi-3", "phi3"), ("</s>", "<unk>", "<s>", "<|endoftext|>")),
)


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
