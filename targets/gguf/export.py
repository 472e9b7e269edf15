"""The `gguf` target: a SafeTensors release of any family whose record maps `gguf` -> one GGUF v3 file llama.cpp
loads (llama, mistral and mixtral as `llama`, qwen2, qwen3, qwen3moe, gemma3, phi3, DeepSeek-V3 as `deepseek2`,
gpt-oss).

F16, BF16, Q8_0, Q4_0, MXFP4 and NVFP4 are written by kiln in one streaming pass (NVFP4 encoded by
ggml's quantizer). Q4_K_M and Q6_K are produced by llama.cpp's own quantizer (`llama_model_quantize`
through llama-cpp-python) from a lossless intermediate GGUF that kiln writes first and removes
afterwards, so their per-tensor type mix is exactly llama-quantize's.

A pre-quantized release: its MXFP4 experts (gpt-oss) are written as they are stored, in every type kiln writes
(a bf16 file of gpt-oss is its release as llama.cpp's converter makes it: MXFP4 experts, bf16 elsewhere), and
refused for the K-quants, whose quantizer would requantize them; its FP8 blocks (DeepSeek-V3) are dequantized,
GGUF having no FP8 type. The export's details say which.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.error_codes import Codes
from kiln.core.errors import Deferred, InvalidInput, StageFailed, UnknownName
from kiln.formats.gguf.constants import (
    GGML_QUANT_VERSION,
    LLAMA_CPP_NAMED_TOKENS,
    QK_K,
    QUANTS,
    RUNTIME,
    ExpertGatingFunc,
    FileType,
    Keys,
    LlamaCppArch,
    QuantSpec,
    TensorType,
    ValueType,
)
from kiln.formats.gguf.layout import gguf_file_type, stored_mxfp4
from kiln.formats.gguf.reader import read_header
from kiln.formats.gguf.writer import GGUFWriter, Metadata
from kiln.targets.gguf.convert import (
    GgmlBytes,
    StoredMxfp4,
    TensorPlan,
    convert_tensors,
    gguf_mapping,
    llama_cpp_arch,
    plan_tensors,
)
from kiln.targets.gguf.tokenizer import VocabMetadata, predict_vocab, read_vocab

if TYPE_CHECKING:
    import torch

    from kiln.formats.architectures.config import MlaShape
    from kiln.formats.architectures.shape import ModelShape
    from kiln.formats.hf_model import SourceModel
    from kiln.targets.base import ExportRequest, ExportResult

_LOSSLESS_FILE_TYPES = {TensorType.BF16: FileType.MOSTLY_BF16, TensorType.F16: FileType.MOSTLY_F16}


def output_name(quant: str) -> str:
    return f"model-{quant}.gguf"


def _unsupported(shape: ModelShape, arch: LlamaCppArch, message: str, **details: object) -> InvalidInput:
    return InvalidInput(
        f"GGUF export of {shape.architecture} as llama.cpp's {arch.name}: {message}",
        code=Codes.GGUF_UNSUPPORTED,
        details={"architecture": shape.architecture, "gguf_arch": arch.name, **details},
    )


def check_supported(shape: ModelShape) -> None:
    """Refuse (GGUF_UNSUPPORTED, saying what and why) a model that llama.cpp's graph for its architecture would
    compute differently from transformers, reading the family's record and the llama.cpp architecture its `gguf`
    mapping names (`LLAMA_CPP_ARCHS`); GGUF_UNSUPPORTED_ARCH where the record refuses the target."""
    arch = llama_cpp_arch(shape)
    record = shape.arch
    if shape.hidden_act != arch.activation:
        raise _unsupported(
            shape, arch, f"hidden_act={shape.hidden_act!r} is not supported (llama.cpp computes {arch.activation})"
        )
    if record.norms.embedding_scale != arch.embedding_scale:
        raise _unsupported(
            shape,
            arch,
            f"the embedding scale {record.norms.embedding_scale!r} is not llama.cpp's {arch.embedding_scale!r}",
        )
    _check_attention(shape, arch)
    _check_rope(shape, arch)
    sliding = sum(t == "sliding_attention" for t in shape.layer_types)
    window = shape.sliding_window
    if sliding and arch.sliding != "per_layer" and window is not None and window < shape.max_position_embeddings:
        raise _unsupported(
            shape,
            arch,
            f"{sliding} of {shape.num_layers} layers attend within a window of {window} tokens (context "
            f"{shape.max_position_embeddings}); llama.cpp's graph attends to every earlier token",
            sliding_window=window,
        )
    if shape.moe is not None:
        _check_experts(shape, arch)
    elif arch.experts and arch.routing != "softmax":
        raise _unsupported(shape, arch, "the model has no experts; llama.cpp's graph routes to them")
    scale_dim = (
        shape.hidden_size / shape.num_heads if shape.num_layers in arch.scale_by_embd_per_head_at else shape.head_dim
    )
    scalar = shape.query_pre_attn_scalar if shape.query_pre_attn_scalar is not None else float(shape.head_dim)
    if scalar != scale_dim:
        raise _unsupported(
            shape,
            arch,
            f"attention is scaled by query_pre_attn_scalar={scalar:g}^-1/2; llama.cpp scales it by {scale_dim:g}^-1/2",
            query_pre_attn_scalar=scalar,
        )
    if shape.attn_logit_softcapping is not None:
        raise _unsupported(shape, arch, "attn_logit_softcapping is set; llama.cpp does not cap attention logits")
    if shape.final_logit_softcapping is not None and not arch.final_logit_softcapping:
        raise _unsupported(shape, arch, "final_logit_softcapping is set; llama.cpp's graph does not cap the logits")


def check_model(shape: ModelShape, config: Mapping[str, Any], quant: str, params: Mapping[str, Any]) -> None:
    """`TargetSpec.check_model_fn`, at plan time: GGUF_UNSUPPORTED for a model llama.cpp would compute differently
    (`check_supported`) or a quant that would requantize what the release stores quantized (`check_quant`), before
    any stage runs; both are checked again at export."""
    check_supported(shape)
    spec = QUANTS.get(quant)
    if spec is not None:  # an unknown quant is the recipe check's to name
        check_quant(shape, spec)


def check_quant(shape: ModelShape, quant: QuantSpec) -> None:
    """Refuse (GGUF_UNSUPPORTED) a quant that would requantize what the release stores quantized: llama.cpp's
    quantizer (Q4_K_M, Q6_K) would decode a release's MXFP4 experts and quantize them again, losing what the
    4-bit values were; kiln's own types keep them (`formats.gguf.layout.stored_mxfp4`)."""
    if quant.llama_ftype is not None and stored_mxfp4(shape):
        arch = llama_cpp_arch(shape)
        raise _unsupported(
            shape,
            arch,
            f"{quant.name} is made by llama.cpp's quantizer, which would requantize the release's MXFP4 experts "
            "(decoded, then quantized again to K-quants: lossy); bf16 or f16 keep them as released, mxfp4 too",
            quant=quant.name,
        )


def _check_attention(shape: ModelShape, arch: LlamaCppArch) -> None:
    """The attention llama.cpp's graph computes: grouped-query or deepseek2's latent (MLA), sinks or none."""
    attention = shape.arch.attention
    if (attention.kind == "mla") != (arch.attention == "mla"):
        kinds = {"mla": "multi-head latent attention", "gqa": "grouped-query attention"}
        raise _unsupported(
            shape, arch, f"its attention is {kinds[attention.kind]}; llama.cpp's graph computes {kinds[arch.attention]}"
        )
    if attention.sinks != arch.sinks:
        have = "has attention sinks, which" if attention.sinks else "has no attention sinks, which"
        raise _unsupported(shape, arch, f"it {have} llama.cpp's graph {'lacks' if attention.sinks else 'reads'}")
    mla = shape.mla
    if mla is None:
        return
    if mla.q_lora_rank is None:
        raise _unsupported(
            shape,
            arch,
            "q_lora_rank is null (one q_proj): llama.cpp reads a model of DeepSeek-V3's layer counts with a query "
            "latent and refuses a file without attention.q_lora_rank",
        )
    if not mla.rope_interleave:
        raise _unsupported(
            shape,
            arch,
            "rope_interleave is false (rope on each head's halves); llama.cpp's deepseek2 rotates interleaved pairs",
        )
    if shape.attention_bias:
        raise _unsupported(shape, arch, "attention_bias is set; llama.cpp's deepseek2 reads no attention biases")


# YaRN parameters llama.cpp reads (`rope.scaling.*`), beside its factor; deepseek2 also reads mscale_all_dim.
_YARN_PARAMS = frozenset({"original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"})


def _check_rope(shape: ModelShape, arch: LlamaCppArch) -> None:
    """llama.cpp's rope: one base and one scaling (the architecture's: linear, or YaRN for deepseek2 and gpt-oss)
    for the full-attention layers (for every layer where the graph has no sliding layers); for the sliding layers a
    base of their own, unscaled (Gemma 3), or the full layers' rope (gpt-oss)."""
    ropes = dict(shape.rope)
    own_swa = arch.sliding == "per_layer" and arch.swa_rope == "own_base"
    for kind, spec in ropes.items():
        scaled_ok = kind == "full_attention" or not own_swa
        if spec.scaling not in arch.rope_scalings or (spec.scaling != "default" and not scaled_ok):
            computes = ", ".join(sorted(arch.rope_scalings - {"default"}))
            raise _unsupported(
                shape,
                arch,
                f"rope scaling {spec.scaling!r} on its {kind} layers is not supported (llama.cpp's {arch.name} "
                f"computes plain rope, and {computes} scaling on full-attention layers)",
                rope_type=spec.scaling,
            )
        if spec.scaling == "yarn":
            _check_yarn(shape, arch, dict(spec.params))
    if not own_swa and len({(s.theta, s.scaling, s.factor, s.params) for s in ropes.values()}) > 1:
        raise _unsupported(shape, arch, "its layer types have different ropes; llama.cpp's graph has one for all")
    if shape.rotary_fraction != 1.0:
        dims = rope_dimensions(shape)
        if not arch.partial_rotary:
            raise _unsupported(
                shape,
                arch,
                f"rope rotates {dims} of each head's {shape.head_dim} dimensions; llama.cpp rotates all of them",
                partial_rotary_factor=shape.rotary_fraction,
            )
        if dims <= 0 or dims % 2:
            raise _unsupported(
                shape, arch, f"rope would rotate {dims} dimensions per head (llama.cpp needs an even count)"
            )


def llama_cpp_differences(shape: ModelShape) -> list[str]:
    """What llama.cpp computes differently from transformers that kiln writes anyway, as llama.cpp's converter does:
    the file is the model, the difference is llama.cpp's arithmetic (recorded in the export's details; the eval
    measures it). YaRN's correction range left unrounded (gpt-oss's `truncate: false`): ggml's rope rounds it out
    to whole dimensions (`ggml_rope_yarn_corr_dims`) for every model."""
    out = []
    for kind, spec in shape.rope:
        if spec.scaling == "yarn" and dict(spec.params).get("truncate") is False:
            out.append(
                f"YaRN on its {kind} layers: transformers keeps the correction range unrounded (truncate false), "
                "llama.cpp rounds it out to whole dimensions, which moves a few rope frequencies"
            )
    return out


def _check_yarn(shape: ModelShape, arch: LlamaCppArch, params: dict[str, Any]) -> None:
    """YaRN as llama.cpp computes it: the parameters it reads; DeepSeek's attention scale where mscale equals
    mscale_all_dim (the release's: transformers' rope then scales nothing and the softmax by mscale squared, which
    deepseek2 computes from `yarn_log_multiplier`)."""
    allowed = _YARN_PARAMS | ({"mscale", "mscale_all_dim"} if arch.attention == "mla" else set())
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise _unsupported(
            shape,
            arch,
            f"its YaRN rope sets {', '.join(unknown)}, which kiln does not write for llama.cpp (it writes "
            f"{', '.join(sorted(allowed))})",
            rope_params=unknown,
        )
    if arch.attention == "mla" and params.get("mscale") != params.get("mscale_all_dim"):
        raise _unsupported(
            shape,
            arch,
            f"YaRN's mscale={params.get('mscale')} differs from mscale_all_dim={params.get('mscale_all_dim')}: "
            "kiln writes llama.cpp's DeepSeek YaRN only where they are equal (as released), its rope then unscaled",
        )
    if arch.attention == "mla" and params.get("truncate", True) is not True:
        raise _unsupported(shape, arch, "YaRN's truncate is false; llama.cpp rounds its correction range")


def _check_experts(shape: ModelShape, arch: LlamaCppArch) -> None:
    """llama.cpp's mixture of experts, as its architecture routes (`LlamaCppArch.routing`): "softmax", in every
    layer a softmax over all experts, the top k, their weights renormalised to sum to 1, no shared expert;
    "softmax_weight", the top k router logits (with the router's bias) and a softmax over them, biased experts;
    "sigmoid", sigmoid scores with a correction bias for the choice, group-limited, shared experts and leading
    dense layers."""
    moe, experts = shape.moe, shape.arch.mlp.experts
    assert moe is not None and experts is not None
    if not arch.experts:
        raise _unsupported(shape, arch, "the model routes to experts; llama.cpp's graph has none")
    if experts.activation != arch.expert_activation:
        raise _unsupported(
            shape,
            arch,
            f"its experts compute {experts.activation}; llama.cpp's {arch.name} computes {arch.expert_activation}",
        )
    scoring = {"softmax": "softmax", "softmax_weight": "softmax", "sigmoid": "sigmoid"}[arch.routing]
    if experts.scoring != scoring:
        raise _unsupported(shape, arch, f"its router scores by {experts.scoring}; llama.cpp's by {scoring}")
    biased = arch.routing == "softmax_weight"  # gpt-oss: its graph reads the router's and the experts' biases
    if experts.router_bias != biased or experts.bias != biased:
        have = "has" if experts.router_bias or experts.bias else "has no"
        raise _unsupported(
            shape,
            arch,
            f"its router or experts {have} biases; llama.cpp's {arch.name} {'reads' if biased else 'has'} "
            f"{'them' if biased else 'none'}",
        )
    if arch.routing == "softmax" and not moe.norm_topk_prob:
        raise _unsupported(
            shape, arch, "norm_topk_prob is false; llama.cpp renormalises the chosen experts' weights to sum to 1"
        )
    if (arch.routing == "softmax") != experts.softmax_then_topk:
        does = "takes" if experts.softmax_then_topk else "does not take"
        raise _unsupported(
            shape,
            arch,
            f"its router {does} a softmax over every expert before the top k; llama.cpp's {arch.name} "
            f"{'does' if arch.routing == 'softmax' else 'does not'}",
        )
    dense = shape.num_layers - len(moe.sparse_layers)
    leading = tuple(range(dense, shape.num_layers))
    if dense and not (arch.leading_dense and moe.sparse_layers == leading):
        where = "leading dense layers only" if arch.leading_dense else "every layer to experts"
        raise _unsupported(
            shape, arch, f"{dense} of its layers are dense; llama.cpp routes {where}", dense_layers=dense
        )
    if moe.shared_intermediate_size and not arch.shared_experts:
        raise _unsupported(shape, arch, "it has a shared expert, which llama.cpp's graph does not compute")
    if moe.shared_intermediate_size and moe.shared_intermediate_size % moe.intermediate_size:
        raise _unsupported(
            shape,
            arch,
            f"its shared expert is {moe.shared_intermediate_size} wide, not a whole number of experts of "
            f"{moe.intermediate_size} (llama.cpp's expert_shared_count)",
        )


def check_name(name: str, vocab: VocabMetadata) -> None:
    """Refuse a general.name for which llama.cpp's vocabulary loader looks up tokens this vocabulary lacks (it
    would fail to load the file): GGUF_NAME_UNSUPPORTED, naming them."""
    lowered = name.lower()
    tokens = set(vocab.tokens)
    for words, needed in LLAMA_CPP_NAMED_TOKENS:
        missing = [t for t in needed if t not in tokens]
        if missing and any(w in lowered for w in words):
            raise InvalidInput(
                f"GGUF: llama.cpp sets token attributes by the model's name: for a general.name containing "
                f"{' or '.join(map(repr, words))} ({name!r}) it needs the tokens {', '.join(map(repr, missing))}, "
                "which this tokenizer lacks, and would fail to load the file; export it under another name "
                "(the target's `name` param)",
                code=Codes.GGUF_NAME_UNSUPPORTED,
                details={"name": name, "missing_tokens": missing},
            )


def rope_dimensions(shape: ModelShape) -> int:
    """The dimensions of each head rope rotates (transformers' `int(head_dim * partial_rotary_factor)`; MLA's
    qk_rope_head_dim)."""
    if shape.mla is not None:
        return shape.mla.qk_rope_head_dim
    return int(shape.head_dim * shape.rotary_fraction)


def _default_swa_pattern(arch: LlamaCppArch, layers: int) -> tuple[str, ...] | None:
    """The layer kinds llama.cpp assumes where a file gives no sliding_window_pattern (`set_swa_pattern`: every
    n-th layer full, the others sliding); None where the architecture has no default kiln relies on."""
    n = arch.swa_default_period
    if not n:
        return None
    return tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers))


def model_metadata(meta: Metadata, source: SourceModel, name: str, file_type: FileType) -> None:
    """The general.* and {arch}.* keys llama.cpp reads for the family's architecture: the keys its converter
    writes (`LlamaCppArch`), from the checked config (`ModelShape`)."""
    s = source.shape
    arch = llama_cpp_arch(s)

    def k(key: str) -> str:
        return key.format(arch=arch.name)

    meta.add_string(Keys.ARCHITECTURE, arch.name)
    meta.add_string(Keys.NAME, name)
    meta.add_uint32(k(Keys.CONTEXT_LENGTH), s.max_position_embeddings)
    meta.add_uint32(k(Keys.EMBEDDING_LENGTH), s.hidden_size)
    meta.add_uint32(k(Keys.BLOCK_COUNT), s.num_layers)
    meta.add_uint32(k(Keys.FEED_FORWARD_LENGTH), s.intermediate_size)
    meta.add_uint32(k(Keys.HEAD_COUNT), s.num_heads)
    # MLA is computed as multi-query attention over the one cached latent (the converter's num_key_value_heads 1)
    meta.add_uint32(k(Keys.HEAD_COUNT_KV), 1 if s.mla is not None else s.num_kv_heads)
    meta.add_float32(k(Keys.ROPE_FREQ_BASE), s.rope_theta)
    meta.add_float32(k(Keys.LAYERNORM_RMS_EPS), s.rms_norm_eps)
    if arch.rope_dimension_key:
        meta.add_uint32(k(Keys.ROPE_DIMENSION_COUNT), rope_dimensions(s))
    if s.mla is not None:
        _mla_metadata(meta, k, s.mla)
    elif arch.head_dim_keys == "always" or s.head_dim != s.hidden_size // s.num_heads:
        meta.add_uint32(k(Keys.KEY_LENGTH), s.head_dim)
        meta.add_uint32(k(Keys.VALUE_LENGTH), s.head_dim)
    if arch.vocab_size_key:
        meta.add_uint32(k(Keys.VOCAB_SIZE), s.vocab_size)
    ropes = dict(s.rope)
    main = ropes.get("full_attention") or next(iter(ropes.values()), None)  # what rope.freq_base is of
    if main is not None and main.scaling == "linear" and main.factor is not None:
        meta.add_string(k(Keys.ROPE_SCALING_TYPE), "linear")
        meta.add_float32(k(Keys.ROPE_SCALING_FACTOR), main.factor)
    elif main is not None and main.scaling == "yarn" and main.factor is not None:
        _yarn_metadata(meta, k, main.factor, dict(main.params), s.max_position_embeddings, mla=s.mla is not None)
    kinds = s.layer_types
    if arch.sliding == "per_layer" and "sliding_attention" in kinds and s.sliding_window is not None:
        meta.add_uint32(k(Keys.SLIDING_WINDOW), s.sliding_window)
        if kinds != _default_swa_pattern(arch, s.num_layers):  # say each layer's kind where the default is wrong
            meta.add_array(k(Keys.SLIDING_WINDOW_PATTERN), [t == "sliding_attention" for t in kinds], ValueType.BOOL)
        if arch.swa_rope == "own_base":
            meta.add_float32(k(Keys.ROPE_FREQ_BASE_SWA), s.rope_for("sliding_attention").theta)
    elif arch.sliding == "disabled":  # read, and ignored: check_supported refused a window shorter than the context
        meta.add_uint32(k(Keys.SLIDING_WINDOW), s.sliding_window or 0)
    if s.final_logit_softcapping is not None:
        meta.add_float32(k(Keys.FINAL_LOGIT_SOFTCAPPING), s.final_logit_softcapping)
    if s.moe is not None:
        _expert_metadata(meta, k, arch, s)
    meta.add_uint32(Keys.FILE_TYPE, file_type)
    meta.add_uint32(Keys.QUANTIZATION_VERSION, GGML_QUANT_VERSION)


def _mla_metadata(meta: Metadata, k: Callable[[str], str], mla: MlaShape) -> None:
    """deepseek2's MLA keys (conversion/deepseek.py): the latents' ranks; key and value lengths of the cached
    latent (kv_lora_rank + the shared rope key; kv_lora_rank) and, `_mla`, of each head decompressed."""
    assert mla.q_lora_rank is not None  # check_supported refused a model without a query latent
    meta.add_uint32(k(Keys.Q_LORA_RANK), mla.q_lora_rank)
    meta.add_uint32(k(Keys.KV_LORA_RANK), mla.kv_lora_rank)
    meta.add_uint32(k(Keys.KEY_LENGTH), mla.cache_width)
    meta.add_uint32(k(Keys.VALUE_LENGTH), mla.kv_lora_rank)
    meta.add_uint32(k(Keys.KEY_LENGTH_MLA), mla.qk_head_dim)
    meta.add_uint32(k(Keys.VALUE_LENGTH_MLA), mla.v_head_dim)


def _yarn_metadata(
    meta: Metadata, k: Callable[[str], str], factor: float, params: dict[str, Any], context: int, *, mla: bool
) -> None:
    """YaRN's keys as the converter writes them (conversion/base.py `set_gguf_parameters`), and deepseek2's
    attention scale (0.1 x mscale_all_dim: deepseek.py, "TAG_DEEPSEEK2_YARN_LOG_MUL_FIX")."""
    meta.add_string(k(Keys.ROPE_SCALING_TYPE), "yarn")
    meta.add_float32(k(Keys.ROPE_SCALING_FACTOR), factor)
    # transformers' default for a config without it: the model's own context
    meta.add_uint32(k(Keys.ROPE_SCALING_ORIG_CTX_LEN), int(params.get("original_max_position_embeddings", context)))
    if "beta_fast" in params:
        meta.add_float32(k(Keys.ROPE_SCALING_YARN_BETA_FAST), float(params["beta_fast"]))
    if "beta_slow" in params:
        meta.add_float32(k(Keys.ROPE_SCALING_YARN_BETA_SLOW), float(params["beta_slow"]))
    if mla and params.get("mscale_all_dim") is not None:
        meta.add_float32(k(Keys.ROPE_SCALING_YARN_LOG_MUL), 0.1 * float(params["mscale_all_dim"]))


def _expert_metadata(meta: Metadata, k: Callable[[str], str], arch: LlamaCppArch, s: ModelShape) -> None:
    """The experts' keys: their count, how many a token uses and their width; deepseek2's routing (sigmoid
    scores, groups, shared experts, leading dense layers, the weights' normalisation and scale)."""
    moe = s.moe
    assert moe is not None
    meta.add_uint32(k(Keys.EXPERT_COUNT), moe.experts)
    meta.add_uint32(k(Keys.EXPERT_USED_COUNT), moe.experts_per_token)
    if arch.expert_feed_forward_key:
        meta.add_uint32(k(Keys.EXPERT_FEED_FORWARD_LENGTH), moe.intermediate_size)
    if arch.routing != "sigmoid":
        return
    # llama.cpp asserts fewer groups used than there are; using every group limits nothing: then no groups at all
    if moe.topk_groups < moe.groups:
        meta.add_uint32(k(Keys.EXPERT_GROUP_COUNT), moe.groups)
        meta.add_uint32(k(Keys.EXPERT_GROUP_USED_COUNT), moe.topk_groups)
    # without the key llama.cpp takes a softmax (DeepSeek-V2's), and the converter writes it only from a config's
    # `scoring_func`, which transformers' DeepseekV3Config does not keep
    meta.add_uint32(k(Keys.EXPERT_GATING_FUNC), ExpertGatingFunc.SIGMOID)
    meta.add_uint32(k(Keys.LEADING_DENSE_BLOCK_COUNT), s.num_layers - len(moe.sparse_layers))
    meta.add_uint32(k(Keys.EXPERT_SHARED_COUNT), moe.shared_intermediate_size // moe.intermediate_size)
    meta.add_float32(k(Keys.EXPERT_WEIGHTS_SCALE), moe.routed_scaling_factor)
    if moe.norm_topk_prob:  # llama.cpp's default is false; the converter writes the key only when true
        meta.add_bool(k(Keys.EXPERT_WEIGHTS_NORM), True)


@dataclass(frozen=True)
class TokenizerSource:
    """Tokenizer metadata to write: a fast prediction (None if the files alone are not enough) and the
    reference, which may take seconds to load (transformers) and is awaited only when needed."""

    predicted: VocabMetadata | None
    reference: Callable[[], VocabMetadata]


def write_gguf(
    source: SourceModel,
    plans: list[TensorPlan],
    path: Path,
    tokenizer: TokenizerSource,
    *,
    name: str,
    file_type: FileType,
    on_progress: Callable[[int], None] = lambda n: None,
) -> tuple[VocabMetadata, str]:
    """Plan the whole file from the source header, then stream every tensor into it, one at a time.

    The weights are streamed while the reference tokenizer loads; the header is written with the
    predicted tokenizer metadata and corrected at the end if the reference disagrees. Returns the
    tokenizer metadata written and how the header was settled.
    """
    from kiln.formats.gguf.quants import Encoder, F16Overflow

    def metadata(vocab: VocabMetadata) -> Metadata:
        check_name(name, vocab)
        meta = Metadata()
        model_metadata(meta, source, name, file_type)
        vocab.add_to(meta)
        return meta

    vocab = tokenizer.predicted if tokenizer.predicted is not None else tokenizer.reference()
    with GGUFWriter(path) as writer, Encoder() as encoder:
        writer.add_metadata(metadata(vocab))
        for p in plans:
            writer.plan_tensor(p.name, p.shape, p.ttype)
        writer.begin()
        converted = convert_tensors(plans, _reader(source, plans), source.shape)
        for plan, (gname, tensor) in zip(plans, converted, strict=True):
            try:
                data = tensor.chunks if isinstance(tensor, GgmlBytes) else encoder.encode(tensor, plan.ttype)
                writer.write_tensor(gname, data)
            except F16Overflow as e:
                raise InvalidInput(
                    f"GGUF: tensor {plan.source!r} cannot be stored as F16: {e}; export bf16 (or q8_0) instead",
                    code=Codes.GGUF_F16_OVERFLOW,
                    details={"tensor": plan.source},
                ) from None
            on_progress(plan.source_nbytes)
        reference = tokenizer.reference()
        settled = "as predicted"
        if reference != vocab:
            in_place = writer.rewrite_metadata(metadata(reference))
            settled = "rewritten in place" if in_place else "rewritten, weights moved"
        writer.finish()
    return reference, settled


def _reader(source: SourceModel, plans: list[TensorPlan]) -> Callable[[str], torch.Tensor | StoredMxfp4]:
    """Read one source tensor at a time: as the release stores it where the plan keeps its MXFP4 blocks (its
    scales checked again), dequantized where it is stored in another pre-quantized layout (FP8 block), else as it
    is. The last one read is kept: a tensor llama.cpp stores split is read once for both parts."""
    from kiln.formats.prequantized import check_scale

    kept = {n for p in plans if p.stored is not None for n in p.sources}
    last: list[tuple[str, torch.Tensor | StoredMxfp4]] = []

    def read(name: str) -> torch.Tensor | StoredMxfp4:
        if last and last[0][0] == name:
            return last[0][1]
        tensor: torch.Tensor | StoredMxfp4
        if name in kept:
            assert source.quantized is not None
            qt = source.quantized.tensors[name]
            stored = source.stored(name)
            check_scale(source.quantized.quantization, qt, stored[qt.scale.name])
            tensor = StoredMxfp4(stored[qt.values.name], stored[qt.scale.name])
        elif source.is_quantized(name):
            tensor = source.dequantized(name)
        else:
            tensor = source.tensor(name)
        last[:] = [(name, tensor)]
        return tensor

    return read


def llama_quantize(src: Path, dst: Path, ftype: FileType, *, threads: int = 0) -> None:
    """Run llama.cpp's quantizer (llama-quantize's library call) from `src` into `dst`."""
    try:
        import llama_cpp
        from llama_cpp import _logger as llama_logger
    except ImportError as e:  # pragma: no cover - depends on the install
        raise Deferred(
            f"GGUF {ftype.name} needs llama-cpp-python (llama.cpp's quantizer), which is not installed here: {e}",
            details={"needs": "llama-cpp-python>=0.3"},
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = threads
    level = llama_logger.logger.level
    llama_logger.logger.setLevel(logging.ERROR)  # the quantizer logs every tensor otherwise
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    finally:
        llama_logger.logger.setLevel(level)
    if rc != 0 or not dst.is_file():
        dst.unlink(missing_ok=True)
        raise StageFailed(f"llama.cpp's quantizer failed ({ftype.name}, rc={rc})", code=Codes.GGUF_QUANTIZE_FAILED)


def prepare(source: SourceModel) -> dict[str, Any]:
    """Once per source, for every GGUF export: the tokenizer as transformers loads it (the reference
    metadata; loading transformers costs seconds a bare tensor conversion does not)."""
    check_supported(source.shape)
    return {"vocab": asdict(read_vocab(source.root, source.shape.vocab_size, source.config))}


def export(source: SourceModel, req: ExportRequest) -> ExportResult:
    """Write `model-<quant>.gguf` into `req.out_dir`.

    `req.params`: `name` (general.name, default: the recipe's model name), `strict_types` (raise
    GGUF_ROW_NOT_DIVISIBLE instead of falling back when a row does not fill whole quant blocks).
    """
    from kiln.targets.base import ExportResult

    quant = QUANTS.get(req.quant)
    if quant is None:
        raise UnknownName(
            f"GGUF: unknown quant {req.quant!r}; known: {', '.join(QUANTS)}", details={"known": list(QUANTS)}
        )
    strict = bool(req.params.get("strict_types", False))
    name = str(req.params.get("name") or req.model_name or source.root.name)
    check_supported(source.shape)
    check_quant(source.shape, quant)
    plans = plan_tensors(source.tensors, source.shape, quant, strict=strict)
    expected_fallbacks = _k_quant_fallbacks(plans, quant, strict)

    out_dir = Path(req.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / output_name(quant.name)
    with ThreadPoolExecutor(1, thread_name_prefix="kiln-gguf-tokenizer") as pool:
        shape, root = source.shape, source.root
        predicted: VocabMetadata | None
        if req.prepared is not None:  # the prepare stage read the reference once for every export
            prepared = VocabMetadata(**req.prepared["vocab"])
            tokenizer = TokenizerSource(prepared, lambda: prepared)
        else:
            reference = pool.submit(read_vocab, root, shape.vocab_size, source.config)
            try:
                predicted = predict_vocab(root, shape.vocab_size, source.config)
            except InvalidInput:
                predicted = None  # the reference decides: it may load fine, or it raises the error to report
            tokenizer = TokenizerSource(predicted, reference.result)
        if quant.llama_ftype is None:
            file_type = gguf_file_type(source.shape, quant)
            vocab, settled = write_gguf(
                source, plans, final, tokenizer, name=name, file_type=file_type, on_progress=req.on_progress
            )
            fallbacks = {p.name: p.fallback for p in plans if p.fallback}
            types = Counter(p.ttype.name for p in plans)
        else:
            intermediate = out_dir / f".{final.stem}.lossless.gguf"
            lossless = Counter(p.ttype for p in plans if len(p.shape) > 1).most_common(1)[0][0]
            try:
                vocab, settled = write_gguf(
                    source,
                    plans,
                    intermediate,
                    tokenizer,
                    name=name,
                    file_type=_LOSSLESS_FILE_TYPES.get(lossless, FileType.ALL_F32),
                    on_progress=req.on_progress,
                )
                llama_quantize(intermediate, final, quant.llama_ftype)
            except BaseException:
                final.unlink(missing_ok=True)
                raise
            finally:
                intermediate.unlink(missing_ok=True)
            written = read_header(final).tensor_types()
            types = Counter(written.values())
            fallbacks = {g: f"{why}; llama.cpp wrote {written.get(g, '?')}" for g, why in expected_fallbacks.items()}
    details: dict[str, Any] = {
        "architecture": llama_cpp_arch(source.shape).name,
        "permuted_qk": gguf_mapping(source.shape).permute_qk,
        "tokenizer_pre": vocab.pre,
        "tokenizer_header": settled,
        "vocab_padded": vocab.padded,
        "add_bos": vocab.add_bos,
        "tensor_types": dict(sorted(types.items())),
    }
    if quant.llama_ftype is not None:
        details["quantizer"] = "llama.cpp llama_model_quantize"
    if vocab.notes:
        details["notes"] = vocab.notes
    if fallbacks:
        details["fallbacks"] = fallbacks
    kept = dequantized = None
    if source.quantization is not None:
        details["source_quantization"] = _source_quantization(source, plans)
        layout = source.quantization.layout
        kept = layout if any(p.stored is not None for p in plans) else None
        dequantized = layout if any(p.dequantized is not None for p in plans) else None
    computes = llama_cpp_differences(source.shape)
    if computes:
        details["llama_cpp_computes"] = computes
    return ExportResult(
        files=[final.name], runtime=dict(RUNTIME), details=details, passed_through=kept, dequantized=dequantized
    )


def _source_quantization(source: SourceModel, plans: list[TensorPlan]) -> dict[str, Any]:
    """What became of a pre-quantized release's stored tensors: the GGUF tensors written from their stored blocks
    as they are (repacked, not recomputed), and those made from their dequantized values (FP8 block: GGUF has no
    FP8 type)."""
    assert source.quantization is not None
    kept = sorted(p.name for p in plans if p.stored is not None)
    dequantized = sorted(p.name for p in plans if p.dequantized is not None)
    out: dict[str, Any] = {"layout": source.quantization.layout}
    if kept:
        out["kept"] = {"tensors": len(kept), "as": "MXFP4", "how": "the release's blocks and exponents, repacked"}
    if dequantized:
        out["dequantized"] = {
            "tensors": len(dequantized),
            "how": f"{source.quantization.layout} dequantized in float32, then written as the quant says",
        }
    return out


def _k_quant_fallbacks(plans: list[TensorPlan], quant: QuantSpec, strict: bool) -> dict[str, str]:
    """For K-quants: the 2-D tensors whose rows are not whole 256-value super-blocks, for which
    llama.cpp's quantizer picks a fallback type itself (or, with `strict`, the error)."""
    if quant.llama_ftype is None:
        return {}
    out: dict[str, str] = {}
    for p in plans:
        if len(p.shape) > 1 and p.shape[-1] % QK_K:
            reason = f"row length {p.shape[-1]} is not a multiple of the K-quant block size {QK_K}"
            if strict:
                raise InvalidInput(
                    f"GGUF {quant.name}: tensor {p.source!r} ({p.name}) cannot be stored as a K-quant: {reason}",
                    code=Codes.GGUF_ROW_NOT_DIVISIBLE,
                    details={"tensor": p.source, "gguf_tensor": p.name, "row_length": p.shape[-1]},
                )
            out[p.name] = reason
    return out
