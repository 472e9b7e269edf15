"""What an architecture is, as data: one frozen `Architecture` record per family.

A record says how a family's config.json is read (`config`, a strict pydantic model of the keys it reads,
with their bounds), how its checkpoint is named and shaped (attention, MLP or mixture of experts, norms),
how it computes where that differs between families (activation, norm offset, embedding scale, per-layer
attention kinds and windows, rope), and what each target needs to write it (`targets`: a mapping, or the
reason the target cannot serve the family). Every stage reads the record; none keeps a table of its own
keyed by family. `layer_tensors` builds a decoder layer's tensors from the record's building blocks, so a
new family is a record and its tests (docs/extending.md).

Tensor kinds (`TensorKind`) are the roles a tensor plays, named as llama.cpp names them where it has a name
(`attn_q`, `ffn_gate_exps`, `ffn_gate_inp`): a target maps kinds, not a family's own spelling of them, and
which tensors a quantization scheme may quantize is a property of the kind (`LINEAR_KINDS`).

Sources, read for each family's record: transformers 5.17's modeling and configuration files (the names
`save_pretrained` writes, the config keys and their defaults) and llama.cpp's `convert_hf_to_gguf.py` (the
kinds and their GGUF names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from kiln.formats.architectures.config import FamilyConfig


class TensorKind(StrEnum):
    """The role of one tensor of a checkpoint (llama.cpp's name for it where it has one)."""

    TOKEN_EMBD = "token_embd"
    OUTPUT_NORM = "output_norm"
    OUTPUT = "output"
    ATTN_NORM = "attn_norm"  # before attention
    ATTN_Q = "attn_q"
    ATTN_K = "attn_k"
    ATTN_V = "attn_v"
    ATTN_QKV = "attn_qkv"  # q, k and v fused in one Linear (Phi-3)
    ATTN_OUTPUT = "attn_output"
    ATTN_Q_NORM = "attn_q_norm"  # per-head RMSNorm of the queries (Qwen3, Gemma 3)
    ATTN_K_NORM = "attn_k_norm"
    ATTN_POST_NORM = "attn_post_norm"  # after attention, before the residual add (Gemma 3)
    FFN_NORM = "ffn_norm"  # before the MLP
    FFN_POST_NORM = "ffn_post_norm"  # after the MLP, before the residual add (Gemma 3)
    FFN_GATE = "ffn_gate"
    FFN_UP = "ffn_up"
    FFN_GATE_UP = "ffn_gate_up"  # gate and up fused in one Linear (Phi-3): [2 x intermediate, hidden]
    FFN_DOWN = "ffn_down"
    FFN_GATE_INP = "ffn_gate_inp"  # the router of a mixture of experts: [experts, hidden]
    FFN_GATE_EXPS = "ffn_gate_exps"  # one expert's gate; GGUF stacks every expert's into one tensor
    FFN_UP_EXPS = "ffn_up_exps"
    FFN_DOWN_EXPS = "ffn_down_exps"
    FFN_GATE_SHEXP = "ffn_gate_shexp"  # the shared expert's gate, up and down
    FFN_UP_SHEXP = "ffn_up_shexp"
    FFN_DOWN_SHEXP = "ffn_down_shexp"
    FFN_GATE_INP_SHEXP = "ffn_gate_inp_shexp"  # the shared expert's sigmoid gate: [1, hidden]
    # Multi-head latent attention (DeepSeek-V2/V3, llama.cpp's `deepseek2`): queries through a low-rank latent
    # (q_a, its norm, q_b; one q_proj where the config has no q_lora_rank), keys and values through one compressed
    # latent with a shared rope key (kv_a_mqa: [kv_lora_rank + qk_rope_head_dim, hidden]), its norm, and its
    # up-projection to every head's no-rope key and value (kv_b).
    ATTN_Q_A = "attn_q_a"
    ATTN_Q_A_NORM = "attn_q_a_norm"
    ATTN_Q_B = "attn_q_b"
    ATTN_KV_A_MQA = "attn_kv_a_mqa"
    ATTN_KV_A_NORM = "attn_kv_a_norm"
    ATTN_KV_B = "attn_kv_b"
    # What llama.cpp's converter splits attn_kv_b into for its absorbed MLA (each head's key rows transposed, and
    # its value rows): GGUF names only, no checkpoint tensor has these kinds.
    ATTN_K_B = "attn_k_b"
    ATTN_V_B = "attn_v_b"
    ATTN_SINKS = "attn_sinks"  # one learned logit per head, a softmax column no value is read from (gpt-oss)
    FFN_EXP_PROBS_B = "exp_probs_b"  # the router's score-correction bias, added for the choice only (DeepSeek-V3)
    # Every expert's gate and up in one stacked tensor (gpt-oss: [experts, hidden, 2 x intermediate], interleaved).
    FFN_GATE_UP_EXPS = "ffn_gate_up_exps"
    # A multi-token-prediction layer's own tensors (DeepSeek-V3's layer 61, llama.cpp's `nextn`): its embedding,
    # the norms of the embedding and of the previous hidden state, their projection, its head and the head's norm.
    NEXTN_EMBED_TOKENS = "nextn.embed_tokens"
    NEXTN_ENORM = "nextn.enorm"
    NEXTN_HNORM = "nextn.hnorm"
    NEXTN_EH_PROJ = "nextn.eh_proj"
    NEXTN_SHARED_HEAD_NORM = "nextn.shared_head_norm"
    NEXTN_SHARED_HEAD_HEAD = "nextn.shared_head_head"


# The kinds that are Linear weights a quantization scheme may quantize (the router, norms and embeddings never).
LINEAR_KINDS: Final = frozenset(
    {
        TensorKind.ATTN_Q,
        TensorKind.ATTN_K,
        TensorKind.ATTN_V,
        TensorKind.ATTN_QKV,
        TensorKind.ATTN_OUTPUT,
        TensorKind.ATTN_Q_A,
        TensorKind.ATTN_Q_B,
        TensorKind.ATTN_KV_A_MQA,
        TensorKind.ATTN_KV_B,
        TensorKind.FFN_GATE,
        TensorKind.FFN_UP,
        TensorKind.FFN_GATE_UP,
        TensorKind.FFN_DOWN,
        TensorKind.FFN_GATE_EXPS,
        TensorKind.FFN_UP_EXPS,
        TensorKind.FFN_DOWN_EXPS,
        TensorKind.FFN_GATE_UP_EXPS,
        TensorKind.FFN_GATE_SHEXP,
        TensorKind.FFN_UP_SHEXP,
        TensorKind.FFN_DOWN_SHEXP,
    }
)
EXPERT_KINDS: Final = frozenset(
    {TensorKind.FFN_GATE_EXPS, TensorKind.FFN_UP_EXPS, TensorKind.FFN_DOWN_EXPS, TensorKind.FFN_GATE_UP_EXPS}
)
NORM_KINDS: Final = frozenset(
    {
        TensorKind.OUTPUT_NORM,
        TensorKind.ATTN_NORM,
        TensorKind.ATTN_Q_NORM,
        TensorKind.ATTN_K_NORM,
        TensorKind.ATTN_POST_NORM,
        TensorKind.FFN_NORM,
        TensorKind.FFN_POST_NORM,
        TensorKind.ATTN_Q_A_NORM,
        TensorKind.ATTN_KV_A_NORM,
        TensorKind.NEXTN_ENORM,
        TensorKind.NEXTN_HNORM,
        TensorKind.NEXTN_SHARED_HEAD_NORM,
    }
)

LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES: Final = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: its name, shape, kind, and the layer and expert it belongs to (None: none)."""

    name: str
    shape: tuple[int, ...]
    kind: TensorKind
    layer: int | None = None
    expert: int | None = None
    bias: bool = False  # a Linear's bias (its kind is the Linear's)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def quantizable(self) -> bool:
        """A Linear weight a scheme may quantize (never a bias, norm, embedding or router; nor a stack of every
        expert's weights in one 3-D tensor, which kiln's schemes do not write)."""
        return self.kind in LINEAR_KINDS and not self.bias and len(self.shape) == 2


# -- the record's parts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    """A decoder layer's attention as the checkpoint stores it.

    `bias`: q/k/v biases when config.json does not say (`attention_bias`); `qk_norm`: per-head RMSNorms of
    q and k after the projections; `fused_qkv`: one `qkv_proj` Linear; `partial_rotary`: rope rotates only
    the first `partial_rotary_factor` of each head's dimensions (Phi-3; families without it rotate every
    dimension whatever config.json says); `sliding`: where sliding-window layers come from ("none": every
    layer is full; "all": every layer slides when config.json gives a window; "layer_types": config.json's
    `layer_types`, or the family's pattern); `output_bias`: o_proj has a bias too where the q/k/v projections
    have theirs (gpt-oss; Qwen2's has none); `sinks`: one learned logit per head (`<prefix>.sinks` [heads]) joins
    each row's softmax and is dropped after it, so attention may attend to nothing (gpt-oss; the KV cache holds
    nothing for it).

    `kind` "mla": multi-head latent attention (DeepSeek-V2/V3), which config.json's MLA keys shape
    (`config.MlaShape`): `q_a_proj` [q_lora_rank, hidden], `q_a_layernorm`, `q_b_proj` [heads x (qk_nope_head_dim +
    qk_rope_head_dim), q_lora_rank] (one `q_proj` [heads x that, hidden] where q_lora_rank is null),
    `kv_a_proj_with_mqa` [kv_lora_rank + qk_rope_head_dim, hidden] (the compressed latent and one rope key every
    head shares), `kv_a_layernorm` [kv_lora_rank], `kv_b_proj` [heads x (qk_nope_head_dim + v_head_dim),
    kv_lora_rank] and `o_proj` [hidden, heads x v_head_dim]. A runtime caches the latent and the rope key, not
    every head's keys and values."""

    bias: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False
    partial_rotary: bool = False
    sliding: Literal["none", "all", "layer_types"] = "none"
    prefix: str = "self_attn"
    kind: Literal["gqa", "mla"] = "gqa"
    output_bias: bool = False
    sinks: bool = False

    def linears(self) -> tuple[str, ...]:
        """The names of the attention's Linears (any a config may choose: q_proj where MLA's q_lora_rank is null)."""
        if self.kind == "mla":
            return ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        return ("qkv_proj", "o_proj") if self.fused_qkv else ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Projections:
    """The names of a gated MLP's three Linears (`gate_proj`, `up_proj`, `down_proj`; Mixtral: w1, w3, w2)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts block: where its router and experts are, and how it routes.

    `block` is the MLP module's name in a layer (`mlp`, Mixtral's `block_sparse_moe`); the router is
    `<block>.<router>.weight` [experts, hidden] and expert e's Linears `<block>.<experts>.<e>.<proj>.weight`.
    `softmax_then_topk`: the router's softmax runs over every expert before the top-k are kept (Qwen3-MoE,
    Mixtral, as transformers computes them; False: a softmax over the chosen experts' logits, gpt-oss);
    `shared`: the name of a shared expert module beside the routed ones (None: none) and `shared_gate` its
    sigmoid gate's (None: the shared expert is added ungated). `router_bias`: the router has a bias
    (`<block>.<router>.bias` [experts]).

    `scoring` "sigmoid" (DeepSeek-V3): each expert's score is the sigmoid of its logit; the choice adds the
    router's `e_score_correction_bias` [experts] (`score_correction_bias`) to the scores, keeps the best
    `topk_group` of `n_group` groups of experts (a group ranked by its two best), then the top k of those; the
    chosen experts' weights are their uncorrected scores, renormalised where `norm_topk_prob`, times
    `routed_scaling_factor` (transformers' DeepseekV3TopkRouter).

    `layout` "fused": the checkpoint stacks every expert in one tensor per projection, as transformers' GptOssExperts
    holds them, inputs first: `<block>.<experts>.gate_up_proj` [experts, hidden, 2 x intermediate] with gate and up
    interleaved along its last axis (gate the even columns, up the odd), `down_proj` [experts, intermediate,
    hidden], and where `bias` their biases `gate_up_proj_bias` [experts, 2 x intermediate] and `down_proj_bias`
    [experts, hidden]. `activation` "clamped_swiglu" (gpt-oss): the gate clamped to at most `swiglu_limit`, up to
    [-swiglu_limit, swiglu_limit], and gate · sigmoid(1.702 · gate) · (up + 1)."""

    block: str = "mlp"
    router: str = "gate"
    experts: str = "experts"
    projections: Projections = Projections()
    softmax_then_topk: bool = True
    shared: str | None = None
    shared_gate: str | None = None
    router_bias: bool = False
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    score_correction_bias: bool = False
    layout: Literal["per_expert", "fused"] = "per_expert"
    bias: bool = False
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"


@dataclass(frozen=True)
class Mlp:
    """A decoder layer's MLP: a gated MLP (`fused_gate_up`: one `gate_up_proj`), and, in the layers the
    config makes sparse, `experts` instead."""

    projections: Projections = Projections()
    fused_gate_up: bool = False
    experts: Experts | None = None
    prefix: str = "mlp"
    activations: tuple[str, ...] = ("silu",)  # hidden_act values the family's checkpoints use


@dataclass(frozen=True)
class Norms:
    """RMSNorm conventions: `offset` 1 where the stored weight w scales by (1 + w) (Gemma); `sandwich`: a
    norm after attention and after the MLP besides the two before them (Gemma 3); `embedding_scale`:
    the embedding's output is multiplied by sqrt(hidden_size) (Gemma)."""

    offset: float = 0.0
    sandwich: bool = False
    embedding_scale: Literal["none", "sqrt_hidden"] = "none"


@dataclass(frozen=True)
class PredictionLayers:
    """Multi-token-prediction layers a release's checkpoint carries after the decoder's (`model.layers.<L + i>.*`
    for the config's `num_nextn_predict_layers` of them, DeepSeek-V3): each one a decoder layer with experts and
    its own embedding, two norms, a projection of both to the hidden size and a head (`nextn.*` kinds).

    kiln recognises them (ingest checks their names and shapes; a checkpoint may leave them out), keeps them in the
    source it holds and builds nothing from them: `reason` says why."""

    reason: str


# What a TensorRT-LLM model class may assume of a config (`TargetMapping.trtllm_assumes`): every layer routes to
# experts; the router renormalises over the chosen experts; no logit softcapping; no window shorter than the
# context (the class passes no attention window); the even layers slide and the odd ones attend to everything
# (the class sets each layer's window by its parity); under FP8 block scales, every width the loader cuts into
# 128-wide blocks is whole blocks (checked for FP8_BLOCK_SCALES only); every layer's rope is YaRN with the parameters
# the class reads from config.json's `rope_scaling` by key (which the checkpoint is then written with).
TrtllmAssumption = Literal[
    "every_layer_sparse",
    "norm_topk_prob",
    "no_softcapping",
    "no_binding_window",
    "even_layers_slide",
    "blocks_of_128",
    "yarn_rope_scaling",
]


@dataclass(frozen=True)
class TargetMapping:
    """What one target needs of a family: a mapping (target-specific data, see each target's table), or
    `refused`, the reason it cannot serve the family, which `kiln plan` gives as it refuses the recipe."""

    refused: str | None = None
    gguf_arch: str | None = None  # GGUF: llama.cpp's architecture name
    permute_qk: bool = False  # GGUF: q/k rows permuted to llama.cpp's interleaved rope layout
    names: tuple[tuple[TensorKind, str], ...] = ()  # GGUF: kinds whose tensor name is not the kind itself
    trtllm_architecture: str | None = None  # TensorRT-LLM: the architecture its PyTorch backend registers
    # TensorRT-LLM: QuantAlgos its model class cannot load for this family, with the reason (the fused MoE's limits
    # are the target's own, for every family with experts).
    trtllm_refused: tuple[tuple[str, str], ...] = ()
    # TensorRT-LLM: what its model class assumes of config.json (`TrtllmAssumption`), with the reason a model that
    # breaks it is refused.
    trtllm_assumes: tuple[tuple[TrtllmAssumption, str], ...] = ()
    # TensorRT-LLM legacy engines: examples/models/core/<converter>/convert_checkpoint.py of the pinned release, or
    # (None) why no release kiln pins converts the family.
    trtllm_converter: str | None = None
    trtllm_no_converter: str | None = None
    # TensorRT-LLM: release layouts (`formats.prequantized.LAYOUTS` names) its model class reads as the release stores
    # them, which the checkpoint is then written in (its `quantization_config` and stored tensor names, the release's
    # bytes kept): "fp8-block" (the fp8-block scheme as `quant_method: fp8` with `weight_scale_inv`), "mxfp4" (a
    # release's MXFP4 experts kept as `*_blocks` / `*_scales` beside the bf16 rest).
    trtllm_release_layouts: tuple[str, ...] = ()

    @property
    def supported(self) -> bool:
        return self.refused is None


def refused(reason: str) -> TargetMapping:
    return TargetMapping(refused=reason)


@dataclass(frozen=True)
class Architecture:
    """One family: its names, config schema, checkpoint layout, computation conventions and target mappings."""

    family: str  # kiln's name (`qwen3_moe`): in recipes' errors, GGUF mappings and docs
    hf_class: str  # config.json's `architectures[0]`
    model_types: tuple[str, ...]  # config.json's `model_type` values transformers builds this class from
    config: type[FamilyConfig] = field(repr=False)
    attention: Attention = Attention()
    mlp: Mlp = Mlp()
    norms: Norms = Norms()
    tied_default: bool = False
    # Layer-by-layer streaming through transformers' own decoder layers (`eval.runtimes.layer_stream`).
    streams: bool = True
    prediction_layers: PredictionLayers | None = None
    # config.json keys transformers computes without reading them (what its class hard-codes) but other runtimes
    # read, with the value transformers computes: every artifact's config.json is written with them where the
    # source's config leaves them out, so vLLM and TensorRT-LLM compute what the reference computed.
    implied_config: tuple[tuple[str, str | int], ...] = ()
    targets: dict[str, TargetMapping] = field(default_factory=dict)
    description: str = ""

    @property
    def is_moe(self) -> bool:
        return self.mlp.experts is not None

    def target(self, name: str) -> TargetMapping:
        """The family's mapping for target `name`; a target the record does not name is refused."""
        return self.targets.get(name) or refused(f"kiln has no {name} mapping for {self.hf_class}")
