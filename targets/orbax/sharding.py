"""The sharding plan of an orbax artifact: which axis of each tensor is split over which axis of a TPU mesh.

Megatron-style tensor parallelism over the mesh axis `model` (`TENSOR_AXIS`); every other mesh axis
(e.g. `data`) holds replicas of the weights and splits the batch at serving time:

- column-parallel layers split their output features (dim 0 of a `[out, in]` weight): q/k/v and
  gate/up projections, with their biases and per-output-channel int8 scales;
- row-parallel layers split their input features (dim 1): o and down projections; their int8 scales
  (one per output channel) are replicated;
- embeddings and lm_head split the vocabulary (dim 0), or the hidden size (dim 1) when the vocabulary
  does not divide the axis;
- a mixture of experts' stacked Linears ([experts, out, in]) split their expert axis when the experts
  divide the axis (expert parallelism: each device holds whole experts, and the routed sum is reduced
  over the axis); otherwise each expert splits as a dense MLP does (gate/up on out, down on in);
- norms and routers are replicated;
- attention sinks (one logit per query head) split with their heads;
- multi-head latent attention (DeepSeek-V3) splits what is per head: q_b_proj (or q_proj) and kv_b_proj on their
  outputs, o_proj on its inputs, by whole heads; the query latent's q_a_proj and the key-value latent's
  kv_a_proj_with_mqa (the latent and the one rope key every head reads), with their norms and biases, are
  replicated: every device's heads read all of them, and they are small (DeepSeek-V3: 1536 + 576 rows of 7168).

Tensors are told apart by their role (`TensorKind`), not their names. Attention projections are split
by whole heads. Key/value heads fewer than the axis size are replicated, as Megatron and vLLM do, when
the axis size is a multiple of their count (each device then holds the one kv head its query heads
read); otherwise the plan is refused.

A split that does not divide is refused before anything is written, with `ShardingNotDivisible`
naming the tensor. The plan is plain data (JSON in the artifact's `sharding.json`); a `PartitionSpec`
is built from it by the runtime (`eval.runtimes.jax_runtime`). Nothing here imports jax.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.formats.architectures.record import EXPERT_KINDS, TensorKind

if TYPE_CHECKING:
    from kiln.targets.orbax.layout import CheckpointTensor

TENSOR_AXIS = "model"
DEFAULT_MESH: Mapping[str, int] = {"data": 2, "model": 4}  # 8 chips: a v5e-8 slice is a 2x4 torus
PARAMS = ("mesh",)  # the recipe params the orbax target takes
_AXIS_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

# One partition spec per tensor: for each dimension, the mesh axis it is split over, or None.
PartitionSpec = tuple[str | None, ...]


class MeshInvalid(InvalidInput):
    """The recipe's `mesh` parameter is not a mapping of axis names to sizes with a `model` axis."""

    code = Codes.ORBAX_MESH_INVALID


class ShardingNotDivisible(InvalidInput):
    """A tensor dimension (or head count) the plan splits is not a multiple of the mesh axis size."""

    code = Codes.ORBAX_SHARDING_NOT_DIVISIBLE


@dataclass(frozen=True)
class Mesh:
    """A logical device mesh: axis names in order and their sizes, e.g. ("data", "model") x (2, 4)."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]

    @classmethod
    def parse(cls, value: Any) -> Mesh:
        """The mesh a recipe names as `{axis: size, ...}` (in mesh order); refuses anything else."""
        if not isinstance(value, Mapping) or not value:
            raise MeshInvalid(f"orbax: mesh must be a mapping of axis name to size, e.g. {dict(DEFAULT_MESH)}")
        for name, size in value.items():
            if not isinstance(name, str) or not _AXIS_NAME.fullmatch(name):
                raise MeshInvalid(f"orbax: mesh axis name {name!r} must match {_AXIS_NAME.pattern}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshInvalid(f"orbax: mesh axis {name!r} must have a positive integer size, got {size!r}")
        if TENSOR_AXIS not in value:
            raise MeshInvalid(
                f"orbax: mesh {dict(value)} has no {TENSOR_AXIS!r} axis; weights are split over it "
                "(use size 1 for no tensor parallelism)",
                details={"mesh": dict(value)},
            )
        return cls(tuple(value), tuple(value.values()))

    @property
    def devices(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def tensor_parallel(self) -> int:
        return self.shape[self.axes.index(TENSOR_AXIS)]

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.axes, self.shape, strict=True))

    def describe(self) -> str:
        return "x".join(map(str, self.shape)) + " (" + ", ".join(self.axes) + ")"


def mesh_from_params(params: Mapping[str, Any]) -> Mesh:
    """The mesh a recipe's orbax `params` name (`mesh`, default `DEFAULT_MESH`); unknown params are refused."""
    unknown = sorted(k for k in params if k not in PARAMS)
    if unknown:
        raise InvalidInput(
            f"orbax: unknown param(s) {', '.join(map(repr, unknown))}; known: {', '.join(PARAMS)}",
            details={"unknown": unknown, "known": list(PARAMS)},
        )
    return Mesh.parse(params.get("mesh", DEFAULT_MESH))


@dataclass(frozen=True)
class HeadLayout:
    """What splitting attention by whole heads needs to know."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


# The roles each rule applies to (`formats.architectures.record.TensorKind`): a family's own names never matter.
_COLUMN: Final = frozenset(
    {
        TensorKind.ATTN_Q,
        TensorKind.ATTN_K,
        TensorKind.ATTN_V,
        TensorKind.FFN_GATE,
        TensorKind.FFN_UP,
        TensorKind.FFN_GATE_SHEXP,
        TensorKind.FFN_UP_SHEXP,
        TensorKind.ATTN_SINKS,
        TensorKind.ATTN_Q_B,
        TensorKind.ATTN_KV_B,
    }
)
# Multi-head latent attention's latents, which every head reads: replicated (`plan_sharding` notes why).
_LATENT: Final = frozenset({TensorKind.ATTN_Q_A, TensorKind.ATTN_KV_A_MQA})
_ROW: Final = frozenset({TensorKind.ATTN_OUTPUT, TensorKind.FFN_DOWN, TensorKind.FFN_DOWN_SHEXP})
_KV: Final = frozenset({TensorKind.ATTN_K, TensorKind.ATTN_V})
_ATTENTION: Final = frozenset(
    {
        TensorKind.ATTN_Q,
        TensorKind.ATTN_K,
        TensorKind.ATTN_V,
        TensorKind.ATTN_OUTPUT,
        TensorKind.ATTN_SINKS,
        TensorKind.ATTN_Q_B,
        TensorKind.ATTN_KV_B,
    }
)
_VOCAB: Final = frozenset({TensorKind.TOKEN_EMBD, TensorKind.OUTPUT})
_EXPERT_COLUMN: Final = frozenset({TensorKind.FFN_GATE_EXPS, TensorKind.FFN_UP_EXPS})


def plan_sharding(
    tensors: Mapping[str, CheckpointTensor], heads: HeadLayout, mesh: Mesh
) -> tuple[dict[str, PartitionSpec], dict[str, str]]:
    """The partition spec of every checkpoint tensor (`targets.orbax.layout.plan_checkpoint`) on `mesh`, by the
    role it plays, and the choices made.

    Returns (specs, notes): `notes` says, for tensors whose placement was a choice (embeddings split
    on hidden, replicated kv heads, experts split by expert or within each), what was chosen and why.
    Raises `ShardingNotDivisible` naming the first tensor that cannot be split.
    """
    tp = mesh.tensor_parallel
    replicate_kv = heads.num_kv_heads % tp != 0
    specs: dict[str, PartitionSpec] = {}
    notes: dict[str, str] = {}
    for name, t in tensors.items():
        shape, kind = t.shape, t.kind
        spec: list[str | None] = [None] * len(shape)
        if tp == 1:
            pass
        elif kind in _VOCAB:
            dim = 0 if shape[0] % tp == 0 else 1
            _check_divisible(name, shape, dim, tp)
            spec[dim] = TENSOR_AXIS
            if dim == 1:
                notes[name] = f"vocabulary {shape[0]} does not divide {tp}: split on hidden size"
        elif kind in _LATENT:
            notes[name] = "a latent every head reads: replicated"
        elif kind in EXPERT_KINDS:
            split = _expert_dim(name, t, tp)
            if split is not None:
                spec[split] = TENSOR_AXIS
            notes[name] = (
                f"expert parallel: {shape[0]} experts, {shape[0] // tp} whole experts per device"
                if split == 0
                else f"{shape[0]} experts do not divide {tp}: each expert split tensor-parallel"
            )
        elif kind in _COLUMN:
            if kind in _KV and replicate_kv:
                if tp % heads.num_kv_heads:
                    raise ShardingNotDivisible(
                        f"orbax: tensor {name!r} {list(shape)} holds {heads.num_kv_heads} key/value heads, which can "
                        f"neither split over nor be replicated across mesh axis {TENSOR_AXIS!r} of size {tp} "
                        "(one must be a multiple of the other)",
                        details={"tensor": name, "heads": heads.num_kv_heads, "axis": TENSOR_AXIS, "axis_size": tp},
                    )
                notes[name] = f"{heads.num_kv_heads} kv heads replicated over {tp} devices"
            else:
                _check_heads(name, shape, kind, heads, tp)
                _check_divisible(name, shape, 0, tp)
                spec[0] = TENSOR_AXIS
        # Row-parallel scales and biases (one per output channel, which row-parallel keeps whole) stay replicated.
        elif kind in _ROW and t.part == "weight":
            _check_heads(name, shape, kind, heads, tp)
            _check_divisible(name, shape, 1, tp)
            spec[1] = TENSOR_AXIS
        specs[name] = tuple(spec)
    return specs, notes


def _expert_dim(name: str, t: CheckpointTensor, tp: int) -> int | None:
    """The dimension of a stacked expert tensor ([experts, out, in], its scales [experts, out]) split over the
    tensor axis: the experts (expert parallelism) when they divide it; else each expert's intermediate size
    (tensor parallelism inside every expert: gate/up on `out`, down on `in`; down's scales replicated)."""
    if t.shape[0] % tp == 0:
        return 0
    if t.kind in _EXPERT_COLUMN:
        dim = 1
    elif t.part == "weight":
        dim = 2
    else:
        return None
    _check_divisible(name, t.shape, dim, tp)
    return dim


def _check_divisible(name: str, shape: tuple[int, ...], dim: int, tp: int) -> None:
    if dim >= len(shape) or shape[dim] % tp:
        raise ShardingNotDivisible(
            f"orbax: tensor {name!r} {list(shape)}: dim {dim} ({shape[dim] if dim < len(shape) else '-'}) is not "
            f"divisible by mesh axis {TENSOR_AXIS!r} of size {tp}",
            details={"tensor": name, "shape": list(shape), "dim": dim, "axis": TENSOR_AXIS, "axis_size": tp},
        )


def _check_heads(name: str, shape: tuple[int, ...], kind: TensorKind, heads: HeadLayout, tp: int) -> None:
    if kind not in _ATTENTION:
        return
    count, what = (heads.num_kv_heads, "key/value") if kind in _KV else (heads.num_heads, "attention")
    if count % tp:
        raise ShardingNotDivisible(
            f"orbax: tensor {name!r} {list(shape)} holds {count} {what} heads of {heads.head_dim}, which do not "
            f"split into whole heads over mesh axis {TENSOR_AXIS!r} of size {tp}",
            details={"tensor": name, "shape": list(shape), "heads": count, "axis": TENSOR_AXIS, "axis_size": tp},
        )
