"""A quantization method as one record: how it is stored (its `Scheme`), what it computes in, and where it runs.

A method states everything the rest of kiln asks of a quant name, so nothing re-derives it from the
scheme's fields ("a float scheme means FP8"):

- `weight_dtype`: what a quantized Linear weight is stored as (`bfloat16` when the method leaves it);
- `activation_dtype`: what the matmuls take as input (`bfloat16` for weight-only methods, which dequantize
  before each matmul), hence `matmul_dtype`, the hardware rate it runs at (`core.hardware.MatmulDtype`);
- `kv_cache_dtype`: the KV cache its serving replicas assume (`core.shape.KV_DTYPES`);
- `gate`: its default eval thresholds (`eval.gates` builds its `Gate` from them);
- `on_cuda` / `on_rocm`: its verdict on an NVIDIA GPU of sm80+ and on an AMD GPU (`quant.catalog.compatibility`
  answers the CPU, TPU and pre-sm80 cases the same way for every method first);
- `from_sources`: what it does with a pre-quantized source's quantized tensors, for each released layout
  (`formats.prequantized.LAYOUTS`: fp8-block, mxfp4): `keep` them as stored (the release's own bytes),
  `dequantize` them first and quantize the floats as from a bf16 source, or `refuse`, each with the reason
  (`quant.catalog.source_route`; `kiln plan` gives the refusal);
- `release_only`: it is a release's own layout, built only by keeping a pre-quantized release's bytes (no quantize
  stage: its scheme's method is `released`); `kiln plan` refuses it for a plain source (`quant.catalog.check_source`).

`Method.__post_init__` checks the dtypes against the scheme, so a method cannot say FP8 where its scheme
stores int8. Plain data: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from kiln.core.hardware import Fp4Format, HardwareProfile, MatmulDtype
from kiln.quant.schemes import Scheme, Verdict, WeightQuant

StorageDtype = Literal["bfloat16", "float8_e4m3fn", "float4_e2m1", "int8", "int4"]
ActivationDtype = Literal["bfloat16", "float8_e4m3fn", "float4_e2m1", "int8"]
KvCacheDtype = Literal["bf16", "fp8"]


@dataclass(frozen=True)
class FloatFormat:
    """A low-precision float a method stores weights in: its SafeTensors dtype and largest finite value."""

    safetensors: str
    max: float


FLOAT_FORMATS: Final[dict[str, FloatFormat]] = {
    # OCP FP8 E4M3 (the "fn" variant: no infinities): 1.75 x 2^8.
    "float8_e4m3fn": FloatFormat("F8_E4M3", 448.0),
    # OCP FP4 E2M1 (NVFP4 and MXFP4 values): 1.5 x 2^2; SafeTensors has no 4-bit type, two are packed per U8.
    "float4_e2m1": FloatFormat("U8", 6.0),
}
# (scheme weight type, bits) -> the storage dtype it means; (activation type, bits) -> the matmul input.
_STORAGE: Final[dict[tuple[str, int], StorageDtype | None]] = {
    ("float", 8): "float8_e4m3fn",
    ("float", 4): "float4_e2m1",
    ("int", 8): "int8",
    ("int", 4): "int4",
}
_ACTIVATIONS: Final[dict[tuple[str, int], ActivationDtype]] = {
    ("float", 8): "float8_e4m3fn",
    ("float", 4): "float4_e2m1",
    ("int", 8): "int8",
}
_FP4_FORMATS: Final[dict[str, Fp4Format]] = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
_MATMUL: Final[dict[ActivationDtype, MatmulDtype]] = {
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8",
    "float4_e2m1": "fp4",
    "int8": "int8",
}


def weight_storage(w: WeightQuant | None) -> StorageDtype:
    """What weights of quantization `w` are stored as (bfloat16: not quantized)."""
    if w is None:
        return "bfloat16"
    stored = _STORAGE.get((w.type, w.num_bits))
    if stored is None:
        raise ValueError(f"no storage dtype for {w.num_bits}-bit {w.type} weights")
    return stored


@dataclass(frozen=True)
class GateDefaults:
    """A method's default eval thresholds (`eval.gates.Gate`'s fields)."""

    max_kl: float
    min_top1: float
    max_ppl_increase: float


Judge = Callable[["Method", HardwareProfile], Verdict]
SourceAction = Literal["keep", "dequantize", "refuse"]


@dataclass(frozen=True)
class SourceRoute:
    """What a method does with the quantized tensors of a source released in one layout, and why."""

    action: SourceAction
    reason: str


def keeps(reason: str) -> SourceRoute:
    """The release's quantized tensors are written as they are stored: its values' bytes, its scales renamed."""
    return SourceRoute("keep", reason)


def dequantizes(reason: str) -> SourceRoute:
    """The release's quantized tensors are dequantized (float32) and quantized again by the method's quantizer."""
    return SourceRoute("dequantize", reason)


def refuses(reason: str) -> SourceRoute:
    return SourceRoute("refuse", reason)


# The refusals several methods share, one per class of reason.
EXPERTS_LEFT_BF16: Final = refuses(
    "the release stores only its experts quantized, as stacked 3-D MXFP4 tensors, and the catalog's schemes quantize "
    "2-D Linears: the experts would be written in bf16, four times their released bytes, to quantize the attention "
    "alone; build mxfp4-experts (the release's own layout, its bytes), bf16 (the experts dequantized, for runtimes "
    "without MXFP4 kernels) or GGUF (every type kiln writes keeps the release's MXFP4 expert blocks, for llama.cpp)"
)
ANOTHER_8BIT: Final = refuses(
    "it quantizes the release's FP8 weights again into another 8-bit format: a second rounding for the same bytes; "
    "fp8-block writes the release's own blocks (and bf16 dequantizes them for hardware without FP8 units)"
)


@dataclass(frozen=True)
class Method:
    """One quantization method of the catalog."""

    scheme: Scheme
    weight_dtype: StorageDtype
    activation_dtype: ActivationDtype
    gate: GateDefaults
    on_cuda: Judge
    on_rocm: Judge
    kv_cache_dtype: KvCacheDtype = "bf16"
    # By released layout (`formats.prequantized.LAYOUTS`, by name): every one (tests/quant/test_catalog.py).
    from_sources: Mapping[str, SourceRoute] = field(default_factory=dict)
    release_only: bool = False

    def __post_init__(self) -> None:
        w, a = self.scheme.weights, self.scheme.input_activations
        stored = weight_storage(w)
        computed = "bfloat16" if a is None else _ACTIVATIONS.get((a.type, a.num_bits))
        if (stored, computed) != (self.weight_dtype, self.activation_dtype):
            raise ValueError(
                f"method {self.scheme.name!r} says {self.weight_dtype} weights and {self.activation_dtype} "
                f"activations; its scheme stores {stored} and computes in {computed}"
            )
        if (self.kv_cache_dtype == "fp8") != (self.scheme.kv_cache is not None):
            raise ValueError(f"method {self.scheme.name!r}: an FP8 KV cache is exactly a scheme with kv_cache")
        if self.release_only != (self.scheme.method == "released"):
            raise ValueError(f"method {self.scheme.name!r}: a release-only method is exactly a `released` scheme")
        if self.release_only and not any(r.action == "keep" for r in self.from_sources.values()):
            raise ValueError(f"method {self.scheme.name!r}: a release-only method keeps some release's bytes")

    @property
    def name(self) -> str:
        return self.scheme.name

    @property
    def matmul_dtype(self) -> MatmulDtype:
        """The input type of its matmuls, the hardware rate it runs at: fp4, fp8, int8, or bf16 (weight-only)."""
        return _MATMUL[self.activation_dtype]

    @property
    def fp4_format(self) -> Fp4Format | None:
        """The FP4 block format it stores (NVFP4: groups of 16, MXFP4: of 32), or None."""
        return _FP4_FORMATS.get(self.scheme.format)

    def matmul_dtype_on(self, hw: HardwareProfile) -> MatmulDtype:
        """What its matmuls run in on `hw`: its own `matmul_dtype` where `hw` has the units (an FP4 method
        only on a device taking its block format), else bf16 (weight-only, dequantized before the matmul)."""
        dtype = self.matmul_dtype
        if dtype == "fp4" and self.fp4_format not in hw.fp4:
            return "bf16"
        return hw.matmul_tflops(dtype)[1]

    @property
    def float_format(self) -> FloatFormat | None:
        """The float format its weights are stored in (FP8, FP4), or None for int and unquantized weights."""
        return FLOAT_FORMATS.get(self.weight_dtype)
