"""What the orbax artifact's JAX forward computes, as data: `forward_config` reads it from a model's shape and its
family's record (never its family's name) and refuses, with ORBAX_UNSUPPORTED and the reason, what the forward would
compute differently from transformers 5.17.

Nothing here imports jax, numpy or torch: recipe checks and `kiln plan` call `forward_config` (through the target's
model check). YaRN's correction range and attention factor are computed here in Python, as transformers'
`_compute_yarn_parameters` computes them (`math`, float64); its float32 frequencies in the forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.formats.architectures.config import MlaShape, RopeSpec, sqrt_hidden
from kiln.formats.architectures.shape import ModelShape

# config.json's activation -> the forward's (transformers' ACT2FN names).
ACTIVATIONS: Final[dict[str, str]] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# linear: positions divided by `factor`; yarn: transformers' `_compute_yarn_parameters`.
ROPE_SCALINGS: Final = ("default", "linear", "yarn")
# transformers' GptOssExperts: gate · sigmoid(alpha · gate), the record's "clamped_swiglu".
SWIGLU_ALPHA: Final = 1.702

Router = Literal["softmax_topk", "topk_softmax", "sigmoid_groups"]


@dataclass(frozen=True)
class Yarn:
    """YaRN's rope (transformers' `_compute_yarn_parameters`): frequencies blended between `theta`'s own and theirs
    divided by `factor`, by a ramp over the rotary pairs from `low` to `high` (the correction range of beta_fast and
    beta_slow rotations in `original_max_position_embeddings`, floored and ceiled unless `truncate` is false); cos
    and sin times `attention_factor`."""

    factor: float
    low: float
    high: float
    attention_factor: float


@dataclass(frozen=True)
class LayerConfig:
    """What differs between decoder layers: the window its queries see (None: every earlier key), its rope's base,
    linear scaling factor (1: none) or YaRN, and whether its MLP routes to experts."""

    window: int | None
    rope_theta: float
    rope_factor: float = 1.0
    sparse: bool = False
    yarn: Yarn | None = None


@dataclass(frozen=True)
class ForwardConfig:
    """The hyper-parameters of the JAX forward (hashable: it is a static argument of `jax.jit`), from the model's
    `ModelShape` (which it holds, as it is) and its family's record: what the forward computes beyond the sizes."""

    shape: ModelShape  # the sizes (head_dim: each query's and key's width; MLA: qk_nope_head_dim + qk_rope_head_dim)
    rotary_dim: int  # the dimensions of each head rope rotates (Phi-3's partial rotary, MLA's rope part: fewer)
    attention_scale: float  # head_dim^-1/2, Gemma's query_pre_attn_scalar^-1/2, MLA's with YaRN's mscale squared
    activation: str = "silu"  # of the gated MLP and the experts: silu or gelu_tanh
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorms scale by (offset + w) (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
    embedding_scale: float | None = None  # the embedding's rows times this, in the compute dtype (Gemma)
    experts: int = 0  # routed experts of a sparse layer (0: none)
    experts_per_token: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    layers: tuple[LayerConfig, ...] = ()
    mla: MlaShape | None = None  # multi-head latent attention (DeepSeek-V3), else grouped-query
    sinks: bool = False  # one learned logit per head joins each softmax and is dropped after it (gpt-oss)
    # softmax_topk: softmax over every expert, then the top k; topk_softmax: the top k logits, then a softmax over
    # them (gpt-oss); sigmoid_groups: DeepSeek-V3's sigmoid scores, corrected for the choice within the best groups.
    router: Router = "softmax_topk"
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts: bool = False  # an ungated MLP beside the routed experts, on every token
    swiglu_limit: float | None = None  # the experts' clamped SwiGLU (gpt-oss), else act(gate) * up
    swiglu_alpha: float = SWIGLU_ALPHA


def _unsupported(message: str, **details: Any) -> InvalidInput:
    return InvalidInput(f"orbax: {message}", code=Codes.ORBAX_UNSUPPORTED, details=details)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `scale` times longer (transformers' `get_mscale`, `yarn_get_mscale`)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeSpec, dim: int, config: Mapping[str, Any], max_positions: int, kind: str) -> Yarn:
    """`rope`'s YaRN as transformers 5.17 computes it for a rotary width `dim`. The pretraining length is
    config.json's top-level `original_max_position_embeddings` where it has one, else the rope's, else
    `max_position_embeddings` (transformers' `standardize_rope_params`)."""
    p = dict(rope.params)
    original = config.get("original_max_position_embeddings", p.get("original_max_position_embeddings", max_positions))
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise _unsupported(
            f"yarn rope without a positive original_max_position_embeddings ({kind} layers)", rope_type="yarn"
        )
    factor = rope.factor if rope.factor is not None else max_positions / original
    numbers = {k: p.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow")}
    bad = sorted(
        k for k, v in numbers.items() if v is not None and (isinstance(v, bool) or not isinstance(v, int | float))
    )
    if bad or not isinstance(p.get("truncate", True), bool):
        raise _unsupported(
            f"yarn rope parameter(s) {', '.join(bad) or 'truncate'} of an unexpected type", rope_type="yarn"
        )
    attention = numbers["attention_factor"]
    mscale, mscale_all = numbers["mscale"], numbers["mscale_all_dim"]
    if attention is None:
        attention = (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            if mscale and mscale_all
            else yarn_mscale(factor)
        )
    beta_fast, beta_slow = numbers["beta_fast"] or 32, numbers["beta_slow"] or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return Yarn(float(factor), float(max(low, 0)), float(min(high, dim - 1)), float(attention))


def _attention_scale(shape: ModelShape) -> float:
    """transformers' softmax scale: head_dim^-1/2 (Gemma: query_pre_attn_scalar^-1/2); MLA's qk_head_dim^-1/2 times
    YaRN's mscale(factor, mscale_all_dim) squared where the rope is scaled (DeepseekV3Attention)."""
    scalar = shape.query_pre_attn_scalar
    scale = float((scalar if scalar is not None else shape.head_dim) ** -0.5)
    if shape.mla is None:
        return scale
    rope = shape.rope_for(shape.layer_type(0))  # MLA's one rope (DeepSeek-V3's layers are all full)
    if rope.scaling != "default":
        mscale_all = dict(rope.params).get("mscale_all_dim", 0)
        if mscale_all:
            if rope.factor is None:
                raise _unsupported("MLA with a scaled rope whose factor is absent", rope_type=rope.scaling)
            scale *= yarn_mscale(rope.factor, mscale_all) ** 2
    return scale


def forward_config(shape: ModelShape, config: Mapping[str, Any]) -> ForwardConfig:
    """The forward's config from a model's checked shape (and config.json, for the keys the shape does not carry);
    refuses, with ORBAX_UNSUPPORTED and the reason, what the JAX forward would compute differently from
    transformers.

    Everything family-specific comes from the family's record (`shape.arch`) and the shape: q/k norms, norm
    offset and sandwich norms, the embedding scale, activation, attention scale, multi-head latent attention, sinks,
    each layer's window and rope (`ModelShape.rope_for` of its type), partial rotary, experts (their router, shared
    experts and activation). `kiln plan` calls this (through the target's model check) and the export again before
    writing anything, so an artifact is only planned for models its runtime serves exactly."""
    arch = shape.arch
    activation = ACTIVATIONS.get(shape.hidden_act)
    if activation is None:
        raise _unsupported(
            f"activation {shape.hidden_act!r} is not computed (known: {', '.join(ACTIVATIONS)})",
            activation=shape.hidden_act,
        )
    if config.get("mlp_bias"):
        raise _unsupported("MLP biases are not computed")
    if shape.rotary_fraction != 1.0 and not arch.attention.partial_rotary:
        raise _unsupported(
            f"partial_rotary_factor={shape.rotary_fraction} on {shape.architecture}, whose transformers class "
            "rotates every dimension",
            partial_rotary_factor=shape.rotary_fraction,
        )
    mla = shape.mla
    rotary_dim = mla.qk_rope_head_dim if mla is not None else int(shape.head_dim * shape.rotary_fraction)
    if rotary_dim < 2 or rotary_dim % 2:
        raise _unsupported(f"rope would rotate {rotary_dim} dimensions of each head; it rotates pairs")
    if shape.attn_logit_softcapping is not None:
        # transformers 5.17's Gemma 3 attention does not pass it on (Gemma 2's does): no reference to match.
        raise _unsupported("attn_logit_softcapping is set; transformers' Gemma 3 does not apply it")
    moe = shape.moe
    experts = arch.mlp.experts
    router: Router = "softmax_topk"
    if moe is not None and experts is not None:
        if experts.shared_gate is not None:
            raise _unsupported("a shared expert behind a sigmoid gate is not computed")
        if experts.scoring == "sigmoid":
            router = "sigmoid_groups"
        elif not experts.softmax_then_topk:
            router = "topk_softmax"
    layers = []
    for i in range(shape.num_layers):
        kind = shape.layer_type(i)
        rope = shape.rope_for(kind)
        if rope.scaling not in ROPE_SCALINGS:
            raise _unsupported(
                f"rope scaling {rope.scaling!r} ({kind} layers) is not implemented (known: {', '.join(ROPE_SCALINGS)})",
                rope_type=rope.scaling,
            )
        if rope.scaling == "linear" and rope.factor is None:
            raise _unsupported(f"linear rope scaling without a factor ({kind} layers)", rope_type=rope.scaling)
        factor = rope.factor if rope.scaling == "linear" and rope.factor is not None else 1.0
        yarn = _yarn(rope, rotary_dim, config, shape.max_position_embeddings, kind) if rope.scaling == "yarn" else None
        window = shape.sliding_window if kind == "sliding_attention" else None
        layers.append(LayerConfig(window, rope.theta, factor, shape.is_sparse(i), yarn))
    return ForwardConfig(
        shape=shape,
        rotary_dim=rotary_dim,
        attention_scale=_attention_scale(shape),
        activation=activation,
        qk_norm=arch.attention.qk_norm,
        norm_offset=arch.norms.offset,
        sandwich_norms=arch.norms.sandwich,
        embedding_scale=sqrt_hidden(shape.hidden_size) if arch.norms.embedding_scale == "sqrt_hidden" else None,
        experts=moe.experts if moe is not None else 0,
        experts_per_token=moe.experts_per_token if moe is not None else 0,
        norm_topk_prob=moe.norm_topk_prob if moe is not None else False,
        layers=tuple(layers),
        mla=mla,
        sinks=arch.attention.sinks,
        router=router,
        expert_groups=moe.groups if moe is not None else 1,
        topk_groups=moe.topk_groups if moe is not None else 1,
        routed_scaling_factor=moe.routed_scaling_factor if moe is not None else 1.0,
        shared_experts=bool(
            moe is not None and experts is not None and experts.shared and moe.shared_intermediate_size
        ),
        swiglu_limit=shape.swiglu_limit if experts is not None and experts.activation == "clamped_swiglu" else None,
    )
