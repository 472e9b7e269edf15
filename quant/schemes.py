"""Quantization schemes as frozen, validated data with named presets, and where each one runs.

A `Scheme` says how the Linear layers of a model are stored (weights) and computed (activations);
embeddings, norms and `lm_head` stay bf16. Its field names follow compressed-tensors'
`QuantizationArgs` so that `quant.compressed` can hand it over unchanged, and `format` is
compressed-tensors' own name for how the weights lie on disk (its `CompressionFormat`), chosen
exactly as compressed-tensors 0.19 `infer_module_format` would choose it:

- float weights with activation quantization -> `float-quantized` (fp8 W8A8-dynamic, per channel or
  in 128x128 blocks)
- int weights, no activation quantization    -> `pack-quantized`  (W4A16 and W8A16 alike: 32 / bits
  values per int32)
- int weights with int activations           -> `int-quantized`   (int8 W8A8: one int8 per weight)
- no quantization                            -> `dense`

This module is plain data (no torch): the registry imports `targets`.

Hardware compatibility (`compatibility(scheme)`), with the facts it rests on:

- NVIDIA FP8 tensor cores start at Ada/Hopper (sm89+), so fp8 does not run natively on an A100
  (sm80); vLLM's compressed-tensors W8A8-FP8 path needs capability 89. Block-scaled fp8 (128x128
  weight blocks, activations per token in groups of 128) runs through CUTLASS/DeepGEMM on sm90+ and
  vLLM's Triton block kernel on sm89.
- int8 W8A8 (dynamic per-token int8 activations) runs through vLLM's CUTLASS int8 scaled-mm on
  NVIDIA sm75+ and its Triton int8 scaled-mm on ROCm.
- AMD MI300X/MI325X (gfx942) compute in float8_e4m3fnuz, MI350/MI355X (gfx950) in OCP e4m3fn.
  vLLM converts an e4m3fn checkpoint on gfx942 at load (the -128 bit pattern becomes 0, scales
  double), so fp8 bundles list mi300x/mi325x with that note.
- Weight-only int4/int8 (W4A16/W8A16, compressed-tensors `pack-quantized`) run through vLLM's
  WNA16 kernels (Marlin, Machete) on NVIDIA sm80+ and through its Triton/ExLlama kernels on ROCm.
- GPTQ and AWQ (`method`) only choose the int4 values and scales, from calibration data; the
  checkpoint is the same `pack-quantized` W4A16 layout as round-to-nearest, so it runs wherever
  int4-rtn runs. On ROCm vLLM runs AWQ through Triton kernels (no Marlin there).
- On an x86_64 CPU every scheme runs through transformers + compressed-tensors, which decompresses the
  weights to bf16/fp32 (no speed-up, same numbers as the GPU kernels up to arithmetic order).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.errors import UnknownName
from core.hardware import PROFILES, HardwareProfile

QuantType = Literal["int", "float"]
CompressionFormat = Literal["dense", "pack-quantized", "float-quantized", "int-quantized"]
# How the quantized values are chosen: `none` (unquantized), round-to-nearest from the weights alone,
# or calibrated on sample text by llm-compressor (GPTQ: Hessian-based error feedback; AWQ:
# activation-aware per-channel smoothing, then round-to-nearest).
QuantMethod = Literal["none", "rtn", "gptq", "awq"]
CALIBRATED_METHODS: tuple[QuantMethod, ...] = ("gptq", "awq")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WeightQuant(_Frozen):
    """How a Linear weight is quantized (compressed-tensors `QuantizationArgs` for `weights`)."""

    num_bits: Literal[4, 8]
    type: QuantType
    strategy: Literal["channel", "group", "block"]
    group_size: int | None = Field(default=None, gt=0, description="input columns per scale (group strategy only)")
    block_structure: tuple[int, int] | None = Field(
        default=None, description="(rows, columns) of weight per scale (block strategy only)"
    )
    symmetric: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> WeightQuant:
        if (self.strategy == "group") != (self.group_size is not None):
            raise ValueError(f"group_size is set exactly when strategy is 'group'; got {self.strategy!r}")
        if (self.strategy == "block") != (self.block_structure is not None):
            raise ValueError(f"block_structure is set exactly when strategy is 'block'; got {self.strategy!r}")
        if self.block_structure is not None and min(self.block_structure) <= 0:
            raise ValueError(f"block_structure must be positive; got {list(self.block_structure)}")
        if self.type == "float" and self.num_bits != 8:
            raise ValueError("float weights are 8-bit (FP8 E4M3)")
        if not self.symmetric:
            raise ValueError("only symmetric weight quantization is supported (no zero points)")
        return self


class ActivationQuant(_Frozen):
    """Dynamic activation quantization, computed at run time (no calibration): one scale per token, or
    per token and group of `group_size` input columns."""

    num_bits: Literal[8]
    type: QuantType
    strategy: Literal["token", "group"] = "token"
    group_size: int | None = Field(default=None, gt=0)
    dynamic: Literal[True] = True
    symmetric: Literal[True] = True

    @model_validator(mode="after")
    def _consistent(self) -> ActivationQuant:
        if (self.strategy == "group") != (self.group_size is not None):
            raise ValueError(f"group_size is set exactly when strategy is 'group'; got {self.strategy!r}")
        return self


class Scheme(_Frozen):
    """A named quantization scheme for the Linear layers of a model."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$")
    description: str
    weights: WeightQuant | None = None  # None: the checkpoint's bf16 weights, unquantized
    input_activations: ActivationQuant | None = None
    format: CompressionFormat
    method: QuantMethod
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)

    @model_validator(mode="after")
    def _format_matches(self) -> Scheme:
        want = _expected_format(self.weights, self.input_activations)
        if self.format != want:
            raise ValueError(f"scheme {self.name!r}: format {self.format!r} does not match its quantization; {want!r}")
        if (self.method == "none") != (self.weights is None):
            raise ValueError(f"scheme {self.name!r}: method 'none' is exactly for unquantized schemes")
        if self.method in CALIBRATED_METHODS and (
            self.weights is None or self.weights.type != "int" or self.input_activations is not None
        ):
            raise ValueError(f"scheme {self.name!r}: {self.method} calibrates int weights only (weight-only WnA16)")
        return self

    @property
    def quantized(self) -> bool:
        return self.weights is not None

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration text (GPTQ, AWQ)."""
        return self.method in CALIBRATED_METHODS


def _expected_format(w: WeightQuant | None, a: ActivationQuant | None) -> CompressionFormat:
    """compressed-tensors 0.19's choice (`compressors.format.infer_module_format`) for our schemes."""
    if w is None:
        if a is not None:
            raise ValueError("activation quantization without weight quantization is not supported")
        return "dense"
    if w.type == "float":
        if a is None or a.type != "float":
            raise ValueError("fp8 weights need fp8 activations here (W8A8-FP8); weight-only fp8 is not a preset")
        return "float-quantized"
    if a is None:
        return "pack-quantized"
    if a.type != "int":
        raise ValueError("int weights with float activations are not supported")
    return "int-quantized"


_DEFAULT_GROUP = 128

# The int4 weight layout shared by round-to-nearest, GPTQ and AWQ: only how scales are chosen differs.
_W4_GROUPED = WeightQuant(num_bits=4, type="int", strategy="group", group_size=_DEFAULT_GROUP)

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in [
        Scheme(name="bf16", description="the checkpoint's bf16 weights, unquantized", format="dense", method="none"),
        Scheme(
            name="fp8",
            description="FP8 E4M3 weights per output channel (scale = absmax / 448), dynamic per-token FP8 activations",
            weights=WeightQuant(num_bits=8, type="float", strategy="channel"),
            input_activations=ActivationQuant(num_bits=8, type="float"),
            format="float-quantized",
            method="rtn",
        ),
        Scheme(
            name="fp8-block",
            description="FP8 E4M3 weights with one scale per 128x128 block, dynamic FP8 activations per token "
            "and 128 columns",
            weights=WeightQuant(num_bits=8, type="float", strategy="block", block_structure=(128, 128)),
            input_activations=ActivationQuant(num_bits=8, type="float", strategy="group", group_size=128),
            format="float-quantized",
            method="rtn",
        ),
        Scheme(
            name="int8-w8a8",
            description="W8A8: symmetric int8 weights per output channel, dynamic per-token int8 activations",
            weights=WeightQuant(num_bits=8, type="int", strategy="channel"),
            input_activations=ActivationQuant(num_bits=8, type="int"),
            format="int-quantized",
            method="rtn",
        ),
        Scheme(
            name="int8-w8a16",
            description="W8A16: symmetric int8 weights per output channel, bf16 activations",
            weights=WeightQuant(num_bits=8, type="int", strategy="channel"),
            format="pack-quantized",
            method="rtn",
        ),
        Scheme(
            name="int4-rtn",
            description="W4A16: symmetric int4 weights, round-to-nearest, one scale per 128 input columns",
            weights=_W4_GROUPED,
            format="pack-quantized",
            method="rtn",
        ),
        Scheme(
            name="w4a16-gptq",
            description="W4A16: symmetric int4 weights, one scale per 128 input columns, chosen by GPTQ on sample text",
            weights=_W4_GROUPED,
            format="pack-quantized",
            method="gptq",
        ),
        Scheme(
            name="w4a16-awq",
            description="W4A16: symmetric int4 weights, one scale per 128 input columns, AWQ-smoothed on sample text",
            weights=_W4_GROUPED,
            format="pack-quantized",
            method="awq",
        ),
    ]
}


def get_scheme(name: str) -> Scheme:
    """The preset called `name`; an unknown name is an error listing the known ones."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise UnknownName(
            f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}",
            details={"scheme": name, "known": list(SCHEMES)},
        ) from None


class Verdict(_Frozen):
    """Whether a scheme runs on one hardware profile, and why."""

    compatible: bool
    reason: str


def _fnuz_fp8(arch: str) -> str:
    return (
        f"{arch} computes in float8_e4m3fnuz; vLLM converts this e4m3fn checkpoint at load "
        "(the -128 bit pattern becomes 0, scales double)"
    )


def _verdict(scheme: Scheme, hw: HardwareProfile) -> Verdict:
    if hw.family == "cpu":
        if hw.arch != "x86_64":
            return Verdict(
                compatible=False,
                reason=f"{hw.name} ({hw.arch}) is served GGUF by llama.cpp; bundles are tested on x86_64",
            )
        if scheme.quantized:
            return Verdict(compatible=True, reason="transformers + compressed-tensors decompress the weights on CPU")
        return Verdict(compatible=True, reason="transformers on CPU")
    if hw.family not in ("cuda", "rocm"):
        return Verdict(compatible=False, reason=f"{hw.family} does not run vLLM or transformers bundles")
    w = scheme.weights
    if hw.family == "cuda":
        cc = hw.compute_capability or 0
        if cc < 80:
            return Verdict(compatible=False, reason=f"vLLM needs sm80+; {hw.name} is {hw.arch}")
        if w is None:
            return Verdict(compatible=True, reason=f"bf16 on {hw.arch}")
        if w.type == "float":
            if cc < 89:
                return Verdict(
                    compatible=False, reason=f"FP8 tensor cores need sm89+ (Ada/Hopper); {hw.name} is {hw.arch}"
                )
            if w.strategy == "block":
                kernel = "CUTLASS/DeepGEMM block-scaled" if cc >= 90 else "Triton block-scaled"
                return Verdict(compatible=True, reason=f"FP8 (e4m3fn) 128x128-block matmuls via {kernel} on {hw.arch}")
            return Verdict(compatible=True, reason=f"native FP8 (e4m3fn) matmuls on {hw.arch}")
        if scheme.input_activations is not None:
            return Verdict(compatible=True, reason=f"int8 W8A8 through vLLM's CUTLASS int8 scaled-mm on {hw.arch}")
        return Verdict(compatible=True, reason=f"W{w.num_bits}A16 through vLLM's Marlin/Machete kernels on sm80+")
    # ROCm
    if w is None:
        return Verdict(compatible=True, reason=f"bf16 on {hw.arch}")
    if w.type == "float":
        if hw.fp8 == "e4m3fnuz":
            return Verdict(compatible=True, reason=_fnuz_fp8(hw.arch))
        if hw.fp8 == "e4m3fn":
            return Verdict(
                compatible=True, reason=f"{hw.arch} computes in OCP float8_e4m3fn, the checkpoint's own type"
            )
        return Verdict(compatible=False, reason=f"{hw.name} ({hw.arch}) has no FP8 units")
    if scheme.input_activations is not None:
        return Verdict(compatible=True, reason=f"int8 W8A8 through vLLM's Triton int8 scaled-mm on ROCm ({hw.arch})")
    if scheme.method == "awq":
        return Verdict(
            compatible=True, reason=f"AWQ W{w.num_bits}A16 through vLLM's Triton AWQ kernels on ROCm ({hw.arch})"
        )
    return Verdict(compatible=True, reason=f"W{w.num_bits}A16 through vLLM's Triton kernels on ROCm ({hw.arch})")


def compatibility(scheme: Scheme, profiles: dict[str, HardwareProfile] | None = None) -> dict[str, Verdict]:
    """For every hardware profile: whether a bundle of `scheme` runs on it, and why (or why not)."""
    return {name: _verdict(scheme, hw) for name, hw in (profiles or PROFILES).items()}


def compatible_hardware(scheme: Scheme) -> dict[str, str]:
    """Hardware a bundle of `scheme` runs on, with the reason for each."""
    return {name: v.reason for name, v in compatibility(scheme).items() if v.compatible}
