"""config.json as kiln reads it: the keys every family shares (`FamilyConfig`), each family's own keys in its
record's subclass, and what they come to (`MoeShape`, `RopeSpec`, per-layer attention kinds).

Strict: `"false"` is not a bool, `64.0` is not an int, `true` is not a number, `1e400` (inf) and NaN are not
floats. Keys kiln does not read are ignored. Explicit `null` means "absent" only where transformers reads it
that way (head_dim, num_key_value_heads, sliding_window, token ids, rope_scaling, rope_parameters).
Validators only reject; what a family derives from its keys (which layers are sparse, which slide, each
layer type's rope) is computed by the methods below, as transformers' own config classes compute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Final, cast

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, field_validator, model_validator

from kiln.formats.architectures.record import LAYER_TYPES, LayerType
from kiln.formats.prequantized import SourceQuantization, read_quantization_config

# Upper bounds on config.json's sizes: several times the largest public models (vocab 262,144, hidden 16,384,
# intermediate 53,248, 126 layers, 128 heads, head_dim 256, 384 experts, context 10M), so a real model never
# meets them and a hostile config cannot ask for a billion layers.
CONFIG_LIMITS: Final[dict[str, int]] = {
    "vocab_size": 2**22,
    "hidden_size": 2**16,
    "intermediate_size": 2**18,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 2**24,
    "sliding_window": 2**24,
    "num_experts": 4096,
    "num_experts_per_tok": 4096,
    "moe_intermediate_size": 2**18,
    "decoder_sparse_step": 1024,
    "lora_rank": 2**16,  # MLA's q_lora_rank and kv_lora_rank (DeepSeek-V3: 1,536 and 512)
    "shared_experts": 64,
    "prediction_layers": 16,
}
MAX_TOKEN_ID: Final = 2**31 - 1


def size(name: str, default: Any = ...) -> Any:
    """A positive size bounded by CONFIG_LIMITS; required unless given a default."""
    return Field(default, gt=0, le=CONFIG_LIMITS[name])


_RopeTheta = Annotated[float, Field(gt=0, le=1e12, allow_inf_nan=False)]
_TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
_Positive = Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]


class RopeParameters(BaseModel):
    """`rope_parameters` (transformers 5) or `rope_scaling`: the keys kiln reads; others pass through."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    rope_theta: _RopeTheta | None = None
    rope_type: str | None = Field(default=None, max_length=64)
    type: str | None = Field(default=None, max_length=64)
    factor: _Positive | None = None
    partial_rotary_factor: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)

    @property
    def kind(self) -> str:
        return self.rope_type or self.type or "default"


@dataclass(frozen=True)
class RopeSpec:
    """One layer type's rotary embedding: its base, its scaling (`default`: none) and factor, and the other
    parameters of that scaling as config.json gives them (llama3's, yarn's), sorted."""

    theta: float
    scaling: str = "default"
    factor: float | None = None
    params: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class MoeShape:
    """A mixture of experts as a config makes it: `experts` routed experts of `intermediate_size` each, of
    which `experts_per_token` run per token (renormalised over the chosen when `norm_topk_prob`), a shared
    expert of `shared_intermediate_size` (0: none), in the layers `sparse_layers` (the others dense).

    Group-limited routing (DeepSeek-V3): the experts in `groups` groups, of which the `topk_groups` best are
    chosen from; the chosen experts' weights multiplied by `routed_scaling_factor` (the record's `Experts` says
    how the scores are made)."""

    experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_intermediate_size: int = 0
    groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention as a config makes it (the record's `Attention` "mla"): queries through a
    `q_lora_rank` latent (None: one q_proj), keys and values through a `kv_lora_rank` latent, each head's query
    and key `qk_nope_head_dim` without rope and `qk_rope_head_dim` with it (the rope part of the key one for every
    head), each head's value `v_head_dim`; `rope_interleave`: the rope rotates interleaved pairs (x0, x1), (x2, x3),
    ... of the rope part (transformers' default for DeepSeek-V3), else its halves."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """The elements one token keeps in one layer's cache: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _release_quantization(qc: object) -> SourceQuantization | None:
    """`quantization_config` read by `formats.prequantized`, the one reader of it: a release layout's (FP8 block,
    MXFP4) checked, another method's (a compressed-tensors bundle) None. Its errors (SOURCE_QUANTIZATION_INVALID,
    naming the field) reach the caller as they are: pydantic wraps only a ValueError or an AssertionError."""
    return read_quantization_config(qc, other_methods=True)


_NOT_NULL: Final = (
    "rope_theta",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "hidden_act",
    "use_sliding_window",
    "mlp_bias",
    "partial_rotary_factor",
)


class FamilyConfig(BaseModel):
    """Every config.json key kiln reads for any family, with exact types and bounds; a family's record names a
    subclass that adds its own keys and says what they come to."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    # The config key naming the activation, and the family's default for it.
    activation_key: ClassVar[str] = "hidden_act"

    architectures: list[str] = Field(min_length=1, max_length=1)
    vocab_size: int = size("vocab_size")
    hidden_size: int = size("hidden_size")
    intermediate_size: int = size("intermediate_size")
    num_hidden_layers: int = size("num_hidden_layers")
    num_attention_heads: int = size("num_attention_heads")
    num_key_value_heads: int | None = size("num_key_value_heads", None)
    head_dim: int | None = size("head_dim", None)
    rope_theta: _RopeTheta | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = Field(default=1e-6, gt=0, lt=1, allow_inf_nan=False)
    max_position_embeddings: int = size("max_position_embeddings", 2048)
    tie_word_embeddings: bool | None = None  # absent: the family's default
    attention_bias: bool | None = None  # absent: the family's default
    hidden_act: str = Field(default="silu", max_length=64)
    use_sliding_window: bool = False
    sliding_window: int | None = size("sliding_window", None)
    layer_types: list[str] | None = Field(default=None, max_length=CONFIG_LIMITS["num_hidden_layers"])
    mlp_bias: bool = False
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    bos_token_id: _TokenId | None = None
    eos_token_id: _TokenId | list[_TokenId] | None = None
    pad_token_id: _TokenId | None = None
    unk_token_id: _TokenId | None = None
    # How the release stores its weights (None: as the SafeTensors headers say).
    quantization_config: Annotated[SourceQuantization | None, PlainValidator(_release_quantization)] = None

    @field_validator(*_NOT_NULL, mode="before", check_fields=False)
    @classmethod
    def _not_null(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("must not be null (leave the key out for the default)")
        return v

    @field_validator("eos_token_id", mode="before")
    @classmethod
    def _token_ids(cls, v: Any) -> Any:
        def ok(i: Any) -> bool:
            return type(i) is int and 0 <= i <= MAX_TOKEN_ID

        if v is None or ok(v) or (isinstance(v, list) and all(ok(i) for i in v)):
            return v
        raise ValueError(f"must be a token id (0..{MAX_TOKEN_ID}), a list of them, or null")

    @field_validator("layer_types")
    @classmethod
    def _layer_types(cls, v: list[str] | None) -> list[str] | None:
        bad = next((t for t in v or () if t not in LAYER_TYPES), None)
        if bad is not None:
            raise ValueError(f"each entry must be one of {', '.join(LAYER_TYPES)}, got {bad[:64]!r}")
        return v

    @field_validator("rope_parameters", "rope_scaling")
    @classmethod
    def _rope(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        nested = {k: p for k, p in v.items() if k in LAYER_TYPES}
        if nested and len(nested) != len(v):
            raise ValueError("must be one rope's parameters, or one per layer type, not both")
        for p in nested.values() or (v,):
            if not isinstance(p, dict):
                raise ValueError(f"each layer type's parameters must be an object, got {type(p).__name__}")
            RopeParameters.model_validate(p)
        return v

    @model_validator(mode="after")
    def _layer_count(self) -> FamilyConfig:
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
            )
        return self

    # -- what the keys come to (overridden by families whose keys say more) ------------------------------------

    def activation(self) -> str:
        return self.hidden_act

    def layer_kinds(self) -> tuple[LayerType, ...]:
        """Each layer's attention: config.json's `layer_types` where given, else every layer full."""
        kinds = self.layer_types if self.layer_types is not None else ["full_attention"] * self.num_hidden_layers
        return cast(tuple[LayerType, ...], tuple(kinds))  # each checked by _layer_types

    def window(self) -> int | None:
        """The sliding window of the sliding layers (None where no layer slides)."""
        return self.sliding_window if "sliding_attention" in self.layer_kinds() else None

    def moe(self) -> MoeShape | None:
        return None

    def mla(self) -> MlaShape | None:
        """Multi-head latent attention's sizes (None: the family's attention is grouped-query)."""
        return None

    def prediction_layers(self) -> int:
        """The multi-token-prediction layers the release's checkpoint may carry after the decoder's (0: none)."""
        return 0

    def rope(self) -> dict[LayerType, RopeSpec]:
        """Each layer type's rope: `rope_scaling` where given (transformers' `convert_rope_params_to_dict` lets it
        replace `rope_parameters`), else `rope_parameters` (one for all, or one per layer type), with `rope_theta`;
        the base defaults to 10,000 as transformers' does."""
        kinds = sorted(set(self.layer_kinds()))
        params = self.rope_scaling or self.rope_parameters or {}
        out: dict[LayerType, RopeSpec] = {}
        for kind in kinds:
            if kind in params:  # one per layer type: its own base first
                p = RopeParameters.model_validate(params[kind])
                theta = p.rope_theta if p.rope_theta is not None else self.rope_theta
            else:
                p = RopeParameters.model_validate({k: v for k, v in params.items() if k not in LAYER_TYPES})
                theta = self.rope_theta if self.rope_theta is not None else p.rope_theta
            out[kind] = rope_spec(p, theta if theta is not None else 10000.0)
        return out

    def rotary_fraction(self) -> float:
        """The share of each head's dimensions rope rotates (Phi-3 and others: `partial_rotary_factor`)."""
        params = self.rope_parameters or {}
        nested = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        return float(nested) if isinstance(nested, float) and 0 < nested <= 1 else self.partial_rotary_factor


def rope_spec(p: RopeParameters, theta: float) -> RopeSpec:
    skip = {"rope_theta", "rope_type", "type", "factor", "partial_rotary_factor"}
    extra = tuple(sorted((k, v) for k, v in (p.model_extra or {}).items() if k not in skip))
    return RopeSpec(theta=theta, scaling=p.kind, factor=p.factor, params=extra)


def sqrt_hidden(hidden_size: int) -> float:
    """Gemma's embedding multiplier, as transformers computes it (in the activations' dtype at run time)."""
    return math.sqrt(hidden_size)
