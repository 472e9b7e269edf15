"""Write a TensorRT-LLM checkpoint: the HF-format directory its PyTorch backend loads, per `formats.FORMATS`.

Everything is the hf-bundle writer's (`targets.hf_bundle.export`): tensors come from the source or
the shared quantize stage's output, one at a time, nothing is quantized again. What differs:

- bf16, fp8, fp8-block: the hf-bundle itself (plain, or compressed-tensors in config.json, which
  TensorRT-LLM maps to FP8_PER_CHANNEL_PER_TOKEN / FP8_BLOCK_SCALES).
- int4 (W4A16_AWQ): each Linear's compressed-tensors int32 words become TensorRT-LLM's int4 byte
  layout (`pack_int4_rows`), its scales are kept, a unit `pre_quant_scale` is added, and
  hf_quant_config.json says so; config.json carries no quantization_config (the file is authoritative).
- fp8-kv8: the fp8 bundle with its `kv_cache_scheme`, which TensorRT-LLM reads as `kv_cache_quant_algo` FP8. Its
  PyTorch backend runs an FP8 cache with a unit scale (the calibrated scales serve vLLM), so the export records
  the largest calibrated scale: above 1, K or V exceed E4M3's 448 somewhere and would clip there.
- NVFP4: compressed-tensors' tensors under ModelOpt's names, the tensor scales inverted (`to_modelopt_nvfp4`),
  and hf_quant_config.json the same way.
- A family whose model class reads a release's own layout (`TargetMapping.trtllm_release_layouts`,
  `schema.release_layout`): DeepSeek-V3's fp8-block in DeepSeek's spelling (the quantize output's FP8 values and
  scales, the release's bytes where it kept them, each `weight_scale` named `weight_scale_inv`, config.json's
  `quantization_config` the release's `quant_method: fp8`: `to_release_fp8`); gpt-oss's mxfp4-experts, its MXFP4
  release's own layout as hf-bundle writes it (`bundle_tensors`: the experts' stored `*_blocks` / `*_scales` byte for
  byte, `quant_method: mxfp4`). bf16 from that release dequantizes the experts, as hf-bundle's does.
- config.json has the family's `implied_config` keys, as every bundle's (DeepSeek-V3: `moe_layer_freq`); for a class
  that reads its YaRN rope by key (gpt-oss) `rope_theta` and `rope_scaling` from the parsed rope
  (`schema.rope_scaling_config`), which a transformers 5 source spells `rope_parameters`.

The written directory is checked against `schema.check_checkpoint` before export returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kiln.core import __version__
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, StageFailed
from kiln.core.hardware import PROFILES
from kiln.quant.schemes import Scheme, Verdict
from kiln.targets.base import ExportRequest, ExportResult
from kiln.targets.hf_bundle.export import (
    Planned,
    bundle_runtime,
    bundle_tensors,
    checked_inputs,
    write_bundle,
)
from kiln.targets.trtllm.engines import check_converter, check_skus, parse_params, runner
from kiln.targets.trtllm.formats import (
    ENGINE_SKUS,
    FORMATS,
    MIN_PYTORCH_BACKEND,
    RELEASE_ALGOS,
    algo_verdict,
    scheme_verdicts,
)
from kiln.targets.trtllm.schema import (
    FP8_BLOCK,
    HF_QUANT_CONFIG,
    HfQuantConfig,
    check_checkpoint,
    fused_groups,
    model_refusal,
    release_layout,
    rope_scaling_config,
    router_modules,
)

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from kiln.formats.architectures.shape import ModelShape
    from kiln.formats.hf_model import SourceModel
    from kiln.quant.store import QuantizedWeights

CODE_VERSION = "5"  # 5: gpt-oss config.json carries rope_theta and rope_scaling
QUANTS = tuple(FORMATS)
# The schemes written from the shared quantize stage's output (a release layout is the release's bytes).
QUANTIZED = tuple(q for q, f in FORMATS.items() if f.quant_algo is not None and f.layout != "release")
HARDWARE = tuple(ENGINE_SKUS)


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """int4 values [out, in] (int8 in -8..7) -> uint8 [out / 2, in]: row 2j in the low nibble, 2j + 1 in the high."""
    import torch

    if values.shape[0] % 2:
        raise InvalidInput(f"W4A16_AWQ packs pairs of output rows; got {values.shape[0]} rows")
    v = values.to(torch.int16)
    return ((v[0::2] & 15) | ((v[1::2] & 15) << 4)).to(torch.uint8)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4_rows`: uint8 [out / 2, in] -> int8 [out, in] in -8..7."""
    import torch

    b = packed.view(torch.uint8).to(torch.int16)
    rows = torch.stack((b & 15, b >> 4), dim=1).flatten(0, 1)
    return torch.where(rows >= 8, rows - 16, rows).to(torch.int8)


def _int4_values(read_packed: Any, shape: tuple[int, int]) -> Any:
    def read() -> torch.Tensor:
        import torch
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        # compressed-tensors' own unpacking (values -8..7 along the input dimension).
        return pack_int4_rows(unpack_from_int32(read_packed(), 4, torch.Size(shape)))

    return read


def _ones(n: int) -> Any:
    def read() -> torch.Tensor:
        import torch

        return torch.ones(n, dtype=torch.bfloat16)

    return read


def to_modelopt_int4(planned: list[Planned]) -> list[Planned]:
    """The plan with every `<m>.weight_packed` / `weight_scale` / `weight_shape` as W4A16_AWQ's
    `<m>.weight` / `weight_scale` / `pre_quant_scale` (read lazily, one module at a time)."""
    out = []
    columns: dict[str, int] = {}  # module -> input columns, from its packed weight (planned before its shape)
    for p in planned:
        if p.name.endswith(".weight_packed"):
            module = p.name.removesuffix(".weight_packed")
            rows, words = p.shape
            columns[module] = cols = words * 8
            packed = (rows // 2, cols)
            read = _int4_values(p.read, (rows, cols))
            out.append(
                replace(p, name=f"{module}.weight", dtype="U8", shape=packed, nbytes=packed[0] * cols, read=read)
            )
        elif p.name.endswith(".weight_shape"):
            module = p.name.removesuffix(".weight_shape")
            cols = columns[module]
            name = f"{module}.pre_quant_scale"
            out.append(replace(p, name=name, dtype="BF16", shape=(cols,), nbytes=2 * cols, read=_ones(cols)))
        else:
            out.append(p)
    return out


# compressed-tensors NVFP4 -> ModelOpt NVFP4, per Linear: (their name, ours, inverted). The tensor scales are
# reciprocals of each other; the packed values and the E4M3 block scales are the same bytes.
_NVFP4_NAMES = {
    "weight_packed": ("weight", False),
    "weight_scale": ("weight_scale", False),
    "weight_global_scale": ("weight_scale_2", True),
    "input_global_scale": ("input_scale", True),
}


def _reciprocal(read: Any) -> Any:
    def inverted() -> torch.Tensor:
        import torch

        return (1.0 / read().to(torch.float32)).reshape(())

    return inverted


def to_modelopt_nvfp4(planned: list[Planned], fused: dict[str, tuple[str, ...]]) -> list[Planned]:
    """The plan with every compressed-tensors NVFP4 module as ModelOpt's (`_NVFP4_NAMES`), after checking that the
    Linears TensorRT-LLM runs as one GEMM (`fused`: q/k/v, gate/up, each expert's gate/up; `schema.fused_groups`)
    share their tensor scales (each is read now: four bytes)."""
    out = []
    shared: dict[tuple[str, str], tuple[str, float]] = {}  # (fused group, scale) -> (first module, its value)
    for p in planned:
        module, _, local = p.name.rpartition(".")
        if local not in _NVFP4_NAMES or not module.startswith("model.layers."):
            out.append(p)
            continue
        name, inverted = _NVFP4_NAMES[local]
        if inverted:
            group = fused.get(module)
            if group is not None:
                value = float(p.read().reshape(-1)[0])
                first = shared.setdefault((group[0], local), (module, value))
                if first[1] != value:
                    linears = "/".join(m.rpartition(".")[2] for m in group)
                    raise StageFailed(
                        f"trtllm NVFP4: {module}.{local} is {value!r} but {first[0]}.{local} is {first[1]!r}; "
                        f"TensorRT-LLM runs {linears} as one GEMM and needs them equal",
                        code=Codes.TRTLLM_FUSED_SCALES,
                    )
            out.append(replace(p, name=f"{module}.{name}", shape=(), nbytes=4, read=_reciprocal(p.read)))
        else:
            out.append(replace(p, name=f"{module}.{name}"))
    return out


# DeepSeek's FP8 block `quantization_config` (deepseek-ai/DeepSeek-V3 config.json; `formats.prequantized` FP8 block),
# written where the source was not released so.
FP8_RELEASE_CONFIG: dict[str, Any] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}


def to_release_fp8(planned: list[Planned]) -> list[Planned]:
    """The plan with every compressed-tensors block-FP8 scale (`<m>.weight_scale`) under DeepSeek's name,
    `<m>.weight_scale_inv`: the same bytes (DeepSeek's scale multiplies the FP8 block, as compressed-tensors' does;
    `FP8BlockScalesLinearMethod._get_scale_name`: "they hold identical values")."""
    return [replace(p, name=p.name + "_inv") if p.name.endswith(".weight_scale") else p for p in planned]


def written_algo(shape: ModelShape, quant: str) -> str | None:
    """The QuantAlgo TensorRT-LLM reads a trtllm checkpoint of `quant` for this model as (`formats.FORMATS`, or the
    release layout it is written in: `schema.release_layout`)."""
    layout = release_layout(shape, quant)
    return RELEASE_ALGOS[layout] if layout is not None else FORMATS[quant].quant_algo


def unit_scale_kv(quantized: QuantizedWeights) -> dict[str, Any]:
    """What TensorRT-LLM's unit-scale FP8 KV cache means for these calibrated scales (amax / 448 per layer)."""
    scales = {name: float(quantized.tensor(name).float().max()) for name in quantized.kv_scales()}
    worst = max(scales, key=scales.__getitem__)
    return {
        "quant_algo": "FP8",
        "tensorrt_llm_scale": 1.0,
        "calibrated_max_scale": {"tensor": worst, "value": scales[worst]},
        "clips_at_unit_scale": sorted(name for name, value in scales.items() if value > 1.0),
    }


def hf_quant_config(scheme: Scheme, shape: ModelShape) -> HfQuantConfig:
    """hf_quant_config.json for an int4 or NVFP4 scheme, in ModelOpt's legacy shape (the one read whatever the
    producer); int4's W4A16_AWQ layout carries a (unit) pre_quant_scale. exclude_modules: the scheme's ignore
    (lm_head), then every router, by name, as ModelOpt lists them."""
    assert scheme.weights is not None
    algo = FORMATS[scheme.name].quant_algo
    return HfQuantConfig.model_validate(
        {
            "producer": {"name": "kiln", "version": __version__},
            "quantization": {
                "quant_algo": algo,
                "kv_cache_quant_algo": None,
                "group_size": scheme.weights.group_size,
                "has_zero_point": False,
                "pre_quant_scale": algo == "W4A16_AWQ",
                "exclude_modules": [*scheme.ignore, *router_modules(shape)],
            },
        }
    )


def export(source: SourceModel, req: ExportRequest) -> ExportResult:
    """Write the TensorRT-LLM checkpoint for `req.quant` into `req.out_dir` and check it."""
    params = parse_params(req.params)
    fmt = FORMATS.get(req.quant)
    if fmt is None:
        raise InvalidInput(f"trtllm builds {', '.join(QUANTS)}; got {req.quant!r}")
    check_model(source.shape, source.config, req.quant, req.params)
    scheme, quantized = checked_inputs("trtllm", req)
    made = bundle_tensors(source, scheme, quantized, req.on_progress)
    planned, use = made.planned, made.use
    inline = made.quantization_config if fmt.layout in ("compressed-tensors", "release") else None
    layout = release_layout(source.shape, req.quant)
    released = source.config.get("quantization_config") if source.quantized is not None else None
    if layout == "fp8-block":
        planned = to_release_fp8(planned)
        kept = source.shape.source_quant is not None and source.shape.source_quant.layout.name == layout
        inline = released if kept else dict(FP8_RELEASE_CONFIG)
    elif fmt.quant_algo == "W4A16_AWQ":
        planned = to_modelopt_int4(planned)
    elif fmt.quant_algo == "NVFP4":
        planned = to_modelopt_nvfp4(planned, fused_groups(source.shape))
    files = write_bundle(source, req.out_dir, planned, inline, params.max_shard_bytes)
    _write_config_keys(req.out_dir, source.shape)
    if fmt.layout == "modelopt":
        # quantized_layers belongs to MIXED_PRECISION only; the other keys are written even when null, as ModelOpt does.
        config = hf_quant_config(scheme, source.shape).model_dump(
            mode="json", exclude={"quantization": {"quantized_layers"}}
        )
        (req.out_dir / HF_QUANT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        files = sorted([*files, HF_QUANT_CONFIG])
    checked = check_checkpoint(req.out_dir)
    algo = written_algo(source.shape, req.quant)
    if checked.quant_algo != algo:
        raise InvalidInput(f"trtllm-{scheme.name}: wrote {checked.quant_algo}, planned {algo}")
    kv_algo = "FP8" if scheme.kv_cache is not None else None
    if checked.kv_cache_quant_algo != kv_algo:
        raise InvalidInput(f"trtllm-{scheme.name}: wrote KV cache {checked.kv_cache_quant_algo}, planned {kv_algo}")

    runtime = bundle_runtime(source, scheme)
    # Checked against TensorRT-LLM's source, not loaded by any release here; a floor where one is known.
    # A floor is known for kiln's own spellings; a release layout is read as the release is.
    floor = MIN_PYTORCH_BACKEND.get(algo) if layout is None else None
    runtime["loaders"] = {"tensorrt_llm": f">={floor[0]} (PyTorch backend)" if floor else "PyTorch backend"}
    if floor is not None:
        runtime["tensorrt_llm_minimum"] = {"version": floor[0], "why": floor[1]}
    if algo is not None:
        runtime["quantization"] = {
            "quant_algo": algo,
            "read_from": checked.source,
            "scheme": scheme.name,
            "method": scheme.method,
        }
        if layout is not None:
            runtime["quantization"]["release_layout"] = layout
        if kv_algo is not None:
            runtime["quantization"]["kv_cache_quant_algo"] = kv_algo
    # The algo as written (a release layout's, not the scheme's): where it runs and, for the record's `unsupported`,
    # why not elsewhere.
    verdicts = {name: algo_verdict(algo, hw) for name, hw in PROFILES.items()}
    details: dict[str, Any] = {
        "architecture": source.shape.architecture,
        "shards": sum(f.endswith(".safetensors") for f in files),
        "layout": fmt.layout if layout is None else f"release ({layout})",
        "hardware": {hw: v.model_dump() for hw, v in verdicts.items()},
        "validation": {
            "schema": f"TensorRT-LLM {algo or 'bf16'} tensors and {checked.source} checked",
            "numerics": "transformers and vLLM on CPU" if "transformers" in fmt.eval_runtimes else "not evaluated here",
            "not_run_here": "TensorRT-LLM on an NVIDIA GPU",
        },
    }
    if kv_algo is not None and quantized is not None:
        details["kv_cache"] = unit_scale_kv(quantized)
    if params.gpus is not None:
        details["gpu_evals"] = {sku: runner(sku, params.gpus.tensorrt_llm) for sku in params.gpus.skus}
    if params.legacy_engines is not None:
        pin = params.legacy_engines.tensorrt_llm
        details["legacy_engines"] = {sku: runner(sku, pin) for sku in params.legacy_engines.skus}
    return ExportResult(
        files=files,
        runtime=runtime,
        details=details,
        verdicts=verdicts,
        eval_runtimes=fmt.eval_runtimes,
        passed_through=use.passed_through,
        dequantized=use.dequantized,
    )


def _write_config_keys(out: Path, shape: ModelShape) -> None:
    """config.json with the rope keys the family's TensorRT-LLM model class reads by name
    (`schema.rope_scaling_config`)."""
    keys: dict[str, Any] = rope_scaling_config(shape)
    if not keys:
        return
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.update(keys)
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def trtllm_compatibility(quant: str, params: dict[str, Any]) -> dict[str, Verdict]:
    """`TargetSpec.compatibility_fn`: where TensorRT-LLM documents the checkpoint's QuantAlgo."""
    return scheme_verdicts(quant)


def check_params(params: dict[str, Any]) -> None:
    """`TargetSpec.check_params`: the params schema, the SKUs, the pins and the engine limits."""
    parse_params(params)


def check_quant_params(quant: str, params: dict[str, Any]) -> None:
    """`TargetSpec.check_quant_params`: every SKU must serve `quant`, and every pin load or build it (named,
    with the reason)."""
    check_skus(quant, parse_params(params))


def check_model(shape: ModelShape, config: Mapping[str, Any], quant: str, params: dict[str, Any]) -> None:
    """`TargetSpec.check_model_fn`, at plan time and again on export: TensorRT-LLM's PyTorch backend must serve
    this model as `quant` (`schema.model_refusal`: the family's record, the fused MoE's limits; config.json is
    read through `shape`), and a legacy engine needs a release that converts the family
    (`engines.check_converter`)."""
    if FORMATS[quant].layout == "release" and shape.source_quant is not None and release_layout(shape, quant) is None:
        reason = f"TensorRT-LLM's model class of the family reads no {shape.source_quant.layout.name} release layout"
        raise InvalidInput(
            f"trtllm-{quant} cannot serve {shape.architecture} ({shape.family}): {reason}",
            code=Codes.TRTLLM_RELEASE_LAYOUT,
            details={"target": "trtllm", "quant": quant, "architecture": shape.architecture, "reason": reason},
        )
    algo = written_algo(shape, quant)
    refusal = model_refusal(shape, algo)
    if refusal is not None:
        code, reason = refusal
        raise InvalidInput(
            f"trtllm-{quant} cannot serve {shape.architecture} ({shape.family}): {reason}",
            code=code,
            details={"target": "trtllm", "quant": quant, "architecture": shape.architecture, "reason": reason},
        )
    parsed = parse_params(params)
    if algo != FORMATS[quant].quant_algo and parsed.gpus is not None:  # a release layout: its algo's SKUs
        for sku in parsed.gpus.skus:
            verdict = algo_verdict(algo, PROFILES[sku])
            if not verdict.compatible:
                raise InvalidInput(
                    f"trtllm-{quant} of {shape.architecture} on {sku}: {verdict.reason}",
                    code=Codes.ENGINE_SKU_INCOMPATIBLE,
                    details={"quant": quant, "sku": sku, "reason": verdict.reason},
                )
    check_converter(shape, quant, parsed)
