"""A model's shape as it crosses the wire: what the pipeline records of a source, the registry keeps as a
release's `model_config`, and resolve sizes replicas from.

`ShapeRecord` is the one type for it. The pipeline builds it from a checked config.json
(`formats.architectures.shape.ModelShape.record`), stores it in the ingest stage's record and publishes its JSON;
the registry stores that JSON as it came. A release's `model_config` is publisher input from any tool,
so resolve reads it with `ShapeRecord.from_untrusted`: Hugging Face key names or this record's, each
value a positive int up to MAX_DIMENSION or counted as missing, and a sentence instead of a record
when the KV cache cannot be sized. What the pipeline writes reads back as the same record.

The arithmetic over it (parameters total and active, KV cache bytes, tensor-parallel degrees) has one home,
`placement`, which the pipeline, the registry and the routing renderer all import, so they count a model the
same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from kiln.core.errors import UnknownName

# Larger values are not an architecture (the largest models have ~10^2 layers, 10^5 hidden, 10^7
# positions): a release's model_config is publisher input, so anything past this is treated as missing.
MAX_DIMENSION = 2**24
# Architecture class names are short (`LlamaForCausalLM`); a longer string is not one.
MAX_ARCHITECTURE_LENGTH = 128

# KV cache bytes per element, by the KV cache's dtype.
KV_DTYPES: dict[str, int] = {"bf16": 2, "fp8": 1}

# Keys read from an untrusted config, Hugging Face names first; this record's names are among them.
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "layers")
_HEADS = ("num_attention_heads", "n_head", "heads")
_KV_HEADS = ("num_key_value_heads", "kv_heads", "num_kv_heads")
_HEAD_DIM = ("head_dim",)
_HIDDEN = ("hidden_size", "n_embd", "hidden")
_INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_hidden_size")
_VOCAB = ("vocab_size", "n_vocab")
_POSITIONS = ("max_position_embeddings", "n_positions")
# Mixtures of experts: routed experts, experts per token, each expert's width (Mixtral's is intermediate_size),
# a shared expert's width (Qwen2-MoE's `shared_expert_intermediate_size`, this record's name; DeepSeek's
# n_shared_experts times moe_intermediate_size), the sparse layers' count.
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERTS_PER_TOKEN = ("experts_per_token", "num_experts_per_tok")
_MOE_INTERMEDIATE = ("moe_intermediate_size",)
_SHARED_INTERMEDIATE = ("shared_expert_intermediate_size",)
_SLIDING_WINDOW = ("sliding_window",)
# Multi-head latent attention (DeepSeek-V2/V3): the KV cache keeps a kv_lora_rank latent and a qk_rope_head_dim rope
# key per token and layer; each query and key head is qk_nope_head_dim + qk_rope_head_dim wide, each value v_head_dim.
_MLA = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")

Dimension = Annotated[int, Field(gt=0, le=MAX_DIMENSION)]
# Fields written only where the model has them (experts, sliding windows).
_OPTIONAL_FIELDS = frozenset(
    {
        "num_experts",
        "experts_per_token",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "sparse_layers",
        "sliding_window",
        "sliding_layers",
        *_MLA,
    }
)


def kv_element_bytes(kv_dtype: str) -> int:
    """Bytes per KV cache element of `kv_dtype`; an unknown dtype names the known ones."""
    try:
        return KV_DTYPES[kv_dtype]
    except KeyError:
        raise UnknownName(
            f"unknown KV cache dtype {kv_dtype!r}; known: {', '.join(KV_DTYPES)}",
            details={"kv_dtype": str(kv_dtype)[:64], "known": list(KV_DTYPES)},
        ) from None


class ShapeRecord(BaseModel):
    """What sizing needs of a decoder-only model, dense or a mixture of experts; None where the source did not say.

    Layers, KV heads and head_dim size the KV cache and are always known; the rest bound prefill
    (parameters) and tensor parallelism (heads). A mixture of experts gives its experts, how many run per
    token and each one's width, and how many of the layers are sparse (the rest dense, `intermediate_size`
    wide); sliding-window layers (`sliding_layers` of them) keep at most `sliding_window` tokens of KV. Multi-head
    latent attention (`kv_lora_rank` and `qk_rope_head_dim` given) caches one latent of kv_lora_rank +
    qk_rope_head_dim per token and layer instead of every KV head's keys and values; its KV heads are its heads, its
    head_dim each query's and key's (no-rope and rope parts), `v_head_dim` each value's and `q_lora_rank` the
    query's latent (None: none).
    Strict and closed: `"8"` is not a size, and a field this record does not have is an error, not something
    carried along.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    architecture: str | None = Field(default=None, min_length=1, max_length=MAX_ARCHITECTURE_LENGTH)
    num_layers: Dimension
    num_attention_heads: Dimension | None = None
    num_kv_heads: Dimension
    head_dim: Dimension
    hidden_size: Dimension | None = None
    intermediate_size: Dimension | None = None
    vocab_size: Dimension | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: Dimension | None = None
    num_experts: Dimension | None = None
    experts_per_token: Dimension | None = None
    moe_intermediate_size: Dimension | None = None
    shared_expert_intermediate_size: Dimension | None = None
    sparse_layers: Dimension | None = None  # None with experts: every layer
    sliding_window: Dimension | None = None
    sliding_layers: Dimension | None = None  # None with a window: every layer
    q_lora_rank: Dimension | None = None
    kv_lora_rank: Dimension | None = None
    qk_rope_head_dim: Dimension | None = None
    v_head_dim: Dimension | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dense fields always, the experts' and windows' only where given: a dense model's record is the
        JSON stored releases (and stage records, by digest) already hold."""
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if k not in _OPTIONAL_FIELDS or v is not None}

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None and self.experts_per_token is not None

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: its cache is one latent per token and layer."""
        return self.kv_lora_rank is not None and self.qk_rope_head_dim is not None

    @classmethod
    def from_untrusted(cls, config: object) -> ShapeRecord | str:
        """The shape a release's `model_config` describes, or a sentence saying what is missing.

        The config is untrusted publisher input, a Hugging Face config.json or this record's JSON: a
        value that is not an int, a bool, ≤ 0 or above MAX_DIMENSION counts as missing. KV heads default
        to the attention heads and head_dim to hidden_size / heads, as transformers reads them. Layers,
        KV heads and head_dim are needed (the KV cache); the rest are None when absent.
        """
        if not isinstance(config, Mapping):
            return "the release's model_config is not an object, so the KV cache is not counted"
        layers = _first_dimension(config, _LAYERS)
        heads = _first_dimension(config, _HEADS)
        kv_heads = _first_dimension(config, _KV_HEADS) or heads
        head_dim = _first_dimension(config, _HEAD_DIM)
        hidden = _first_dimension(config, _HIDDEN)
        mla = {key: _first_dimension(config, (key,)) for key in _MLA}
        nope = _first_dimension(config, ("qk_nope_head_dim",))
        is_mla = mla["kv_lora_rank"] is not None and mla["qk_rope_head_dim"] is not None
        if is_mla and nope is not None:  # MLA's query and key heads (transformers writes head_dim as the rope's)
            head_dim = nope + mla["qk_rope_head_dim"]  # type: ignore[operator]
        elif not is_mla:
            mla = dict.fromkeys(_MLA)
        if head_dim is None and hidden is not None and heads and hidden % heads == 0:
            head_dim = hidden // heads
        if layers is None or kv_heads is None or head_dim is None:
            missing = [
                name
                for name, value in (
                    ("num_hidden_layers", layers),
                    ("num_key_value_heads", kv_heads),
                    ("head_dim", head_dim),
                )
                if value is None
            ]
            return "the release's model_config lacks " + ", ".join(missing) + ", so the KV cache is not counted"
        tied = config.get("tie_word_embeddings")
        experts = _first_dimension(config, _EXPERTS)
        per_token = _first_dimension(config, _EXPERTS_PER_TOKEN)
        moe = experts is not None and per_token is not None and per_token <= experts
        window = _first_dimension(config, _SLIDING_WINDOW)
        if config.get("use_sliding_window") is False:  # Qwen's: a window given but not used
            window = None
        sliding = _sliding_layers(config, layers) if window is not None else None
        return cls(
            architecture=_architecture(config),
            num_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=_first_dimension(config, _INTERMEDIATE),
            vocab_size=_first_dimension(config, _VOCAB),
            tie_word_embeddings=tied if isinstance(tied, bool) else False,
            max_position_embeddings=_first_dimension(config, _POSITIONS),
            num_experts=experts if moe else None,
            experts_per_token=per_token if moe else None,
            # Mixtral's experts are intermediate_size wide; it gives no moe_intermediate_size
            moe_intermediate_size=(_first_dimension(config, _MOE_INTERMEDIATE) if moe else None),
            shared_expert_intermediate_size=_shared_width(config) if moe else None,
            sparse_layers=_sparse_layers(config, layers) if moe else None,
            sliding_window=window if sliding != 0 else None,
            sliding_layers=sliding or None,
            **mla,
        )


def _first_dimension(config: Mapping[Any, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_DIMENSION:
            return value
    return None


def _shared_width(config: Mapping[Any, Any]) -> int | None:
    """A shared expert's width: Qwen2-MoE's `shared_expert_intermediate_size` (this record's name too), else
    DeepSeek's `n_shared_experts` experts of `moe_intermediate_size`, run as one MLP that wide."""
    width = _first_dimension(config, _SHARED_INTERMEDIATE)
    shared, expert = _first_dimension(config, ("n_shared_experts",)), _first_dimension(config, _MOE_INTERMEDIATE)
    if width is None and shared is not None and expert is not None and shared * expert <= MAX_DIMENSION:
        return shared * expert
    return width


def _architecture(config: Mapping[Any, Any]) -> str | None:
    """This record's `architecture`, or the one entry of config.json's `architectures`."""
    value = config.get("architecture")
    if value is None:
        listed = config.get("architectures")
        value = listed[0] if isinstance(listed, list) and len(listed) == 1 else None
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ARCHITECTURE_LENGTH else None


def _sliding_layers(config: Mapping[Any, Any], layers: int) -> int | None:
    """How many layers slide: this record's `sliding_layers`, else config.json's `layer_types` counted, else
    every layer (Mistral's and Mixtral's window applies to all); 0 when `layer_types` lists none."""
    counted = _first_dimension(config, ("sliding_layers",))
    if counted is not None:
        return min(counted, layers)
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == layers:
        return sum(k == "sliding_attention" for k in kinds)
    pattern = _first_dimension(config, ("sliding_window_pattern",))  # Gemma 3's: every pattern-th layer is global
    if pattern is not None:
        return layers - layers // pattern
    return None


def _sparse_layers(config: Mapping[Any, Any], layers: int) -> int | None:
    """How many layers route to experts: this record's `sparse_layers`, else Qwen-MoE's rule (every
    `decoder_sparse_step`-th layer not in `mlp_only_layers`), else DeepSeek's (all after `first_k_dense_replace`);
    None: every layer."""
    counted = _first_dimension(config, ("sparse_layers",))
    if counted is not None:
        return min(counted, layers)
    step = _first_dimension(config, ("decoder_sparse_step",))
    dense = config.get("mlp_only_layers")
    if step is not None or isinstance(dense, list):
        only = {i for i in dense if isinstance(i, int)} if isinstance(dense, list) else set()
        return sum(1 for i in range(layers) if i not in only and (i + 1) % (step or 1) == 0) or None
    first_dense = config.get("first_k_dense_replace")
    if isinstance(first_dense, int) and not isinstance(first_dense, bool) and 0 <= first_dense < layers:
        return layers - first_dense
    return None
