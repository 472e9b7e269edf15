"""Lint an orbax artifact (`targets.orbax.layout`) as kiln's JAX forward restores it.

config.json is checked as for any bundle (`targets.lint.config`) and gives every tensor the model has; its
quant's layout (`layout.QUANTS`) gives each one's dtype, and a `<weight>_scale` float32 [out] per quantized
Linear. weights.json must list exactly those (a config.json of another model than the weights fails here:
CONFIG_MISMATCH for the layer count or sizes it disagrees on, then the tensors), sharding.json one
partition spec per tensor of its rank, and the checkpoint one zarr3 array per tensor whose own metadata
(`checkpoint/state/<name>/zarr.json`) agrees. Each scale array is then read with tensorstore, one at a
time, and judged as scales are everywhere (`targets.lint.values`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Final

from kiln.core.errors import KilnError
from kiln.formats.architectures.shape import ModelShape
from kiln.targets.lint.config import check_config, compare_shapes
from kiln.targets.lint.findings import Finding, LintReport, LintRequest, finding
from kiln.targets.lint.hf import read_json
from kiln.targets.lint.values import count, judge
from kiln.targets.orbax.layout import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    QUANTS,
    SCALE_SUFFIX,
    SHARDING_FILE,
    WEIGHTS_FILE,
    QuantLayout,
    checkpoint_tensors,
    plan_checkpoint,
)

STATE: Final = "state"  # the checkpoint's item holding the weights (`ocp.partial.save` of the tree)
COMMIT_MARKER: Final = "commit_success.txt"
ZARR: Final = "zarr.json"
# zarr3 `data_type` names are numpy's.
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def lint_orbax_dir(req: LintRequest) -> LintReport:
    root = req.root
    report = LintReport(str(root), FORMAT)
    config = read_json(root, CONFIG_FILE, report)
    weights = read_json(root, WEIGHTS_FILE, report)
    sharding = read_json(root, SHARDING_FILE, report)
    shape, found = check_config(config, CONFIG_FILE) if config is not None else (None, [])
    report.extend(found)
    if shape is not None and req.shape is not None:
        report.extend(compare_shapes(shape, req.shape, CONFIG_FILE))
    planned, layout = _weights(weights, req.quant, report)
    if planned is None:
        return report
    report.tensors = len(planned)
    if shape is not None and layout is not None:
        report.extend(_against_config(shape, layout, planned))
    if sharding is not None:
        report.extend(_sharding(sharding, planned))
    arrays = _arrays(root, planned, report)
    _scales(root, planned, arrays, report)
    return report


def _weights(
    doc: Any, quant: str | None, report: LintReport
) -> tuple[dict[str, tuple[str, tuple[int, ...]]] | None, QuantLayout | None]:
    """weights.json's tensors {name: (dtype, shape)} and its quant's layout (None where unreadable)."""
    if doc is None:
        return None, None

    def bad(subject: str, message: str) -> tuple[None, None]:
        report.add(finding("JSON_INVALID", subject, message, WEIGHTS_FILE))
        return None, None

    if not isinstance(doc, dict):
        return bad(WEIGHTS_FILE, "must be a JSON object")
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        got = f"{doc.get('format')!r} v{doc.get('format_version')!r}"
        return bad("format", f"is {got}; the JAX runtime reads {FORMAT} v{FORMAT_VERSION}")
    layout = QUANTS.get(doc.get("quant"))  # type: ignore[arg-type]
    if layout is None:
        report.add(
            finding("QUANT_CONFIG_INVALID", "quant", f"{doc.get('quant')!r}: known: {', '.join(QUANTS)}", WEIGHTS_FILE)
        )
    elif quant is not None and quant != layout.name:
        report.add(
            finding("QUANT_CONFIG_INVALID", "quant", f"is {layout.name!r}; the artifact is {quant}", WEIGHTS_FILE)
        )
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        return bad("tensors", "must map tensor names to {dtype, shape}")
    planned: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in tensors.items():
        dims = t.get("shape") if isinstance(t, dict) else None
        if (
            not isinstance(dims, list)
            or not all(type(d) is int and d >= 0 for d in dims)
            or not isinstance(t.get("dtype"), str)
        ):
            return bad(name, "each tensor needs a dtype and a shape of non-negative integers")
        planned[name] = (t["dtype"], tuple(dims))
    return planned, layout


def _against_config(
    shape: ModelShape, layout: QuantLayout, planned: dict[str, tuple[str, tuple[int, ...]]]
) -> list[Finding]:
    """weights.json against what config.json implies for the quant's layout."""
    out = []
    layers = {int(m.group(1)) for n in planned if (m := _LAYER.match(n))}
    if layers != set(range(shape.num_layers)):
        msg = f"config.json says {shape.num_layers} layers; {WEIGHTS_FILE} holds layers {sorted(layers)[:8]}"
        out.append(finding("CONFIG_MISMATCH", "num_hidden_layers", msg, WEIGHTS_FILE))
    embd = planned.get("model.embed_tokens.weight")
    if embd is not None and embd[1] != (shape.vocab_size, shape.hidden_size):
        msg = f"config.json implies [{shape.vocab_size}, {shape.hidden_size}]; {WEIGHTS_FILE} says {list(embd[1])}"
        out.append(finding("CONFIG_MISMATCH", "hidden_size", msg, WEIGHTS_FILE))
    # What the orbax target plans for this model and layout (experts stacked, fused Linears split): one plan for
    # writer and lint. A quantized layout stores every Linear weight quantized.
    plan = plan_checkpoint(shape, layout, lambda name: layout.scales)
    want = {t.name: (t.dtype, t.shape) for t in checkpoint_tensors(plan).values()}
    for name, (dtype, dims) in want.items():
        have = planned.get(name)
        scale = name.endswith(SCALE_SUFFIX)
        if have is None:
            out.append(
                finding(
                    "SCALE_MISSING" if scale else "TENSOR_MISSING",
                    name,
                    f"config.json implies {dtype} {list(dims)}",
                    WEIGHTS_FILE,
                )
            )
            continue
        if have[0] != dtype:
            out.append(
                finding("TENSOR_DTYPE", name, f"is {have[0]}; the {layout.name} layout stores {dtype}", WEIGHTS_FILE)
            )
        if have[1] != dims:
            code = "SCALE_SHAPE" if scale else "TENSOR_SHAPE"
            out.append(finding(code, name, f"is {list(have[1])}; config.json implies {list(dims)}", WEIGHTS_FILE))
    for name in sorted(set(planned) - set(want)):
        out.append(
            finding(
                "TENSOR_UNEXPECTED",
                name,
                f"no tensor of {shape.architecture} in the {layout.name} layout",
                WEIGHTS_FILE,
            )
        )
    return out


def _sharding(doc: Any, planned: dict[str, tuple[str, tuple[int, ...]]]) -> list[Finding]:
    specs = doc.get("partition_specs") if isinstance(doc, dict) else None
    if not isinstance(specs, dict):
        return [finding("JSON_INVALID", "partition_specs", "must map tensor names to partition specs", SHARDING_FILE)]
    out = []
    for name in sorted(set(planned) ^ set(specs)):
        where = WEIGHTS_FILE if name in planned else SHARDING_FILE
        msg = f"in {where} only: the runtime places every tensor of {WEIGHTS_FILE} by its spec"
        out.append(finding("ORBAX_SHARDING", name, msg, SHARDING_FILE))
    for name, spec in specs.items():
        if name in planned and (not isinstance(spec, list) or len(spec) != len(planned[name][1])):
            msg = f"spec {spec!r:.60} does not name one mesh axis (or null) per dimension of {list(planned[name][1])}"
            out.append(finding("ORBAX_SHARDING", name, msg, SHARDING_FILE))
    return out


def _arrays(root: Path, planned: dict[str, tuple[str, tuple[int, ...]]], report: LintReport) -> dict[str, Path]:
    """Each tensor's zarr3 array directory, checked against weights.json by its own metadata."""
    ckpt = root / CHECKPOINT_DIR
    state = ckpt / STATE
    if not (ckpt / COMMIT_MARKER).is_file():
        report.add(
            finding(
                "FILE_MISSING", f"{CHECKPOINT_DIR}/{COMMIT_MARKER}", "orbax restores committed checkpoints only", None
            )
        )
    if not state.is_dir():
        report.add(finding("FILE_MISSING", f"{CHECKPOINT_DIR}/{STATE}", "the checkpoint holds no weights", None))
        return {}
    arrays = {p.name: p for p in state.iterdir() if p.is_dir()}
    found: dict[str, Path] = {}
    for name, (dtype, dims) in planned.items():
        where = f"{CHECKPOINT_DIR}/{STATE}/{name}"
        path = arrays.get(name)
        meta = read_json(path, ZARR, report, required=False) if path is not None else None
        if path is None or meta is None:
            report.add(
                finding(
                    "TENSOR_MISSING", name, f"{WEIGHTS_FILE} lists it and the checkpoint has no array for it", where
                )
            )
            continue
        if not isinstance(meta, dict):
            continue
        if meta.get("data_type") != dtype:
            report.add(
                finding(
                    "TENSOR_DTYPE",
                    name,
                    f"the checkpoint holds {meta.get('data_type')}; {WEIGHTS_FILE} says {dtype}",
                    where,
                )
            )
        if tuple(meta.get("shape") or ()) != dims:
            report.add(
                finding(
                    "TENSOR_SHAPE",
                    name,
                    f"the checkpoint holds {meta.get('shape')}; {WEIGHTS_FILE} says {list(dims)}",
                    where,
                )
            )
        found[name] = path
    for name in sorted(set(arrays) - set(planned)):
        report.add(
            finding(
                "TENSOR_UNEXPECTED",
                name,
                f"an array of the checkpoint {WEIGHTS_FILE} does not list",
                f"{CHECKPOINT_DIR}/{STATE}/{name}",
            )
        )
    return found


def _scales(
    root: Path, planned: dict[str, tuple[str, tuple[int, ...]]], arrays: dict[str, Path], report: LintReport
) -> None:
    names = [n for n in planned if n.endswith(SCALE_SUFFIX) and n in arrays]
    if not names:
        return
    try:
        import tensorstore as ts
    except ImportError:
        report.add(
            finding(
                "SCALES_UNREAD", names[0], f"tensorstore is not installed: {len(names)} scale arrays not read", None
            )
        )
        return
    for name in names:
        where = f"{CHECKPOINT_DIR}/{STATE}/{name}"
        try:
            array = ts.open(
                {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(arrays[name])}}, open=True
            ).result()
            values = array.read().result()
        except (ValueError, RuntimeError, KilnError) as e:
            report.add(finding("TENSOR_DTYPE", name, f"tensorstore cannot read it: {e}", where))
            continue
        report.extend(judge(name, count(values.astype("float32")), where))
        report.scales += 1
        report.scale_bytes += int(values.nbytes)
        del values
