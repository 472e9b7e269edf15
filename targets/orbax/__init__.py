"""The `orbax` target: the weights as an orbax checkpoint of JAX arrays, with a sharding plan for a TPU mesh.

Layout: `layout` (the artifact's files, quants and tensors, as data), `forward` (the model features its JAX
forward computes, and the refusals of what it does not), `sharding`
(the tensor-parallel plan on a mesh), `writer` (streaming orbax checkpoint writer, a state machine),
`export` (the stage function). Served by kiln's JAX forward (`eval.runtimes.jax_runtime`), which
restores the checkpoint with orbax, on CPU in tests and on TPU v5e/v5p in production (a design target: nothing
has run on a TPU).
Only plain-data modules are imported here: recipe checks and `kiln plan` import `targets` and load no jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.targets.base import TargetSpec, register
from kiln.targets.lint import lint_orbax
from kiln.targets.orbax.layout import INT8, QUANTS, REFUSED, TPU_HARDWARE, check_model, compatibility
from kiln.targets.orbax.sharding import mesh_from_params

if TYPE_CHECKING:
    from kiln.formats.hf_model import SourceModel
    from kiln.targets.base import ExportRequest, ExportResult

CODE_VERSION = "orbax-1"


def _export(source: SourceModel, req: ExportRequest) -> ExportResult:
    from kiln.targets.orbax.export import export

    return export(source, req)


def _check_params(params: dict[str, Any]) -> None:
    """Refuse a bad `mesh` when the recipe is read, before any stage runs (the model's fit is checked at plan
    time, `layout.check_model`, and again at export)."""
    mesh_from_params(params)


SPEC = register(
    TargetSpec(
        per_architecture=True,
        name="orbax",
        format="orbax-checkpoint",
        quants=tuple(QUANTS),
        hardware=TPU_HARDWARE,
        runtime="jax",
        code_version=CODE_VERSION,
        export=_export,
        # What its export holds (at 8B: 1.9-2.6 GiB over the stage's start, up to 2.6 copies of the 1.05 GB
        # embedding).
        export_tensor_copies={"*": 3.0},
        description="orbax checkpoint of JAX arrays with a tensor-parallel sharding plan, for JAX/XLA on TPU",
        quantized_input=(INT8,),
        unsupported_quants=REFUSED,
        compatibility_fn=compatibility,
        check_params=_check_params,
        check_model_fn=check_model,
        lint=lint_orbax,
    )
)
