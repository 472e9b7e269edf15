"""Write a ROCm bundle: the hf-bundle layout for one AMD GPU architecture, with the runtime it is built for.

The tensors, config.json and tokenizer are those of `hf-bundle` (`targets.hf_bundle.export`). On top:

- the manifest records the runtime the bundle is validated for (vLLM and ROCm versions, from the
  recipe, and the gfx architecture) and how FP8 runs there (`ROCM_ARCHES`);
- the artifact is offered only to hardware of that architecture;
- for gfx942 the FP8 weights can be written already converted to float8_e4m3fnuz
  (`fp8_dtype: e4m3fnuz`, see `targets.rocm_bundle.fnuz`), instead of leaving vLLM to convert them
  at every load.

Only the numerics are evaluated on this machine (transformers + compressed-tensors on CPU, the same
values vLLM's kernels compute up to arithmetic order); running the bundle under vLLM on that GPU is
recorded as not done here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.core.hardware import PROFILES
from kiln.quant.catalog import SCHEMES, compatibility, get_method, get_scheme
from kiln.quant.schemes import Verdict
from kiln.targets.base import ExportRequest, ExportResult
from kiln.targets.hf_bundle.export import (
    DEFAULT_SHARD_BYTES,
    Planned,
    bundle_runtime,
    bundle_tensors,
    checked_inputs,
    write_bundle,
)
from kiln.targets.rocm_bundle.fnuz import fnuz_scale, fnuz_weight

CODE_VERSION = "2"  # 2: config.json carries the family's implied_config keys (hf-bundle 3)
QUANTS = tuple(SCHEMES)


@dataclass(frozen=True)
class RocmArch:
    """What one AMD GPU architecture computes FP8 in, and how an OCP e4m3fn checkpoint gets there."""

    fp8_compute: str | None  # None: the architecture has no FP8 units
    fp8_checkpoint: tuple[str, ...]  # checkpoint FP8 dtypes a bundle for this arch may carry
    conversion: str  # what happens to an e4m3fn checkpoint at load


def _rocm_arch(flavour: str | None) -> RocmArch:
    """An architecture's FP8 handling, from the FP8 flavour the hardware catalog gives its devices."""
    if flavour == "e4m3fnuz":
        return RocmArch(
            fp8_compute="float8_e4m3fnuz",
            fp8_checkpoint=("e4m3fn", "e4m3fnuz"),
            conversion="vLLM converts e4m3fn at load: the -128 bit pattern becomes 0, scales double",
        )
    if flavour == "e4m3fn":
        return RocmArch(
            fp8_compute="float8_e4m3fn",
            fp8_checkpoint=("e4m3fn",),
            conversion="none: the hardware computes in OCP e4m3fn, the checkpoint's own type",
        )
    return RocmArch(fp8_compute=None, fp8_checkpoint=("e4m3fn",), conversion="no FP8 units: not served FP8")


def _rocm_arches() -> dict[str, RocmArch]:
    flavours: dict[str, set[str | None]] = {}
    for hw in PROFILES.values():
        if hw.family == "rocm":
            flavours.setdefault(hw.arch, set()).add(hw.fp8)
    for arch, kinds in flavours.items():
        if len(kinds) > 1:
            raise InvalidInput(
                f"hardware catalog: the {arch} devices disagree on their FP8 type ({sorted(map(str, kinds))})",
                code=Codes.HARDWARE_CATALOG_INVALID,
            )
    return {arch: _rocm_arch(next(iter(kinds))) for arch, kinds in sorted(flavours.items())}


# The AMD architectures of the hardware catalog (gfx942: MI300X/MI325X, gfx950: MI350X/MI355X).
ROCM_ARCHES: dict[str, RocmArch] = _rocm_arches()
_VERSION = r"^[0-9]+(\.[0-9]+){1,3}([.+-][A-Za-z0-9.]+)?$"


class RocmParams(BaseModel):
    """The recipe's `params` for a rocm-bundle entry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gfx_arch: str = Field(description="an AMD architecture of the hardware catalog, e.g. gfx942")
    vllm: str = Field(pattern=_VERSION, description="vLLM version the bundle is validated for")
    rocm: str = Field(pattern=_VERSION, description="ROCm version the bundle is validated for")
    fp8_dtype: Literal["e4m3fn", "e4m3fnuz"] = "e4m3fn"
    max_shard_bytes: int = Field(default=DEFAULT_SHARD_BYTES, gt=0)


def parse_params(params: dict[str, Any]) -> RocmParams:
    """Validated params; an FP8 dtype the architecture does not compute in is refused."""
    try:
        parsed = RocmParams.model_validate(params)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'params'}: {err['msg']}" for err in e.errors())
        raise InvalidInput(f"rocm-bundle params: {problems}", code=Codes.TARGET_PARAMS) from None
    if parsed.gfx_arch not in ROCM_ARCHES:
        raise InvalidInput(
            f"rocm-bundle params: gfx_arch {parsed.gfx_arch!r} is not an AMD architecture of the hardware "
            f"catalog; known: {', '.join(ROCM_ARCHES)}",
            code=Codes.TARGET_PARAMS,
        )
    arch = ROCM_ARCHES[parsed.gfx_arch]
    if parsed.fp8_dtype not in arch.fp8_checkpoint:
        raise InvalidInput(
            f"rocm-bundle params: fp8_dtype {parsed.fp8_dtype} is not for {parsed.gfx_arch}, which computes in "
            f"{arch.fp8_compute or 'no FP8'}; use {' or '.join(arch.fp8_checkpoint)}",
            code=Codes.TARGET_PARAMS,
        )
    return parsed


def check_params(params: dict[str, Any]) -> None:
    parse_params(params)


def arch_hardware(gfx_arch: str) -> list[str]:
    return [name for name, hw in PROFILES.items() if hw.family == "rocm" and hw.arch == gfx_arch]


def rocm_compatibility(quant: str, params: dict[str, Any]) -> dict[str, Verdict]:
    """`TargetSpec.compatibility_fn`: the scheme's verdicts, on the bundle's own architecture only."""
    arch = parse_params(params).gfx_arch
    verdicts = compatibility(get_scheme(quant))
    return {
        hw: v if PROFILES[hw].arch == arch else Verdict(compatible=False, reason=f"this bundle is built for {arch}")
        for hw, v in verdicts.items()
    }


def to_fnuz(planned: list[Planned]) -> list[Planned]:
    """The plan with every FP8 weight stored as e4m3fnuz and its scale doubled (read lazily, one at a time)."""
    fp8_modules = {p.name.removesuffix(".weight") for p in planned if p.dtype == "F8_E4M3"}
    out = []
    for p in planned:
        if p.dtype == "F8_E4M3":
            out.append(replace(p, dtype="F8_E4M3FNUZ", read=_compose(fnuz_weight, p.read)))
        elif p.name.endswith(".weight_scale") and p.name.removesuffix(".weight_scale") in fp8_modules:
            out.append(replace(p, read=_compose(fnuz_scale, p.read)))
        else:
            out.append(p)
    return out


def _compose(f: Any, read: Any) -> Any:
    return lambda: f(read())


def export(source: Any, req: ExportRequest) -> ExportResult:
    params = parse_params(req.params)
    scheme, quantized = checked_inputs("rocm-bundle", req)
    scheme = quantized.scheme if quantized is not None else scheme
    arch = ROCM_ARCHES[params.gfx_arch]
    made = bundle_tensors(source, scheme, quantized, req.on_progress)
    planned = made.planned
    fp8 = get_method(scheme.name).weight_dtype == "float8_e4m3fn"
    if fp8 and params.fp8_dtype == "e4m3fnuz":
        planned = to_fnuz(planned)
    files = write_bundle(source, req.out_dir, planned, made.quantization_config, params.max_shard_bytes)
    runtime = bundle_runtime(source, scheme)
    runtime["platform"] = "rocm"
    runtime["validated_for"] = {"vllm": params.vllm, "rocm": params.rocm, "gfx_arch": params.gfx_arch}
    if fp8:
        runtime["fp8"] = {
            "checkpoint_dtype": f"float8_{params.fp8_dtype}",
            "compute_dtype": arch.fp8_compute,
            "conversion": "pre-converted by kiln (values halved exactly, scales doubled)"
            if params.fp8_dtype == "e4m3fnuz"
            else arch.conversion,
        }
    fp4 = get_method(scheme.name).fp4_format
    if get_method(scheme.name).release_only:
        # gpt-oss's MXFP4 experts on ROCm (quant.methods.fp4): AITER's MoE kernels, enabled by VLLM_ROCM_USE_AITER=1.
        runtime["fp4"] = {
            "format": fp4,
            "kernels": "vLLM's AITER MXFP4 MoE kernels (the aiter package, VLLM_ROCM_USE_AITER=1): CK on gfx950, "
            "Triton W4A16 on gfx942",
        }
    elif fp4 is not None:
        # vLLM's compressed-tensors MXFP4 scheme on ROCm: AITER's kernels where `aiter` is installed on a gfx950,
        # else an emulation (which needs the amd-quark package): serving needs the former.
        runtime["fp4"] = {"format": fp4, "kernels": "vLLM's AITER MXFP4 kernels (the aiter package, gfx950)"}
    verdicts = rocm_compatibility(scheme.name, req.params)
    use = made.use
    return ExportResult(
        files=files,
        runtime=runtime,
        details={
            "shards": sum(f.endswith(".safetensors") for f in files),
            "hardware": {hw: v.model_dump() for hw, v in verdicts.items()},
            "validation": {
                "numerics": "transformers + compressed-tensors on CPU",
                "not_run_here": f"vLLM {params.vllm} on ROCm {params.rocm} ({params.gfx_arch}): "
                f"needs a runner with {' or '.join(arch_hardware(params.gfx_arch))}",
            },
        },
        hardware={hw: v.reason for hw, v in verdicts.items() if v.compatible},
        passed_through=use.passed_through,
        dequantized=use.dequantized,
    )
