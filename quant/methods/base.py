"""A quantization method as one record: how it is stored (its `Scheme`), what it computes in, and where it runs.

A method states everything the rest of kiln asks of a quant name, so nothing re-derives it from the
scheme's fields ("a float scheme means FP8"):

- `weight_dtype`: what a quantized Linear weight is stored as (`bfloat16` when the method leaves it);
- `activation_dtype`: what the matmuls take as input (`bfloat16` for weight-only methods, which dequantize
  before each matmul), hence `matmul_dtype`, the hardware rate it runs at (`core.hardware.MatmulDtype`);
- `kv_cache_dtype`: the KV cache its serving replicas assume (`registry.resolve.fit.KV_DTYPES`);
- `gate`: its default eval thresholds (`eval.gates` builds its `Gate` from them);
- `on_cuda` / `on_rocm`: its verdict on an NVIDIA GPU of sm80+ and on an AMD GPU (`quant.catalog.compatibility`
  answers the CPU, TPU and pre-sm80 cases the same way for every method first).

`Method.__post_init__` checks the dtypes against the scheme, so a method cannot say FP8 where its scheme
stores int8. Plain data: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from core.hardware import HardwareProfile, MatmulDtype
from quant.schemes import Scheme, Verdict, WeightQuant

StorageDtype = Literal["bfloat16", "float8_e4m3fn", "int8", "int4"]
ActivationDtype = Literal["bfloat16", "float8_e4m3fn", "int8"]
KvCacheDtype = Literal["bf16", "fp8"]


@dataclass(frozen=True)
class FloatFormat:
    """A low-precision float a method stores weights in: its SafeTensors dtype and largest finite value."""

    safetensors: str
    max: float


FLOAT_FORMATS: Final[dict[str, FloatFormat]] = {
    # OCP FP8 E4M3 (the "fn" variant: no infinities): 1.75 x 2^8.
    "float8_e4m3fn": FloatFormat("F8_E4M3", 448.0),
}
# (scheme weight type, bits) -> the storage dtype it means; (activation type, bits) -> the matmul input.
_STORAGE: Final[dict[tuple[str, int], StorageDtype | None]] = {
    ("float", 8): "float8_e4m3fn",
    ("int", 8): "int8",
    ("int", 4): "int4",
}
_ACTIVATIONS: Final[dict[tuple[str, int], ActivationDtype]] = {("float", 8): "float8_e4m3fn", ("int", 8): "int8"}
_MATMUL: Final[dict[ActivationDtype, MatmulDtype]] = {"bfloat16": "bf16", "float8_e4m3fn": "fp8", "int8": "int8"}


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

    def __post_init__(self) -> None:
        w, a = self.scheme.weights, self.scheme.input_activations
        stored = weight_storage(w)
        computed = "bfloat16" if a is None else _ACTIVATIONS.get((a.type, a.num_bits))
        if (stored, computed) != (self.weight_dtype, self.activation_dtype):
            raise ValueError(
                f"method {self.scheme.name!r} says {self.weight_dtype} weights and {self.activation_dtype} "
                f"activations; its scheme stores {stored} and computes in {computed}"
            )

    @property
    def name(self) -> str:
        return self.scheme.name

    @property
    def matmul_dtype(self) -> MatmulDtype:
        """The input type of its matmuls, the hardware rate it runs at: fp8, int8, or bf16 (weight-only)."""
        return _MATMUL[self.activation_dtype]

    @property
    def float_format(self) -> FloatFormat | None:
        """The float format its weights are stored in (FP8), or None for int and unquantized weights."""
        return FLOAT_FORMATS.get(self.weight_dtype)
