"""The quantize stage's output: one scheme's quantized Linear tensors and its `quantization_config`.

    out_dir/quantized.safetensors       every tensor the scheme stores quantized (compressed-tensors names)
    out_dir/quantization_config.json    the config.json block, as compressed-tensors writes it

A pre-quantized source's quantized tensors are read as the catalog's route for the scheme says
(`quant.catalog.source_route`): kept as stored (fp8-block from an FP8-block release: its FP8 values' bytes, and
its `weight_scale_inv` as `weight_scale`, in the dtype it is stored in), or dequantized into float32 first and
quantized as a bf16 source's weights are. The file's metadata and the stage's record say which
(`passed_through`, `dequantized`: the layout), so nothing downstream takes them for a bf16 source's.

Only the tensors the scheme changes are stored; everything else is the ingested source's own bf16
tensor, so a consumer merges the two (`QuantizedWeights.replaces` says which source tensors are
replaced). Besides the quantized Linear weights that can be a few bf16 tensors under their source
names: AWQ folds its smoothing scales into the layer before (the RMSNorm weights). Written with the
streaming SafeTensors writer, planned from the source header.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kiln.core.error_codes import Codes
from kiln.core.errors import StageFailed
from kiln.formats.safetensors import DTYPES, SafeTensorsWriter, TensorInfo, read_header
from kiln.quant.catalog import get_method, get_scheme, source_route
from kiln.quant.rtn import check_shapes, kv_scale_names, planned_tensors, quantize_weight, quantizes, router_modules
from kiln.quant.schemes import HEAD_CHOICES, HeadChoice, Scheme

if TYPE_CHECKING:
    import torch

    from kiln.formats.hf_model import SourceModel
    from kiln.quant.calibrated import CalibratedWeights

TENSORS_FILE = "quantized.safetensors"
CONFIG_FILE = "quantization_config.json"


def write_quantized(
    source: SourceModel,
    scheme: Scheme,
    out_dir: Path,
    on_progress: Callable[[int], None] = lambda n: None,
    calibrated: CalibratedWeights | None = None,
) -> dict[str, Any]:
    """Quantize `source` under `scheme` into `out_dir`, one tensor in memory at a time; returns a summary.

    Round-to-nearest schemes read each weight from `source`. llm-compressor's (GPTQ, AWQ, FP4) pass what it
    chose (`quant.calibrated`): per Linear weight its values, scales and other parameters (NVFP4's tensor
    scales), plus the non-Linear tensors calibration changed; those are stored in bf16 under their own names.
    """
    import torch

    from kiln.quant.compressed import quantization_config

    if not scheme.quantized:
        raise ValueError(f"scheme {scheme.name!r} does not quantize; nothing to write")
    if get_method(scheme.name).release_only:
        raise ValueError(f"scheme {scheme.name!r} is a release's own layout, kept by the export: nothing to quantize")
    if scheme.by_llmcompressor != (calibrated is not None):
        raise ValueError(
            f"scheme {scheme.name!r} ({scheme.method}): llm-compressor's weights are given exactly for its methods"
        )
    check_shapes(scheme, {n: t.shape for n, t in source.tensors.items()})
    replaced = [n for n in source.tensors if quantizes(scheme, n)]
    released = source.quantized
    route = source_route(get_method(scheme.name), released.quantization) if released is not None else None
    # The release's quantized tensors the scheme keeps as stored, and those it dequantizes first.
    kept_stored = [n for n in replaced if route is not None and route.action == "keep" and source.is_quantized(n)]
    dequantized = [n for n in replaced if source.is_quantized(n) and n not in kept_stored]
    changed = dict(calibrated.changed) if calibrated is not None else {}
    for n, t in changed.items():
        if n not in source.tensors or quantizes(scheme, n) or tuple(t.shape) != source.tensors[n].shape:
            raise StageFailed(
                f"{scheme.name}: calibration changed {n!r} {tuple(t.shape)}, not a source tensor it keeps"
            )
    # The head's choice beside the scheme's name, only when it is not the preset's (stored outputs keep their bytes).
    head = {"lm_head": scheme.lm_head} if scheme.lm_head != "kept" else {}
    layout = released.quantization.layout.name if released is not None else None
    # `passed_through` only where every tensor the scheme stores is the release's as stored (a module the release
    # left unquantized, quantized here, makes the output kiln's own quantization like any other).
    provenance = {
        **({"passed_through": layout} if kept_stored and len(kept_stored) == len(replaced) and layout else {}),
        **({"dequantized": layout} if dequantized and layout else {}),
    }
    writer = SafeTensorsWriter(
        out_dir / TENSORS_FILE, metadata={"format": "pt", "scheme": scheme.name, **head, **provenance}
    )
    plan: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    for n in replaced:
        plan[n] = _kept_planned(source, n) if n in kept_stored else planned_tensors(scheme, n, source.tensors[n].shape)
        for out_name, dtype, shape in plan[n]:
            writer.add(out_name, dtype, shape)
    kept = [n for n in source.tensors if n in changed]
    for n in kept:
        writer.add(n, "BF16", source.tensors[n].shape)
    kv = dict(calibrated.kv_scales) if calibrated is not None else {}
    if set(kv) != set(kv_scale_names(source.tensors) if scheme.kv_cache is not None else []):
        raise StageFailed(
            f"{scheme.name}: calibration gave KV-cache scales {sorted(kv)[:4]}, not one K and V per layer"
        )
    for n in kv:
        writer.add(n, "F32", (1,))
    writer.begin()
    stored = 0
    try:
        for n in replaced:
            if n in kept_stored:
                produced = _kept(source, n)
            elif calibrated is None or n not in calibrated.scales:  # round-to-nearest (beside a calibrated KV cache)
                produced = list(quantize_weight(n, source.dequantized(n), scheme))
            else:
                produced = list(
                    quantize_weight(
                        n, calibrated.weights[n], scheme, scale=calibrated.scales[n], qparams=calibrated.qparams.get(n)
                    )
                )
            for (out_name, t), (want_name, dtype, shape) in zip(produced, plan[n], strict=True):
                if out_name != want_name or tuple(t.shape) != shape or str(t.dtype) != f"torch.{DTYPES[dtype].torch}":
                    raise StageFailed(
                        f"{scheme.name}: quantizing {n} gave {out_name} {t.dtype} {tuple(t.shape)}, "
                        f"planned {want_name} {dtype} {shape}",
                        code=Codes.QUANTIZE_PLAN_MISMATCH,
                    )
                writer.write(out_name, _raw_bytes(t))
                stored += t.numel() * t.element_size()
            on_progress(source.tensors[n].nbytes)
        for n in kept:
            t = changed[n].to(torch.bfloat16)
            writer.write(n, _raw_bytes(t))
            stored += t.numel() * t.element_size()
        for n, t in kv.items():
            writer.write(n, _raw_bytes(t.to(torch.float32).reshape(1)))
            stored += 4
        writer.close()
    except BaseException:
        writer.abort()
        raise
    (out_dir / CONFIG_FILE).write_text(
        json.dumps(quantization_config(scheme, router_modules(source.shape.tensors())), indent=2, sort_keys=True)
    )
    return {
        "scheme": scheme.model_dump(mode="json"),
        "format": scheme.format,
        **provenance,
        "replaced": len(replaced),
        "changed_bf16": kept,
        "stored_bytes": stored,
        "source_bytes": sum(source.tensors[n].nbytes for n in replaced),
    }


def _kept_planned(source: SourceModel, name: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """What `_kept` yields for a released FP8-block weight: its values and scales as stored, under compressed-tensors'
    names (`<module>.weight`, `<module>.weight_scale`)."""
    assert source.quantized is not None
    qt = source.quantized.tensors[name]
    module = name.removesuffix(".weight")
    return [
        (f"{module}.weight", qt.values.dtype, qt.values.shape),
        (f"{module}.weight_scale", qt.scale.dtype, qt.scale.shape),
    ]


def _kept(source: SourceModel, name: str) -> list[tuple[str, torch.Tensor]]:
    """A released FP8-block weight as it is stored, its scales checked (finite, > 0) and its values (no NaN):
    compressed-tensors' block strategy is the release's, `fp8 x scale` per 128 x 128 block, the last one zero-padded
    where it overhangs (compressed-tensors `_process_block`, DeepSeek's `weight_dequant`), so `weight_scale_inv` is
    `weight_scale` renamed."""
    from kiln.formats.prequantized import check_scale, check_values

    assert source.quantized is not None
    qt = source.quantized.tensors[name]
    stored = source.stored(name)
    values, scale = stored[qt.values.name], stored[qt.scale.name]
    check_scale(source.quantized.quantization, qt, scale)
    check_values(source.quantized.quantization, qt, values)
    module = name.removesuffix(".weight")
    return [(f"{module}.weight", values), (f"{module}.weight_scale", scale)]


def _raw_bytes(t: torch.Tensor) -> bytes:
    import torch

    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


@dataclass
class QuantizedWeights:
    """A finished quantize output, opened lazily: header planned, tensors read one at a time."""

    root: Path
    scheme: Scheme
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    # A pre-quantized source's layout whose stored tensors this output keeps as they are, and the one it
    # dequantized tensors of before quantizing them (None: none).
    passed_through: str | None = None
    dequantized: str | None = None

    def replaces(self, source_name: str) -> bool:
        """Whether the source tensor `source_name` is stored here (quantized, or changed by calibration)."""
        return quantizes(self.scheme, source_name) or source_name in self.tensors

    def module_tensors(self, source_name: str) -> list[str]:
        """The stored names that replace source tensor `source_name`, in file order.

        For a quantized `<module>.weight` these are its compressed tensors (`<module>.weight_packed`, ...,
        and NVFP4's `<module>.input_global_scale`); for a tensor calibration changed, the tensor itself.
        """
        if quantizes(self.scheme, source_name):
            prefix = source_name.removesuffix(".weight") + "."
            names = [
                n
                for n in self.tensors
                if n.startswith(prefix) and n.removeprefix(prefix).startswith(("weight", "input_global_scale"))
            ]
        else:
            names = [source_name] if source_name in self.tensors else []
        if not names:
            raise StageFailed(f"quantized output for {self.scheme.name} has no tensors for {source_name}")
        return names

    def kv_scales(self) -> list[str]:
        """An FP8 KV cache's scale tensors (`<layer>.self_attn.k_scale` / `v_scale`), in file order; [] for none."""
        if self.scheme.kv_cache is None:
            return []
        return [n for n in self.tensors if n.endswith((".self_attn.k_scale", ".self_attn.v_scale"))]

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.root / TENSORS_FILE), framework="pt") as handle:
            t: torch.Tensor = handle.get_tensor(name)
        return t


def open_quantized(root: Path, scheme_name: str) -> QuantizedWeights:
    """A quantize output of scheme `scheme_name`, its `lm_head` kept or quantized as it was written."""
    infos, meta = read_header(root / TENSORS_FILE, TENSORS_FILE)
    if meta.get("scheme") != scheme_name:
        raise StageFailed(f"{root / TENSORS_FILE} holds scheme {meta.get('scheme')!r}, expected {scheme_name!r}")
    head = meta.get("lm_head", "kept")
    if head not in HEAD_CHOICES:
        raise StageFailed(f"{root / TENSORS_FILE}: lm_head {head!r} is none of {', '.join(HEAD_CHOICES)}")
    scheme = get_scheme(scheme_name, cast("HeadChoice", head))
    config = json.loads((root / CONFIG_FILE).read_text())
    return QuantizedWeights(
        root=root,
        scheme=scheme,
        config=config,
        tensors={t.name: t for t in infos},
        passed_through=meta.get("passed_through"),
        dequantized=meta.get("dequantized"),
    )
