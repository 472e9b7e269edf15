"""Write the orbax artifact: the weights as JAX-ready arrays, streamed one group of source tensors at a time.

Everything is planned from the model's shape first (every checkpoint tensor's dtype and shape, what it is
made of, and its place on the mesh: `layout.plan_checkpoint`, `sharding.plan_sharding`), so a model that
cannot be sharded on the recipe's mesh is refused before anything is written. Then each group is read
(`SourceModel.tensor`, memory-mapped): one source tensor, copied or split (Phi-3's fused Linears), or one
layer's experts of one projection, stacked. Its arrays go to the checkpoint writer in batches of at most
`WRITE_BATCH_BYTES` (or one group, if larger), then are dropped: peak memory is one batch, and for a
mixture of experts at least one stacked projection (twice its bytes while it is stacked). Each orbax
partial save costs tens of milliseconds whatever its size, so one save per tensor made a small model's
export take seconds.

int8 takes its values from the shared quantize stage (the weight-only int8 scheme, `layout.INT8`),
the same integers and scales the hf-bundle of that scheme packs for vLLM, stored here unpacked as
int8 with float32 scales.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, StageFailed, UnknownName
from kiln.targets.base import ExportRequest, ExportResult
from kiln.targets.orbax.forward import forward_config
from kiln.targets.orbax.layout import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    COPIED_FILES,
    FORMAT,
    FORMAT_VERSION,
    QUANTS,
    SHARDING_FILE,
    WEIGHTS_FILE,
    SourceGroup,
    checkpoint_tensors,
    compatibility,
    plan_checkpoint,
)
from kiln.targets.orbax.sharding import TENSOR_AXIS, HeadLayout, mesh_from_params, plan_sharding
from kiln.targets.orbax.writer import OrbaxWriter

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kiln.formats.hf_model import SourceModel
    from kiln.quant.store import QuantizedWeights

# The arrays handed to one orbax partial save: a few of a 70B model's layers, all of a small model.
WRITE_BATCH_BYTES = 256 * 1024 * 1024


def _quantized(quantized: QuantizedWeights | None, name: str) -> bool:
    from kiln.quant.rtn import quantizes

    return quantized is not None and quantizes(quantized.scheme, name)


def bf16_array(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy bfloat16 array (ml_dtypes), bit for bit what torch holds after rounding to bf16."""
    import jax.numpy as jnp
    import torch

    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(jnp.bfloat16)


def int8_arrays(name: str, weight: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The int8 values q and float32 scales [out] of `name`, a weight that is exactly q * scale per output channel.

    `weight` is the quantize stage's dequantized float32 weight and `scale` its per-channel scales; a
    weight that is not exactly q * scale with q in int8 means the stage's layout changed, and is an error.
    """
    import torch

    s = scale.float().reshape(-1, 1)
    q = torch.round(weight.float() / s)
    if q.min() < -128 or q.max() > 127 or not torch.equal(q * s, weight.float()):
        raise StageFailed(
            f"orbax: {name} from the quantize stage is not int8 values times per-channel scales",
            code=Codes.ORBAX_INT8_MISMATCH,
            details={"tensor": name},
        )
    return q.to(torch.int8).numpy(), s.reshape(-1).numpy()


def checkpoint_arrays(
    source: SourceModel, quantized: QuantizedWeights | None, groups: list[SourceGroup]
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """The checkpoint's arrays, one list per group of source tensors (`layout.plan_checkpoint`), in source order.

    Each list is built by a call whose locals die when it returns, so nothing here keeps a tensor
    alive while the next group is read.
    """
    for group in groups:
        yield _group_arrays(source, quantized, group)


def _group_arrays(
    source: SourceModel, quantized: QuantizedWeights | None, group: SourceGroup
) -> list[tuple[str, np.ndarray]]:
    """A group's arrays: its source tensors converted (bf16, or int8 with scales), then copied, split, stacked or
    deinterleaved, and transposed where stored inputs first."""
    import numpy as np

    converted = [_converted(source, quantized, name) for name in group.sources]
    values = [v for v, _ in converted]
    scales = [s for _, s in converted if s is not None]
    if group.how == "stack":
        parts, part_scales = [np.stack(values)], [np.stack(scales)] if scales else []
    elif group.how == "split":
        bounds = np.cumsum([p.shape[0] for p in group.parts])[:-1]
        parts = np.split(values[0], bounds)
        part_scales = np.split(scales[0], bounds) if scales else []
    elif group.how == "deinterleave":
        n = len(group.parts)
        parts, part_scales = [values[0][..., i::n] for i in range(n)], []
    else:
        parts, part_scales = values, scales
    if group.transposed:  # a stack stored inputs first: [experts, in, out] -> [experts, out, in]
        parts = [np.ascontiguousarray(np.swapaxes(p, -1, -2)) for p in parts]
    elif group.how == "deinterleave":
        parts = [np.ascontiguousarray(p) for p in parts]
    return [
        *((t.name, a) for t, a in zip(group.parts, parts, strict=True)),
        *((t.name, a) for t, a in zip(group.scales, part_scales, strict=True)),
    ]


def _converted(
    source: SourceModel, quantized: QuantizedWeights | None, name: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """One source tensor as the checkpoint stores it: (int8 values, float32 scales) when quantized, else
    (bfloat16, None)."""
    from kiln.quant.rtn import dequantize

    if quantized is not None and _quantized(quantized, name):
        module = name.removesuffix(".weight")
        stored = {q: quantized.tensor(q) for q in quantized.module_tensors(name)}
        return int8_arrays(name, dequantize(quantized.scheme, module, stored), stored[f"{module}.weight_scale"])
    if quantized is not None and quantized.replaces(name):  # a tensor calibration changed
        return bf16_array(quantized.tensor(name)), None
    return bf16_array(source.dequantized(name)), None  # a pre-quantized release's dequantized, then bf16


def export(source: SourceModel, req: ExportRequest) -> ExportResult:
    """Write the orbax artifact for `req.quant` into `req.out_dir` (see `targets.orbax.layout`)."""
    layout = QUANTS.get(req.quant)
    if layout is None:
        raise UnknownName(
            f"orbax: unknown quant {req.quant!r}; known: {', '.join(QUANTS)}", details={"known": list(QUANTS)}
        )
    quantized = req.quantized
    if layout.quantized != (quantized is not None) or (quantized is not None and quantized.scheme.name != req.quant):
        want = f"the quantize stage output for {req.quant}" if layout.quantized else "no quantized input"
        raise InvalidInput(f"orbax-{req.quant}: needs {want}")
    mesh = mesh_from_params(req.params)
    cfg = forward_config(source.shape, source.config)
    groups = plan_checkpoint(source.shape, layout, lambda name: _quantized(quantized, name))
    tensors = checkpoint_tensors(groups)
    planned = {n: (t.dtype, t.shape) for n, t in tensors.items()}
    heads = HeadLayout(cfg.shape.num_heads, cfg.shape.num_kv_heads, cfg.shape.head_dim)
    specs, notes = plan_sharding(tensors, heads, mesh)

    out = req.out_dir
    writer = OrbaxWriter(out / CHECKPOINT_DIR, planned)
    batch: dict[str, np.ndarray] = {}
    batch_source_bytes = 0
    for group, arrays in zip(groups, checkpoint_arrays(source, quantized, groups), strict=True):
        batch.update(arrays)
        batch_source_bytes += sum(source.tensors[name].nbytes for name in group.sources)
        del arrays
        if sum(a.nbytes for a in batch.values()) >= WRITE_BATCH_BYTES:
            writer.write(batch)
            req.on_progress(batch_source_bytes)
            batch, batch_source_bytes = {}, 0  # dropped before the next tensor is read
    if batch:
        writer.write(batch)
        req.on_progress(batch_source_bytes)
    del batch
    writer.finish()

    shutil.copyfile(source.root / CONFIG_FILE, out / CONFIG_FILE)
    for name in (*COPIED_FILES, *source.tokenizer_files):
        if (source.root / name).is_file():
            shutil.copyfile(source.root / name, out / name)
    weights = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "quant": layout.name,
        "description": layout.description,
        "checkpoint": CHECKPOINT_DIR,
        "tensors": {n: {"dtype": d, "shape": list(s)} for n, (d, s) in planned.items()},
    }
    sharding = {
        "mesh": mesh.as_dict(),
        "tensor_parallel_axis": TENSOR_AXIS,
        "partition_specs": {n: list(spec) for n, spec in specs.items()},
        "notes": notes,
    }
    (out / WEIGHTS_FILE).write_text(json.dumps(weights, indent=2) + "\n")
    (out / SHARDING_FILE).write_text(json.dumps(sharding, indent=2) + "\n")

    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    return ExportResult(
        files=files,
        runtime={
            "framework": "jax",
            "loaders": {"jax": ">=0.10", "orbax-checkpoint": ">=0.12.8"},
            "architecture": cfg.shape.architecture,
            "weights": layout.description,
            "mesh": mesh.as_dict(),
        },
        details={"tensors": len(planned), "sharding_notes": notes},
        hardware={hw: v.reason for hw, v in compatibility(req.quant, req.params).items() if v.compatible},
        # The catalog lets orbax build only bf16 from a pre-quantized release (its int8 would round it twice).
        dequantized=source.quantized.quantization.layout.name if source.quantized is not None else None,
    )
