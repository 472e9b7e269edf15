"""A model's shape as it crosses the wire: what the pipeline records of a source, the registry keeps as a
release's `model_config`, and resolve sizes replicas from.

`ShapeRecord` is the one type for it. The pipeline builds it from a checked config.json
(`formats.hf_model.ModelShape.record`), stores it in the ingest stage's record and publishes its JSON;
the registry stores that JSON as it came. A release's `model_config` is publisher input from any tool,
so resolve reads it with `ShapeRecord.from_untrusted`: Hugging Face key names or this record's, each
value a positive int up to MAX_DIMENSION or counted as missing, and a sentence instead of a record
when the KV cache cannot be sized. What the pipeline writes reads back as the same record.

The sizing arithmetic (parameters, KV cache bytes) lives here beside the fields it reads, so the
pipeline and the registry count a model the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from core.errors import UnknownName

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

Dimension = Annotated[int, Field(gt=0, le=MAX_DIMENSION)]


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
    """What sizing needs of a decoder-only (Llama-family) model; None where the source did not say.

    Layers, KV heads and head_dim size the KV cache and are always known; the rest bound prefill
    (parameters) and tensor parallelism (heads). Strict and closed: `"8"` is not a size, and a field
    this record does not have is an error, not something carried along.
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
        )

    def parameters(self) -> int | None:
        """Parameters of a Llama-family model: q/k/v/o, gate/up/down, two norms per layer, the final
        norm, embeddings and lm_head unless tied (biases, where a family has them, are not counted:
        under 0.01 %). None when hidden, heads, intermediate or vocab are unknown."""
        heads, h, ff, vocab = self.num_attention_heads, self.hidden_size, self.intermediate_size, self.vocab_size
        if heads is None or h is None or ff is None or vocab is None:
            return None
        q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * ff + 2 * h
        return self.num_layers * per_layer + h + vocab * h * (1 if self.tie_word_embeddings else 2)

    def kv_cache_bytes(self, context: int, concurrency: int, kv_dtype: str = "bf16") -> int:
        """The replica's KV cache: keys and values of every layer for `context` × `concurrency` tokens."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_element_bytes(kv_dtype)
        return per_token * context * concurrency


def _first_dimension(config: Mapping[Any, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_DIMENSION:
            return value
    return None


def _architecture(config: Mapping[Any, Any]) -> str | None:
    """This record's `architecture`, or the one entry of config.json's `architectures`."""
    value = config.get("architecture")
    if value is None:
        listed = config.get("architectures")
        value = listed[0] if isinstance(listed, list) and len(listed) == 1 else None
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ARCHITECTURE_LENGTH else None
