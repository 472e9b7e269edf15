"""The orbax artifact as data: its files, the dtype of each tensor per quant, and the model features it serves.

    <artifact>/
      checkpoint/        orbax checkpoint (v1 layout): the weights as a PyTree of arrays, one per
                         tensor, keyed by the source's own names split at '.' (model/layers/0/...)
      config.json        the source's model config, unchanged
      weights.json       format version, quant, and every tensor's dtype and shape
      sharding.json      the mesh and one partition spec per tensor (`targets.orbax.sharding`)
      tokenizer files, generation_config.json (copied)

Weights keep the source's `[out, in]` orientation; the forward contracts over `in`. Quant `int8`
stores each Linear weight as int8 `weight` plus a float32 `weight_scale` per output channel, and the
weight is `weight * weight_scale[:, None]`; everything else (embeddings, norms, biases, lm_head)
is bfloat16, as for bf16.

Nothing here imports jax, numpy or torch: recipe checks and `kiln plan` import `targets`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from core.errors import InvalidInput, KilnError
from core.hardware import PROFILES
from formats.architectures.shape import ModelShape
from quant.catalog import SCHEMES
from quant.schemes import Verdict
from targets.orbax.sharding import mesh_from_params

FORMAT: Final = "orbax-checkpoint"
FORMAT_VERSION: Final = 1
CHECKPOINT_DIR: Final = "checkpoint"
CONFIG_FILE: Final = "config.json"
WEIGHTS_FILE: Final = "weights.json"
SHARDING_FILE: Final = "sharding.json"
COPIED_FILES: Final = ("generation_config.json",)  # besides the source's tokenizer files
SCALE_SUFFIX: Final = "_scale"  # `<module>.weight` -> `<module>.weight_scale`


def _weight_only_int8() -> str:
    """The shared scheme whose values the int8 checkpoint holds: int8 weights per output channel, 16-bit activations.

    Found by what it is, not by name, so the quantize stage computes it once for every target (hf-bundle
    packs the same values for vLLM) whatever the scheme is called.
    """
    for scheme in SCHEMES.values():
        w = scheme.weights
        if (
            w is not None
            and (w.num_bits, w.type, w.strategy) == (8, "int", "channel")
            and scheme.input_activations is None
            and scheme.method == "rtn"
        ):
            return scheme.name
    raise KilnError("no int8 weight-only per-channel scheme is registered", code="TARGET_NOT_REGISTERED")


INT8: Final = _weight_only_int8()


@dataclass(frozen=True)
class QuantLayout:
    """How one quant stores a model: the dtype of quantized Linear weights and of everything else."""

    name: str
    description: str
    linear_dtype: str  # numpy/jax dtype name of the q/k/v/o/gate/up/down weights
    other_dtype: str = "bfloat16"
    scales: bool = False  # Linear weights carry `weight_scale`

    @property
    def quantized(self) -> bool:
        return self.scales


QUANTS: Final[dict[str, QuantLayout]] = {
    q.name: q
    for q in (
        QuantLayout("bf16", "the checkpoint's weights in bfloat16", "bfloat16"),
        QuantLayout(
            INT8,
            "int8 Linear weights with one float32 scale per output channel (weight-only; bf16 elsewhere), "
            "dequantized as q * scale inside the XLA program",
            "int8",
            scales=True,
        ),
    )
}


# Where an orbax checkpoint is served: JAX/XLA on these TPUs (bf16 MXUs; int8 weights are dequantized
# inside the XLA program, so no int8 kernel is needed).
TPU_HARDWARE: Final = tuple(name for name, hw in PROFILES.items() if hw.family == "tpu")


def compatibility(quant: str, params: dict[str, Any]) -> dict[str, Verdict]:
    """For every hardware profile: whether the orbax artifact for `quant` (on the recipe's mesh) is served there."""
    mesh = mesh_from_params(params)
    weights = "bf16 weights" if quant == "bf16" else "int8 weights dequantized in the XLA program (q * scale)"
    verdicts = {}
    for name, hw in PROFILES.items():
        if name in TPU_HARDWARE:
            verdicts[name] = Verdict(
                compatible=True,
                reason=f"JAX/XLA on {name}: {weights}, restored with orbax onto a {mesh.describe()} mesh",
            )
        elif hw.family in ("cuda", "rocm"):
            verdicts[name] = Verdict(
                compatible=False, reason=f"orbax checkpoints are served by JAX on TPU; {name} pools load hf-bundles"
            )
        else:
            verdicts[name] = Verdict(
                compatible=False,
                reason=f"the JAX forward runs on {hw.family} only to evaluate the checkpoint; {name} pools load GGUF",
            )
    return verdicts


@dataclass(frozen=True)
class ForwardConfig:
    """The hyper-parameters of the JAX forward (hashable: it is a static argument of `jax.jit`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None  # Mistral: each query sees at most this many keys (itself included)


def forward_config(shape: ModelShape, config: Mapping[str, Any]) -> ForwardConfig:
    """The forward's config from a model's checked shape and its config.json, for the keys the shape does not
    carry; refuses features the JAX forward would compute differently.

    The export calls this before writing anything, so an artifact is only built for models its
    runtime serves exactly (plain RoPE, SiLU MLP, full attention or Mistral's sliding window).
    """
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise InvalidInput(f"orbax: hidden_act={act!r} is not supported (SiLU only)", code="ORBAX_UNSUPPORTED")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        raise InvalidInput(
            f"orbax: rope scaling {rope_type!r} is not supported yet (plain RoPE only)",
            code="ORBAX_UNSUPPORTED",
            details={"rope_type": rope_type},
        )
    if config.get("mlp_bias") or config.get("partial_rotary_factor", 1.0) != 1.0:
        raise InvalidInput(
            "orbax: MLP biases and partial rotary embeddings are not supported", code="ORBAX_UNSUPPORTED"
        )
    window = None
    if shape.family == "mistral" and config.get("sliding_window") is not None:
        window = int(config["sliding_window"])
    elif config.get("use_sliding_window"):
        raise InvalidInput(
            f"orbax: sliding-window attention of {shape.family} is not supported", code="ORBAX_UNSUPPORTED"
        )
    return ForwardConfig(
        architecture=shape.architecture,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        attention_bias=shape.attention_bias,
        sliding_window=window,
    )


def tree_path(name: str) -> tuple[str, ...]:
    """The PyTree key path of a tensor in the checkpoint: its name split at '.' (orbax joins it back)."""
    parts = tuple(name.split("."))
    if any(not p for p in parts):
        raise InvalidInput(f"orbax: tensor name {name!r} has an empty path component", details={"tensor": name})
    return parts


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`{name: leaf}` as the nested PyTree orbax stores (`tree_path` of each name); refuses a name under a leaf."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = tree_path(name)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise InvalidInput(f"orbax: tensor {name!r} lies under another tensor", details={"tensor": name})
        if leaf in node:
            raise InvalidInput(f"orbax: tensor {name!r} is both a leaf and a subtree", details={"tensor": name})
        node[leaf] = value
    return tree


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The inverse of `nest`: `(name, leaf)` pairs of a nested PyTree of dicts."""
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            yield from flatten(value, name)
        else:
            yield name, value
