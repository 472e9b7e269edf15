"""The orbax artifact as data: its files, the checkpoint's tensors and their dtype per quant (the model features
its forward serves are `targets.orbax.forward`'s).

    <artifact>/
      checkpoint/        orbax checkpoint (v1 layout): the weights as a PyTree of arrays, one per
                         tensor, keyed by their names split at '.' (model/layers/0/...)
      config.json        the source's model config, unchanged
      weights.json       format version, quant, and every tensor's dtype and shape
      sharding.json      the mesh and one partition spec per tensor (`targets.orbax.sharding`)
      tokenizer files, generation_config.json (copied)

Tensors keep the source's names and `[out, in]` orientation, except where the layout is the one a TPU
serving stack computes with (`plan_checkpoint`): a mixture of experts' Linears are stacked per layer and
projection, `[experts, out, in]` (experts a checkpoint already stacks inputs first, gpt-oss's, transposed to it,
their interleaved gate and up split), and fused Linears (Phi-3's `qkv_proj`, `gate_up_proj`) are split into
their parts. The forward contracts over `in`. Quant `int8` stores each Linear weight as int8 `weight` plus
a float32 `weight_scale` per output channel (`[experts, out]` for a stack), and the weight is
`weight * weight_scale[..., None]`; everything else (embeddings, norms, routers, biases, lm_head) is
bfloat16, as for bf16.

Nothing here imports jax, numpy or torch: recipe checks and `kiln plan` import `targets`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError
from kiln.core.hardware import PROFILES
from kiln.formats.architectures.record import TensorKind, TensorSpec
from kiln.formats.architectures.shape import ModelShape
from kiln.quant.catalog import SCHEMES
from kiln.quant.schemes import Verdict
from kiln.targets.orbax.forward import forward_config
from kiln.targets.orbax.sharding import HeadLayout, mesh_from_params, plan_sharding

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
    raise KilnError("no int8 weight-only per-channel scheme is registered", code=Codes.TARGET_NOT_REGISTERED)


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


# Catalog methods orbax does not write, and why.
REFUSED: Final[dict[str, str]] = {
    "mxfp4-experts": "kiln's JAX forward computes bf16 and int8 weight-only checkpoints, and XLA on the TPUs it "
    "targets has no MXFP4 kernel: a release's MXFP4 experts are served as orbax bf16 (dequantized, and recorded so)",
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


# -- the checkpoint's tensors ----------------------------------------------------------------------------------

Part = Literal["weight", "bias", "scale"]
# Fused source Linears the checkpoint stores split, and the kinds of their parts in row order.
FUSED: Final[dict[TensorKind, tuple[TensorKind, ...]]] = {
    TensorKind.ATTN_QKV: (TensorKind.ATTN_Q, TensorKind.ATTN_K, TensorKind.ATTN_V),
    TensorKind.FFN_GATE_UP: (TensorKind.FFN_GATE, TensorKind.FFN_UP),
}


@dataclass(frozen=True)
class CheckpointTensor:
    """One array of the checkpoint: its name, dtype and shape, the role it plays (`kind`, the source tensor's or,
    for a split fused Linear, its part's), which part of its Linear it is, and its decoder layer (None: none)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: TensorKind
    part: Part = "weight"
    layer: int | None = None

    @property
    def key(self) -> str:
        """The forward's name for it within its layer: its kind (`attn_q`), `.bias` or `.scale` added for those."""
        return self.kind.value if self.part == "weight" else f"{self.kind.value}.{self.part}"


@dataclass(frozen=True)
class SourceGroup:
    """Source tensors read together and the checkpoint arrays made of them (`parts`, with one `scales` entry each
    where the Linear is quantized): `copy` one source as it is; `split` one fused source's rows into `parts`, in
    order; `stack` one source per expert on a new first axis, in expert order; `deinterleave` one source's last
    axis, whose columns alternate between `parts` (column j belongs to part j mod len(parts)). `transposed`: the
    source is a stack stored inputs first (`[experts, in, out]`), whose last two axes are swapped after."""

    how: Literal["copy", "split", "stack", "deinterleave"]
    sources: tuple[str, ...]
    parts: tuple[CheckpointTensor, ...]
    scales: tuple[CheckpointTensor, ...] = ()
    transposed: bool = False

    @property
    def outputs(self) -> tuple[CheckpointTensor, ...]:
        return (*self.parts, *self.scales)


def plan_checkpoint(
    shape: ModelShape, quant: QuantLayout, quantized: Callable[[str], bool] = lambda name: False
) -> list[SourceGroup]:
    """Every checkpoint array from the model's shape alone, grouped by the source tensors it is made of, in source
    order. `quantized(name)` says which source Linear weights the quant stores as int8 with scales.

    Experts are stacked per layer and projection: expert e's `<block>.<experts>.<e>.<proj>.weight` becomes row e of
    `<block>.<experts>.<proj>.weight` [experts, out, in]. Fused Linears are split: Phi-3's `qkv_proj` into
    `q_proj`, `k_proj`, `v_proj` (and its bias likewise), `gate_up_proj` into the MLP's gate and up projections,
    so the tensor-parallel plan splits each by whole heads and the forward reads one layout for every family.
    Experts the source already stacks inputs first (the record's "fused" layout, gpt-oss: `<experts>.gate_up_proj`
    [experts, hidden, 2 x intermediate], gate and up interleaved, `<experts>.down_proj` [experts, intermediate,
    hidden], and their biases) become the same stacks as everyone's: `<experts>.gate_proj.weight` and
    `up_proj.weight` [experts, intermediate, hidden] (the even and odd columns, transposed), `down_proj.weight`
    [experts, hidden, intermediate], and `gate_proj.bias`, `up_proj.bias` [experts, intermediate] and
    `down_proj.bias` [experts, hidden]. Every other tensor keeps its source name."""
    arch = shape.arch
    specs = shape.tensors()
    experts: dict[tuple[int | None, TensorKind], list[TensorSpec]] = {}
    for spec in specs:
        if spec.expert is not None:
            experts.setdefault((spec.layer, spec.kind), []).append(spec)
    groups: list[SourceGroup] = []
    for spec in specs:
        part: Part = "bias" if spec.bias else "weight"
        q = part == "weight" and spec.quantizable and quantized(spec.name)
        dtype = quant.linear_dtype if q else quant.other_dtype
        if spec.expert is not None:
            if spec.expert != 0:
                continue  # the whole stack is planned at expert 0
            members = experts[spec.layer, spec.kind]
            if (
                [m.expert for m in members] != list(range(len(members)))
                or any(m.shape != spec.shape for m in members)
                or any((part == "weight" and spec.quantizable and quantized(m.name)) != q for m in members)
            ):
                raise InvalidInput(f"orbax: the experts of {spec.name!r} do not stack", details={"tensor": spec.name})
            assert arch.mlp.experts is not None  # a spec with an expert comes from the record's experts
            name = spec.name.replace(f".{arch.mlp.experts.experts}.0.", f".{arch.mlp.experts.experts}.", 1)
            stacked = CheckpointTensor(name, dtype, (len(members), *spec.shape), spec.kind, part, spec.layer)
            groups.append(SourceGroup("stack", tuple(m.name for m in members), (stacked,), _scales(q, stacked)))
        elif spec.kind in STACKED_INPUTS_FIRST:
            groups.append(_inputs_first(shape, spec, dtype, part))
        elif spec.kind in FUSED:
            parts = tuple(
                CheckpointTensor(_split_name(shape, spec, kind), dtype, (rows, *spec.shape[1:]), kind, part, spec.layer)
                for kind, rows in zip(FUSED[spec.kind], _split_rows(shape, spec.kind), strict=True)
            )
            if sum(p.shape[0] for p in parts) != spec.shape[0]:
                raise InvalidInput(f"orbax: {spec.name!r} does not split into its parts", details={"tensor": spec.name})
            groups.append(SourceGroup("split", (spec.name,), parts, tuple(s for p in parts for s in _scales(q, p))))
        else:
            t = CheckpointTensor(spec.name, dtype, spec.shape, spec.kind, part, spec.layer)
            groups.append(SourceGroup("copy", (spec.name,), (t,), _scales(q, t)))
    return groups


def _inputs_first(shape: ModelShape, spec: TensorSpec, dtype: str, part: Part) -> SourceGroup:
    """A stack of every expert stored inputs first (the record's "fused" experts), as `[experts, out, in]` stacks
    named by the record's projections: gate_up split into its interleaved gate and up, down transposed; their
    biases ([experts, out]) split or renamed alike. Never quantized (kiln's schemes write no 3-D weights)."""
    experts = shape.arch.mlp.experts
    assert experts is not None  # a stacked expert tensor comes from the record's experts
    stem = f"model.layers.{spec.layer}.{experts.block}.{experts.experts}."
    leaf = "bias" if spec.bias else "weight"
    kinds = STACKED_INPUTS_FIRST[spec.kind]
    names = {
        TensorKind.FFN_GATE_EXPS: experts.projections.gate,
        TensorKind.FFN_UP_EXPS: experts.projections.up,
        TensorKind.FFN_DOWN_EXPS: experts.projections.down,
    }
    e, *rest = spec.shape
    dims: tuple[int, ...] = (e, rest[0] // len(kinds)) if spec.bias else (e, rest[1] // len(kinds), rest[0])
    parts = tuple(
        CheckpointTensor(f"{stem}{names[kind]}.{leaf}", dtype, dims, kind, part, spec.layer) for kind in kinds
    )
    if sum(p.shape[-2 if not spec.bias else -1] for p in parts) != spec.shape[-1]:
        raise InvalidInput(f"orbax: {spec.name!r} does not split into its parts", details={"tensor": spec.name})
    how: Literal["copy", "deinterleave"] = "deinterleave" if len(kinds) > 1 else "copy"
    return SourceGroup(how, (spec.name,), parts, transposed=not spec.bias)


def checkpoint_tensors(groups: Sequence[SourceGroup]) -> dict[str, CheckpointTensor]:
    """`{name: tensor}` of every array the groups write, in write order."""
    return {t.name: t for g in groups for t in g.outputs}


# Stacked expert tensors a checkpoint stores inputs first (`[experts, in, out]`), and the kinds the checkpoint
# stores them as: gate_up's interleaved columns split into gate and up.
STACKED_INPUTS_FIRST: Final[dict[TensorKind, tuple[TensorKind, ...]]] = {
    TensorKind.FFN_GATE_UP_EXPS: (TensorKind.FFN_GATE_EXPS, TensorKind.FFN_UP_EXPS),
    TensorKind.FFN_DOWN_EXPS: (TensorKind.FFN_DOWN_EXPS,),
}


def _scales(quantized: bool, weight: CheckpointTensor) -> tuple[CheckpointTensor, ...]:
    """A quantized weight's float32 scales, one per output channel (per expert and channel for a stack)."""
    if not quantized:
        return ()
    name = weight.name.removesuffix(".weight") + ".weight" + SCALE_SUFFIX
    return (CheckpointTensor(name, "float32", weight.shape[:-1], weight.kind, "scale", weight.layer),)


def _split_rows(shape: ModelShape, kind: TensorKind) -> tuple[int, ...]:
    if kind == TensorKind.ATTN_QKV:
        return (shape.q_size, shape.kv_size, shape.kv_size)
    return (shape.intermediate_size, shape.intermediate_size)  # gate first, as transformers' Phi3MLP chunks it


def _split_name(shape: ModelShape, spec: TensorSpec, kind: TensorKind) -> str:
    arch, leaf = shape.arch, "bias" if spec.bias else "weight"
    layer = f"model.layers.{spec.layer}."
    module = {
        TensorKind.ATTN_Q: f"{arch.attention.prefix}.q_proj",
        TensorKind.ATTN_K: f"{arch.attention.prefix}.k_proj",
        TensorKind.ATTN_V: f"{arch.attention.prefix}.v_proj",
        TensorKind.FFN_GATE: f"{arch.mlp.prefix}.{arch.mlp.projections.gate}",
        TensorKind.FFN_UP: f"{arch.mlp.prefix}.{arch.mlp.projections.up}",
    }[kind]
    return f"{layer}{module}.{leaf}"


def check_model(shape: ModelShape, config: Mapping[str, Any], quant: str, params: Mapping[str, Any]) -> None:
    """`TargetSpec.check_model_fn`, at plan time: ORBAX_UNSUPPORTED for a model the forward does not compute
    (`forward_config`; the same for every quant), and ORBAX_SHARDING_NOT_DIVISIBLE for one the recipe's mesh
    cannot split, before any stage runs."""
    forward_config(shape, config)
    plan_sharding(
        checkpoint_tensors(plan_checkpoint(shape, QUANTS["bf16"])),
        HeadLayout(shape.num_heads, shape.num_kv_heads, shape.head_dim),
        mesh_from_params(params),
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
