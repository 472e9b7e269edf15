"""The sharding plan of an orbax artifact: which axis of each tensor is split over which axis of a TPU mesh.

Megatron-style tensor parallelism over the mesh axis `model` (`TENSOR_AXIS`); every other mesh axis
(e.g. `data`) holds replicas of the weights and splits the batch at serving time:

- column-parallel layers split their output features (dim 0 of a `[out, in]` weight): q/k/v and
  gate/up projections, with their biases and per-output-channel int8 scales;
- row-parallel layers split their input features (dim 1): o and down projections; their int8 scales
  (one per output channel) are replicated;
- embeddings and lm_head split the vocabulary (dim 0), or the hidden size (dim 1) when the vocabulary
  does not divide the axis;
- norms are replicated.

Attention projections are split by whole heads. Key/value heads fewer than the axis size are
replicated, as Megatron and vLLM do, when the axis size is a multiple of their count (each device
then holds the one kv head its query heads read); otherwise the plan is refused.

A split that does not divide is refused before anything is written, with `ShardingNotDivisible`
naming the tensor. The plan is plain data (JSON in the artifact's `sharding.json`); a `PartitionSpec`
is built from it by the runtime (`eval.runtimes.jax_runtime`). Nothing here imports jax.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidInput

TENSOR_AXIS = "model"
DEFAULT_MESH: Mapping[str, int] = {"data": 2, "model": 4}  # 8 chips: a v5e-8 slice is a 2x4 torus
PARAMS = ("mesh",)  # the recipe params the orbax target takes
_AXIS_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

# One partition spec per tensor: for each dimension, the mesh axis it is split over, or None.
PartitionSpec = tuple[str | None, ...]


class MeshInvalid(InvalidInput):
    """The recipe's `mesh` parameter is not a mapping of axis names to sizes with a `model` axis."""

    code = "ORBAX_MESH_INVALID"


class ShardingNotDivisible(InvalidInput):
    """A tensor dimension (or head count) the plan splits is not a multiple of the mesh axis size."""

    code = "ORBAX_SHARDING_NOT_DIVISIBLE"


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


_COLUMN = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias|weight_scale)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|weight_scale)$")
_KV = re.compile(r"\.self_attn\.[kv]_proj\.")
_ATTENTION = re.compile(r"\.self_attn\.[qkvo]_proj\.")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def plan_sharding(
    tensors: Mapping[str, tuple[int, ...]], heads: HeadLayout, mesh: Mesh
) -> tuple[dict[str, PartitionSpec], dict[str, str]]:
    """The partition spec of every tensor (checkpoint names and shapes) on `mesh`, and the choices made.

    Returns (specs, notes): `notes` says, for tensors whose placement was a choice (embeddings split
    on hidden, replicated kv heads), what was chosen and why. Raises `ShardingNotDivisible` naming
    the first tensor that cannot be split.
    """
    tp = mesh.tensor_parallel
    replicate_kv = heads.num_kv_heads % tp != 0
    specs: dict[str, PartitionSpec] = {}
    notes: dict[str, str] = {}
    for name, shape in tensors.items():
        spec: list[str | None] = [None] * len(shape)
        if tp > 1 and name in _VOCAB:
            dim = 0 if shape[0] % tp == 0 else 1
            _check_divisible(name, shape, dim, tp)
            spec[dim] = TENSOR_AXIS
            if dim == 1:
                notes[name] = f"vocabulary {shape[0]} does not divide {tp}: split on hidden size"
        elif tp > 1 and _COLUMN.search(name):
            if _KV.search(name) and replicate_kv:
                if tp % heads.num_kv_heads:
                    raise ShardingNotDivisible(
                        f"orbax: tensor {name!r} {list(shape)} holds {heads.num_kv_heads} key/value heads, which can "
                        f"neither split over nor be replicated across mesh axis {TENSOR_AXIS!r} of size {tp} "
                        "(one must be a multiple of the other)",
                        details={"tensor": name, "heads": heads.num_kv_heads, "axis": TENSOR_AXIS, "axis_size": tp},
                    )
                notes[name] = f"{heads.num_kv_heads} kv heads replicated over {tp} devices"
            else:
                _check_heads(name, shape, heads, tp)
                _check_divisible(name, shape, 0, tp)
                spec[0] = TENSOR_AXIS
        # Row-parallel scales (one per output channel, which row-parallel keeps whole) stay replicated.
        elif tp > 1 and _ROW.search(name) and not name.endswith(".weight_scale"):
            _check_heads(name, shape, heads, tp)
            _check_divisible(name, shape, 1, tp)
            spec[1] = TENSOR_AXIS
        specs[name] = tuple(spec)
    return specs, notes


def _check_divisible(name: str, shape: tuple[int, ...], dim: int, tp: int) -> None:
    if dim >= len(shape) or shape[dim] % tp:
        raise ShardingNotDivisible(
            f"orbax: tensor {name!r} {list(shape)}: dim {dim} ({shape[dim] if dim < len(shape) else '-'}) is not "
            f"divisible by mesh axis {TENSOR_AXIS!r} of size {tp}",
            details={"tensor": name, "shape": list(shape), "dim": dim, "axis": TENSOR_AXIS, "axis_size": tp},
        )


def _check_heads(name: str, shape: tuple[int, ...], heads: HeadLayout, tp: int) -> None:
    if not _ATTENTION.search(name):
        return
    count, kind = (heads.num_kv_heads, "key/value") if _KV.search(name) else (heads.num_heads, "attention")
    if count % tp:
        raise ShardingNotDivisible(
            f"orbax: tensor {name!r} {list(shape)} holds {count} {kind} heads of {heads.head_dim}, which do not "
            f"split into whole heads over mesh axis {TENSOR_AXIS!r} of size {tp}",
            details={"tensor": name, "shape": list(shape), "heads": count, "axis": TENSOR_AXIS, "axis_size": tp},
        )
